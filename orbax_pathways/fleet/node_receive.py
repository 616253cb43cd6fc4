"""Partner copies of node steps, the node's side (``fleet/node_copy.py`` is the process's):
the ops of this process's peer server that take another process's node step into this node and
serve it back.

Who calls what, on which host (multi-controller JAX): ``peer/server.py``'s connection thread,
after the request's MAC was checked (``peer/wire.py``), for

- ``node_put`` (streamed: ``put_file``): one file of a node step, from the process whose
  partner this one is (``fleet/partners.py``), into
  ``<tier>/.node-steps/<digest>.copies/<writer>/<step>.incoming``;
- ``node_commit`` (no body: ``commit``): the files that arrived whole are the ones the sender
  listed (their count and ``node_copy.listing_digest``), so the copy replaces any older copy of
  that step at once (a rename) and the writer's copies beyond the newest ``keep`` are dropped;
- ``node_list`` / ``node_get`` (answers: ``listing``, ``get``): a copy this node keeps, or a
  node step saved in this node, its files with their sizes and crc32c, then each file streamed
  (``sendfile``), for a resume whose own node lacks the step (``node_steps.resume``) or that
  restores onto another layout (``node_gather.py``).

What it refuses, before it reads a byte of a body: a server started without a tier to take
copies; a digest, writer, step or path that is not one (``node_copy.relative_parts``); a file
that does not fit this node's tier (its free space less ``store.MARGIN_BYTES``); a ``keep``
out of 1..1024. Every directory ``0700``, every file ``0600``, nothing written or read through
a symlink (``tier/fsafe.py``). What grows with what: one file's pieces of 1 MiB in memory at a
time; a node keeps the copies of the processes whose partner it is (one, usually). No jax.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from typing import Any, Mapping

import msgpack

from orbax_pathways.fleet import node_copy
from orbax_pathways.format import names as format_names
from orbax_pathways.peer import server as peer_server
from orbax_pathways.peer import wire
from orbax_pathways.tier import config as tier_config
from orbax_pathways.tier import fsafe
from orbax_pathways.tier import store

_DIGEST_RE = re.compile(r'^[0-9a-f]{16}$')
_WRITER_RE = re.compile(r'^p\d{1,9}$')
_LISTING_RE = re.compile(r'^[0-9a-f]{64}$')
INCOMING = '.incoming'
MAX_KEEP = 1024


class Refused(peer_server.Refused):
  """A node step copy this server does not take (answered with the text; the connection
  closes)."""


def _head(req: Mapping[str, Any]) -> tuple[str, str, int]:
  digest, writer, step = req.get('digest'), req.get('writer'), req.get('step')
  if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
    raise Refused(f'not a node steps digest: {str(digest)[:32]!r}')
  if not isinstance(writer, str) or not _WRITER_RE.match(writer):
    raise Refused(f'not a writer (p<process>): {str(writer)[:32]!r}')
  if isinstance(step, bool) or not isinstance(step, int) or step < 0:
    raise Refused(f'not a step: {str(step)[:32]!r}')
  return digest, writer, step


def _writer_dir(tier: tier_config.TierConfig, digest: str, writer: str) -> str:
  return fsafe.private_dirs(tier.tier_dir, format_names.NODE_STEPS_DIR,
                            digest + node_copy.COPIES_SUFFIX, writer)


def _taking(tier: tier_config.TierConfig | None) -> tier_config.TierConfig:
  if tier is None:
    raise Refused('this process\'s tier takes no partner copies (its server was started for '
                  'restores only)')
  return tier


def put_file(sock: socket.socket, req: Mapping[str, Any], tier: tier_config.TierConfig | None,
             idle_s: float) -> bytes:
  """One ``node_put``: the file's bytes into the step's incoming directory, checked against
  the crc32c the request names; ``Refused`` before the body is read, or after it with the file
  removed when its crc32c differs."""
  tier = _taking(tier)
  digest, writer, step = _head(req)
  try:
    parts = node_copy.relative_parts(req.get('file'))
  except ValueError as e:
    raise Refused(str(e)) from None
  size, crc = req.get('size'), req.get('crc32c')
  if (isinstance(size, bool) or not isinstance(size, int) or size < 0
      or isinstance(crc, bool) or not isinstance(crc, int) or not 0 <= crc < 1 << 32):
    raise Refused('a node_put needs its size and crc32c as integers')
  free = shutil.disk_usage(tier.tier_dir).free
  if size + store.MARGIN_BYTES > free:
    raise Refused(f'{writer}/{step}/{"/".join(parts)}: {size} bytes do not fit this node\'s '
                  f'tier ({free} bytes free, {store.MARGIN_BYTES} kept free: node memory)')
  incoming = fsafe.private_dirs(_writer_dir(tier, digest, writer), f'{step}{INCOMING}',
                                *parts[:-1])
  target = os.path.join(incoming, parts[-1])
  fd = fsafe.open_new(target)
  try:
    got = wire.recv_to_file(sock, fd, size, idle_s=idle_s)
  except BaseException:
    os.close(fd)
    fsafe.remove_tree(target)
    raise
  os.close(fd)
  if got != crc:
    fsafe.remove_tree(target)
    raise Refused(f'{writer}/{step}/{"/".join(parts)}: the bytes that arrived have crc32c '
                  f'{got:08x}; the request said {crc:08x}')
  return b''


def commit(sock: socket.socket, req: Mapping[str, Any], tier: tier_config.TierConfig | None,
           idle_s: float) -> bytes:
  """One ``node_commit``: the files in the incoming directory (each checked against its crc32c
  as it arrived) are, path and size, the ones the sender listed (``count`` of them, whose
  ``node_copy.listing_digest`` is ``listing``), so the copy becomes ``<step>`` (an older copy of
  that step replaced) and the writer's copies beyond the newest ``keep`` are dropped."""
  del sock, idle_s  # no body
  tier = _taking(tier)
  digest, writer, step = _head(req)
  count, listing, keep = req.get('count'), req.get('listing'), req.get('keep')
  if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= MAX_KEEP:
    raise Refused(f'keep={str(keep)[:16]}: use 1..{MAX_KEEP}')
  if (isinstance(count, bool) or not isinstance(count, int)
      or not 0 < count <= node_copy.MAX_FILES
      or not isinstance(listing, str) or not _LISTING_RE.match(listing)):
    raise Refused('a node_commit names its files by their count (1..'
                  f'{node_copy.MAX_FILES}) and listing digest (64 hex digits)')
  base = _writer_dir(tier, digest, writer)
  incoming = os.path.join(base, f'{step}{INCOMING}')
  try:
    arrived = node_copy.files_of(incoming)
  except (OSError, ValueError) as e:
    raise Refused(f'{writer}/{step}: no copy arrived whole ({e})') from None
  if len(arrived) != count or node_copy.listing_digest(arrived) != listing:
    raise Refused(f'{writer}/{step}: the {len(arrived)} files that arrived are not the {count} '
                  'the sender listed (a file did not arrive whole)')
  final = os.path.join(base, str(step))
  fsafe.remove_tree(final)
  fsafe.replace(incoming, final)
  steps = sorted((int(n) for n in fsafe.subdirs(base) if n.isdigit()), reverse=True)
  for old in steps[keep:]:
    fsafe.remove_tree(os.path.join(base, str(old)))
  for name in fsafe.subdirs(base):  # a copy whose sender stopped midway
    if name.endswith(INCOMING) and name[:-len(INCOMING)].isdigit() and (
        int(name[:-len(INCOMING)]) < step):
      fsafe.remove_tree(os.path.join(base, name))
  return b''


