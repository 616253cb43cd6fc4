"""Partner copies of node steps (``Options.local_copies=2`` with ``Options.local_steps_in=
'nodes'``), the process's side: its node step sent to its partner's node after the save, and,
at a resume, a copy its own node lacks fetched back from the node that keeps it.

A node step is a directory of Orbax's files (``multitier/node_steps.py``:
``<tier>/.node-steps/<digest>/<step>``). Its partner copy lies in the partner's node at
``<tier>/.node-steps/<digest>.copies/p<process>/<step>`` (``copy_dir``), written by
``fleet/node_receive.py``; a copy never shares a slice with its original (``fleet/partners.py``).

Who calls what, on which host (multi-controller JAX, every process of the job):

- ``send(step_dir, digest, writer, step, keep, address, secret, timeout_s)``: the background
  thread of a node step, right after the save (``multitier/node_partners.copy_to_partner``):
  each file of the step as one ``node_put`` request followed by its bytes (``sendfile``, never
  read whole), up to ``WINDOW`` of them sent before their answers are read (a state of many
  arrays is thousands of small files: one round trip each would add up), then ``node_commit``
  naming the files by their count and ``listing_digest`` (the list itself outgrows a request),
  which makes the copy whole on the partner at once.
  Returns None, or why the copy was not made (the caller logs it; the step keeps one copy).
- ``fetch(address, secret, digest, writer, step, into, timeout_s)``: at a resume, a process
  whose node lacks a step every other process can restore (``node_steps.resume``), from the
  node the resume's round named: ``node_list``, then ``node_get`` per file, into a directory
  beside ``into`` that is renamed to ``into`` once every file arrived whole.

Bounds: every request is authenticated (``peer/wire.py``); each file has ``timeout_s`` plus its
bytes at ``MIN_RATE``; paths are checked component by component (``relative_parts``); nothing
is written through a symlink (``tier/fsafe.py``). What grows with what: one connection per
node step saved, and per step fetched; the bytes are this process's part of the step. No jax.
"""

from __future__ import annotations

import collections
import hashlib
import os
import re
import socket
import stat
import time
from typing import Any, Callable

import msgpack

from orbax_pathways.format import names as format_names
from orbax_pathways.peer import wire
from orbax_pathways.tier import fsafe

MIN_RATE = 64 << 20  # bytes per second a copy's file is allowed at least, beyond timeout_s
MAX_FILES = 1 << 16  # files of one node step (a file per chunk, .zarray per array, metadata)
MAX_DEPTH = 8  # directories below a node step's directory
WINDOW = 64  # node_put requests sent ahead of their answers (each answer a few bytes)
COPIES_SUFFIX = '.copies'


def copy_dir(tier_dir: str, digest: str, writer: str, step: int | str) -> str:
  """Where a node keeps ``writer``'s (``p<process>``) copy of node step ``step`` (no I/O)."""
  return os.path.join(tier_dir, format_names.NODE_STEPS_DIR, digest + COPIES_SUFFIX, writer,
                      str(step))


def writer_name(process: int) -> str:
  return f'p{int(process)}'


_RECORD_RE = re.compile(r'^p(\d+)' + re.escape(format_names.PATHWAYS_SUFFIX) + '$')


def saver(step_dir: str) -> int | None:
  """The process that saved the node step at ``step_dir`` (its writer record, ``p<i>``, in an
  item's ``_pathways``), or None when no item has one (JSON only: the same on every process)."""
  for item in fsafe.subdirs(step_dir):
    for name in fsafe.names(os.path.join(step_dir, item, format_names.PATHWAYS_DIR)):
      found = _RECORD_RE.match(name)
      if found:
        return int(found.group(1))
  return None


