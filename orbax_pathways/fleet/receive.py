"""Partner copies, the receiving end: another process's tier entry of a local-only step, written
into this node's tier file by file over the peer channel (``put``), then its manifest.

Who calls what, on which host (multi-controller JAX): ``peer/server.py``'s connection
thread calls ``receive`` for a ``put`` request (``Options.local_copies=2``: the sender is
``fleet/partner_copy.py``, in the background part of its local-only save) after the request's
MAC was checked (``peer/wire.py``). The request names the entry and one file, its size and
crc32c; that many raw bytes follow it. A chunk file is written as it arrives; the manifest,
sent last, makes the entry complete (an atomic rename, as ``tier/store.write_entry`` does) once
it describes that entry and names only files that arrived whole, of the size it records.

What it refuses, before it reads a byte of the body (the connection is then closed: the body
is never drained): a server started without a tier to take copies (``serve(tier=...)``), a
name that is not a tier path component, a chunk file's name or the manifest's; a size that
does not fit this node's tier (its free space less ``store.MARGIN_BYTES``, node memory on a
tmpfs), or a manifest over ``fsafe.MAX_SMALL_BYTES``; an entry this node already holds whole
(a complete entry is never overwritten). While reading: ``Limits.idle_s`` of silence ends it,
and a body whose crc32c is not the one its request names is removed. Every directory is
``0700``, every file ``0600``, nothing is written through a symlink (``tier/fsafe.py``).

What grows with what: one file's pieces of 1 MiB in memory at a time, whatever the
entry; a node receives the entries of the processes whose partner it is (one, in the usual
case: ``fleet/partners.py``). No jax here.
"""

from __future__ import annotations

import os
import shutil
import socket
from typing import Any, Mapping


from orbax_pathways.tier import fsafe
from orbax_pathways.tier import manifest as manifest_lib
from orbax_pathways.tier import config as tier_config
from orbax_pathways.tier import store
from orbax_pathways.peer import server as peer_server
from orbax_pathways.peer import wire



class Refused(peer_server.Refused):
  """A put this server does not take (answered with the text, then the connection closes)."""


def _part(value: Any, what: str) -> str:
  if not isinstance(value, str) or not wire.PART_RE.match(value) or value in ('.', '..'):
    raise Refused(f'not a tier path component ({what}): {str(value)[:64]!r}')
  return value


def check(req: Mapping[str, Any], tier: tier_config.TierConfig | None) -> tuple[tuple[str, str, str], str, str, int, int]:
  """The put's (item parts, entry, file, size, crc32c), or ``Refused`` saying why not. Pure
  but for this node's free space and whether the entry is already whole."""
  if tier is None:
    raise Refused('this process\'s tier takes no partner copies (its server was started for '
                  'restores only)')
  item = req.get('item')
  if not isinstance(item, (list, tuple)) or len(item) != 3:
    raise Refused('a put names an item as [root key, step, item]')
  parts = (_part(item[0], 'root key'), _part(item[1], 'step'), _part(item[2], 'item'))
  entry = _part(req.get('entry'), 'entry')
  if manifest_lib.parse_entry_name(entry) is None:
    raise Refused(f'{entry!r} is not an entry name (<writer>.<save id>)')
  file, size, crc = req.get('file'), req.get('size'), req.get('crc32c')
  if not isinstance(file, str) or not (manifest_lib.CHUNK_FILE_RE.match(file)
                                       or file == manifest_lib.MANIFEST):
    raise Refused(f'not a chunk file or manifest name: {str(file)[:64]!r}')
  if (isinstance(size, bool) or not isinstance(size, int) or size < 0
      or isinstance(crc, bool) or not isinstance(crc, int) or not 0 <= crc < 1 << 32):
    raise Refused(f'a put of {file} needs its size and crc32c as integers')
  where = f'{"/".join(parts)}/{entry}'
  if file == manifest_lib.MANIFEST and size > fsafe.MAX_SMALL_BYTES:
    raise Refused(f'{where}: a manifest of {size} bytes, more than the {fsafe.MAX_SMALL_BYTES} '
                  'a tier manifest may hold')
  path = os.path.join(tier.tier_dir, *parts, entry)
  if fsafe.exists(os.path.join(path, manifest_lib.MANIFEST)):
    raise Refused(f'{where}: this node holds that entry whole already; it is not overwritten')
  free = shutil.disk_usage(tier.tier_dir).free
  if size + store.MARGIN_BYTES > free:
    raise Refused(f'{where}/{file}: {size} bytes do not fit this node\'s tier ({free} bytes '
                  f'free, {store.MARGIN_BYTES} kept free: node memory)')
  return parts, entry, file, size, crc