def _kept(tier_dir: str, req: Mapping[str, Any]) -> str:
  """The directory of ``writer``'s part of a node step on this node: the copy it keeps, else
  the step a process saved in this node's own node steps (a resume onto another layout reads
  the parts its devices need from the nodes holding them)."""
  digest, writer, step = _head(req)
  path = node_copy.copy_dir(tier_dir, digest, writer, step)
  if fsafe.is_dir(path):
    return path
  path = os.path.join(tier_dir, format_names.NODE_STEPS_DIR, digest, str(step))
  # committed: a save killed midway is never served
  if fsafe.is_dir(path) and fsafe.exists(os.path.join(path, format_names.COMMIT_SUCCESS_FILE)):
    saved_by = node_copy.saver(path)
    if saved_by is not None and node_copy.writer_name(saved_by) == writer:
      return path
  raise FileNotFoundError(f'no part of {writer}\'s node step {step} here')


def listing(tier_dir: str, req: Mapping[str, Any]) -> bytes:
  """``node_list``: the files of a copy this node keeps, as ``[[path, size, crc32c], ...]``."""
  path = _kept(tier_dir, req)
  return msgpack.packb([[rel, size, fsafe.crc32c_of(os.path.join(path, *rel.split('/')), size)]
                        for rel, size in node_copy.files_of(path)], use_bin_type=True)


def get(tier_dir: str, req: Mapping[str, Any]) -> tuple[Any, int]:
  """``node_get``: one file of a copy this node keeps, opened (a regular file, no symlink)."""
  path = _kept(tier_dir, req)
  where = os.path.join(path, *node_copy.relative_parts(req.get('file')))
  size = os.lstat(where).st_size
  return fsafe.open_regular(where, size), size