def relative_parts(rel: Any) -> list[str]:
  """The components of a file's path relative to its node step, or ValueError: a string of at
  most ``MAX_DEPTH + 1`` tier path components (``wire.PART_RE``), none ``.`` or ``..``."""
  if not isinstance(rel, str) or len(rel) > 1024:
    raise ValueError(f'not a path inside a node step: {str(rel)[:64]!r}')
  parts = rel.split('/')
  if len(parts) > MAX_DEPTH + 1 or any(
      not wire.PART_RE.match(p) or p in ('.', '..') for p in parts):
    raise ValueError(f'not a path inside a node step: {rel[:64]!r}')
  return parts


def files_of(step_dir: str) -> list[tuple[str, int]]:
  """(path relative to ``step_dir``, size) of every regular file below it, sorted; ValueError
  for anything else there (a symlink, a device), too deep or too many."""
  if not fsafe.is_dir(step_dir):
    raise ValueError(f'{step_dir} is not a directory')
  out: list[tuple[str, int]] = []

  def walk(path: str, rel: tuple[str, ...]) -> None:
    for name in fsafe.names(path):
      st = os.lstat(os.path.join(path, name))
      here = (*rel, name)
      if stat.S_ISDIR(st.st_mode):
        if len(here) > MAX_DEPTH:
          raise ValueError(f'{step_dir}: directories deeper than {MAX_DEPTH}')
        walk(os.path.join(path, name), here)
      elif stat.S_ISREG(st.st_mode):
        out.append(('/'.join(here), st.st_size))
        if len(out) > MAX_FILES:
          raise ValueError(f'{step_dir}: more than {MAX_FILES} files')
      else:
        raise ValueError(f'{os.path.join(path, name)} is {fsafe.describe(st)}, not a regular '
                         'file: a node step holds files and directories only')

  walk(step_dir, ())
  for rel, _ in out:
    relative_parts(rel)
  return sorted(out)


def listing_digest(files: list[tuple[str, int]]) -> str:
  """The sha256 (hex) of a node step's files as ``files_of`` lists them (path and size, sorted):
  what a ``node_commit`` names, so the receiver checks what arrived against the sender's list
  in a request of fixed size."""
  h = hashlib.sha256()
  for rel, size in files:
    h.update(b'%s\0%d\n' % (rel.encode(), size))
  return h.hexdigest()


def _connect(address: str, secret: bytes, timeout_s: float) -> tuple[socket.socket, wire.Session]:
  host, _, port = address.rpartition(':')
  deadline = time.monotonic() + timeout_s
  sock = socket.create_connection((host, int(port)), timeout=timeout_s)
  try:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock, wire.connect(sock, secret, deadline)
  except BaseException:
    sock.close()
    raise


def _ask(sock: socket.socket, session: wire.Session, req: dict, deadline: float) -> int:
  """Sends ``req``; the size of its answer's payload, or ``wire.PeerError`` with the server's
  refusal."""
  wire.send_request(sock, session, msgpack.packb(req, use_bin_type=True), deadline)
  status, n = wire.recv_header(sock, deadline)
  if status != 0:
    text = wire.recv_bounded(sock, n, wire.MAX_ERROR_BYTES, deadline)
    raise wire.PeerError(text.decode(errors='replace'))
  return n