def receive(sock: socket.socket, req: Mapping[str, Any], tier: tier_config.TierConfig | None,
            idle_s: float) -> bytes:
  """One put: the body into this node's tier; returns the (empty) answer, or raises
  ``Refused`` (nothing of the body read: the caller closes the connection) or ``OSError`` /
  ``socket.timeout`` / ``ConnectionError`` (the body cut short: its file removed)."""
  parts, entry, file, size, crc = check(req, tier)
  assert tier is not None
  where = f'{"/".join(parts)}/{entry}'
  path = fsafe.private_dirs(tier.tier_dir, *parts, entry)
  target = os.path.join(path, file + '.part' if file == manifest_lib.MANIFEST else file)
  fd = fsafe.open_new(target)
  try:
    got = wire.recv_to_file(sock, fd, size, idle_s=idle_s)
  except BaseException:
    os.close(fd)
    _unlink(target)
    raise
  os.close(fd)
  if got != crc:
    _unlink(target)
    raise Refused(f'{where}/{file}: the bytes that arrived have crc32c {got:08x}; the request '
                  f'said {crc:08x}')
  if file == manifest_lib.MANIFEST:
    _commit(tier, parts, entry, path, target)
  return b''


def _commit(tier: tier_config.TierConfig, parts: tuple[str, str, str], entry: str, path: str,
            part: str) -> None:
  """The manifest arrived: it must describe this entry and name only files that are here
  whole; then it replaces nothing (atomic rename) and the entry is marked committed with its
  step (``store.adopt``)."""
  where = f'{"/".join(parts)}/{entry}'
  try:
    m = manifest_lib.decode(fsafe.read_small(part))
  except (OSError, ValueError) as e:
    _unlink(part)
    raise Refused(f'{where}: the manifest does not decode: {e}') from None
  writer, save_id = manifest_lib.parse_entry_name(entry) or ('', '')
  why = manifest_lib.manifest_problem(m)
  if not why and (m.writer, m.save_id, m.step_name, m.item) != (writer, save_id, *parts[1:]):
    why = (f'it describes {m.writer}.{m.save_id} of {m.step_name}/{m.item}, not this entry')
  if not why and manifest_lib.root_key(m.root) != parts[0]:
    why = f'its checkpoint directory {m.root} is not the one the entry is filed under'
  if not why:
    for f, n in manifest_lib.file_sizes(m).items():
      try:
        fsafe.open_regular(os.path.join(path, f), n).close()
      except OSError as e:
        why = f'{f} did not arrive whole ({e})'
        break
  if why:
    _unlink(part)
    raise Refused(f'{where}: partner copy refused: {why}')
  root_file = os.path.join(tier.tier_dir, parts[0], manifest_lib.ROOT_FILE)
  if not fsafe.exists(root_file):
    try:
      fsafe.write_file(root_file, (m.root + '\n').encode(), exclusive=True)
    except FileExistsError:
      pass
  fsafe.replace(part, os.path.join(path, manifest_lib.MANIFEST))
  store.adopt(tier, path, m.root, m.step_name)


def _unlink(path: str) -> None:
  try:
    os.unlink(path)
  except OSError:
    pass