def send(step_dir: str, digest: str, writer: str, step: int, keep: int, address: str,
         secret: bytes, timeout_s: float) -> str | None:
  """Node step ``step_dir`` (``writer``'s step ``step``) to the server at ``address``, which
  keeps ``keep`` of ``writer``'s copies; None once whole there, else why not."""
  try:
    files = files_of(step_dir)
    sock, session = _connect(address, secret, timeout_s)
    try:
      head = {'digest': digest, 'writer': writer, 'step': int(step)}
      pending: collections.deque[tuple[str, float]] = collections.deque()

      def answered(ahead: int) -> None:  # reads answers until ``ahead`` are outstanding
        while len(pending) > ahead:
          what, until = pending.popleft()
          wire.recv_empty_answer(sock, until, what)

      try:
        for rel, size in files:
          path = os.path.join(step_dir, *rel.split('/'))
          deadline = time.monotonic() + timeout_s + size / MIN_RATE
          wire.send_request(sock, session, msgpack.packb(
              {'op': 'node_put', **head, 'file': rel, 'size': size,
               'crc32c': fsafe.crc32c_of(path, size)}, use_bin_type=True), deadline)
          sock.settimeout(max(0.001, deadline - time.monotonic()))
          with fsafe.open_regular(path, size) as f:
            sent = sock.sendfile(f, 0, size) if size else 0
          if sent != size:
            raise OSError(f'{rel}: sent {sent} of {size} bytes')
          pending.append((rel, deadline))
          answered(WINDOW)
        deadline = time.monotonic() + timeout_s
        wire.send_request(sock, session, msgpack.packb(
            {'op': 'node_commit', **head, 'count': len(files),
             'listing': listing_digest(files), 'keep': int(keep)}, use_bin_type=True), deadline)
        pending.append(('the commit', deadline))
        answered(0)
      except OSError:
        # The server refused a file and closed the connection while later ones were on their
        # way: its answer, already sent, says why.
        try:
          answered(0)
        except wire.PeerError as refused:
          raise refused from None
        except (OSError, wire.ProtocolError):
          pass
        raise
    finally:
      sock.close()
  except (OSError, ValueError, wire.PeerError, wire.ProtocolError) as e:
    return f'{type(e).__name__}: {e}'
  return None


def fetch(address: str, secret: bytes, digest: str, writer: str, step: int, into: str,
          timeout_s: float, only: Callable[[str], bool] | None = None) -> str | None:
  """``writer``'s copy of node step ``step`` from the server at ``address`` into the directory
  ``into`` (which must not exist; its parent must: a private directory of this node), whole
  or not at all; None once there, else why not. ``only``: the files to take, by relative path
  (default: every one)."""
  part = into + '.fetching'
  fsafe.remove_tree(part)
  try:
    sock, session = _connect(address, secret, timeout_s)
    try:
      head = {'digest': digest, 'writer': writer, 'step': int(step)}
      deadline = time.monotonic() + timeout_s
      n = _ask(sock, session, {'op': 'node_list', **head}, deadline)
      listed = msgpack.unpackb(wire.recv_bounded(sock, n, wire.MAX_LIST_BYTES, deadline),
                               raw=False)
      if not isinstance(listed, list) or len(listed) > MAX_FILES:
        raise wire.ProtocolError('a node_list answer is a list of [path, size, crc32c]')
      os.mkdir(part, fsafe.DIR_MODE)
      for item in listed:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[1], int)
                and isinstance(item[2], int) and item[1] >= 0):
          raise wire.ProtocolError(f'a node_list entry is [path, size, crc32c], not {item!r:.80}')
        rel, size, crc = item
        parts = relative_parts(rel)
        if only is not None and not only(rel):
          continue
        deadline = time.monotonic() + timeout_s + size / MIN_RATE
        got = _ask(sock, session, {'op': 'node_get', **head, 'file': rel}, deadline)
        if got != size:
          raise wire.ProtocolError(f'{rel}: an answer of {got} bytes; the list said {size}')
        directory = fsafe.private_dirs(part, *parts[:-1])
        fd = fsafe.open_new(os.path.join(directory, parts[-1]), exclusive=True)
        try:
          body = wire.recv_to_file(sock, fd, size, deadline=deadline)
        finally:
          os.close(fd)
        if body != crc:
          raise wire.ProtocolError(f'{rel}: the bytes that arrived have crc32c {body:08x}; the '
                                   f'list said {crc:08x}')
    finally:
      sock.close()
    fsafe.replace(part, into)
  except (OSError, ValueError, wire.PeerError, wire.ProtocolError) as e:
    fsafe.remove_tree(part)
    return f'{type(e).__name__}: {e}'
  return None
