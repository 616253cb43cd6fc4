"""Spare files: a dropped tier entry's big chunk files, kept for the next save to write over.

Why: on tmpfs, writing a copy into fresh pages and freeing the previous step's pages costs about
three times the copy itself (page allocation, memory-cgroup charging, LRU locking on ``write``;
the same again on ``unlink``). A local-only save every step pays that on every host, on the cores
the training loop uses (``benchmarks/RESULTS.md``, "Multi-tier: the overhead on the training loop
(`local_steps.py`)"). Writing over the pages of a step that is being dropped anyway skips both: a
local-only save's CPU is 0.58x that without spares into a local directory, 0.65x on gs://
(``benchmarks/RESULTS.md``, "Tier spares: CPU per local-only save (`local_save_cpu.py`)",
2026-12-04).

Who calls what, on which host (every writer host, its own node's tier):

- ``retire(tier_dir, entry)``: ``tier/store.py``, where an entry this process wrote is dropped
  because newer steps replaced it (``prune`` after a commit, ``forget_step`` after Orbax deleted
  the step). Its chunk files of at least ``MIN_BYTES`` move (``rename``) into this writer's pool
  ``<tier_dir>/.spare/<slot>/``, named ``<bytes>.<generation>.<token>``; the caller then
  removes the rest of the entry. Only when the entry was written less than ``WINDOW_S`` ago
  (saves that frequent are the ones whose cost this saves; a job saving every ten minutes keeps
  today's memory: the old copy freed at once), and only for writers this process writes as.
  Spares of an older generation (a step retired before, whose spares the last save did not
  take) are unlinked then: a pool holds at most one entry's files per writer, the copy a save
  needs at its peak anyway.
- ``Pool(tier_dir, writer).claim(nbytes, dest)``: ``store.write_entry``, for each band file it
  writes. Takes a spare of exactly ``nbytes`` (``rename`` to ``dest``: one claimant wins), then
  opens it and takes a write *lease* (``F_SETLEASE``), which the kernel grants only when no
  other descriptor or mapping of the file exists anywhere: a restored array mapped onto the
  file, a peer server's mapping, a reader's open file. Refused, the spare is unlinked (its
  mapping keeps its pages) and the band is written to a new file as before. Granted, the caller
  writes the bytes through the returned descriptor and ``release``s it; an ``open`` of the file
  meanwhile (a reader that found the old name before the rename) waits for the release, then
  sees the new bytes, which the old step's checksums refuse.
- ``drop(tier_dir)``: ``store._make_room`` when a copy does not fit: spares go first.
  ``expire(tier_dir, now)``: ``tier/gc.collect`` drops spares older than ``WINDOW_S`` (a job
  that stopped).

Every path is inside the tier's private directory (``tier/fsafe.py``): directories ``0700``,
files ``0600`` owned by this uid with one link, never through a symlink. Linux only: without
leases (another OS, ``fs.leases-enable=0``) nothing is claimed and every band is a new file.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
import signal
import stat
import threading
import time
from typing import Callable, Iterator

from orbax_pathways.tier import fsafe
from orbax_pathways.tier import manifest as manifest_lib

POOL = '.spare'  # <tier_dir>/.spare/<slot>/<file>: a listing of root keys finds no entry in it
MIN_BYTES = 1 << 20  # smaller files: a new one costs little more than the claim
WINDOW_S = 120.0  # an entry written longer ago than this is freed, not kept as a spare

_lock = threading.Lock()
_ours: set[str] = set()  # writer names this process writes entries as (``store.write_entry``)


def note_writer(writer: str) -> None:
  """``store.write_entry``: this process writes as ``writer`` (only its entries are retired)."""
  with _lock:
    _ours.add(writer)


def _slot(writer: str) -> str:
  return hashlib.sha256(writer.encode()).hexdigest()[:16]


def _generation(entry: str) -> str:
  """The retired step an entry belongs to: its root key and step directory."""
  step_dir = os.path.dirname(os.path.dirname(entry))
  key = os.path.basename(os.path.dirname(step_dir))
  return hashlib.sha256(f'{key}/{os.path.basename(step_dir)}'.encode()).hexdigest()[:12]


def _pool_dir(tier_dir: str, writer: str) -> str | None:
  """``writer``'s pool when it exists, each component a real directory (``lstat``: never
  through a symlink), else None."""
  top = os.path.join(tier_dir, POOL)
  pool = os.path.join(top, _slot(writer))
  return pool if fsafe.is_dir(top) and fsafe.is_dir(pool) else None


def _parse(name: str) -> tuple[int, str] | None:
  parts = name.split('.')
  if len(parts) != 3 or not parts[0].isdigit():
    return None
  return int(parts[0]), parts[1]


def _own_file(st: os.stat_result, nbytes: int | None = None) -> bool:
  return (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
          and not st.st_mode & 0o077 and (nbytes is None or st.st_size == nbytes))


def retire(tier_dir: str, entry: str, now: float | None = None) -> int:
  """Moves the big chunk files of ``entry`` (an entry directory about to be removed) into its
  writer's pool; returns how many. Best effort: anything unexpected leaves the file where it
  is, for the caller's removal."""
  parsed = manifest_lib.parse_entry_name(os.path.basename(entry))
  if parsed is None:
    return 0
  writer = parsed[0]
  with _lock:
    if writer not in _ours:
      return 0
  now = time.time() if now is None else now
  try:
    written = os.lstat(os.path.join(entry, manifest_lib.MANIFEST)).st_mtime
  except OSError:
    return 0  # incomplete: never a spare
  if now - written > WINDOW_S:
    return 0
  gen = _generation(entry)
  try:
    found = []
    for name in fsafe.names(entry):
      if manifest_lib.CHUNK_FILE_RE.match(name):
        st = os.lstat(os.path.join(entry, name))
        if st.st_size >= MIN_BYTES and _own_file(st):
          found.append((name, st.st_size))
    old = _pool_dir(tier_dir, writer) or ''  # '' lists as empty
    for name in fsafe.names(old):  # spares an earlier retire left and no save took
      p = _parse(name)
      if p is None or p[1] != gen:
        fsafe.remove_tree(os.path.join(old, name))
    if not found:
      return 0
    pool = fsafe.private_dirs(tier_dir, POOL, _slot(writer))  # refuses a symlink in the way
    for name, size in found:
      dst = os.path.join(pool, f'{size}.{gen}.{secrets.token_hex(8)}')
      os.rename(os.path.join(entry, name), dst)
      os.utime(dst, follow_symlinks=False)  # the pool's clock: when it was retired
    return len(found)
  except OSError:
    return 0


def _lease(path: str, nbytes: int) -> int | None:
  """A read-write descriptor of ``path`` holding a write lease (no one else has it open or
  mapped, and no one can open it until ``release``), or None."""
  try:
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
  except OSError:
    return None
  try:
    if not _own_file(os.fstat(fd), nbytes):
      raise OSError(errno.EINVAL, 'not a spare')
    # A lease break signals the lease's owner (SIGIO kills by default): first a signal Python
    # ignores, then no owner at all; an opener then waits for ``release``.
    fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    fcntl.fcntl(fd, fcntl.F_SETOWN, 0)
  except (OSError, AttributeError):  # EAGAIN: open or mapped elsewhere; no leases here
    os.close(fd)
    return None
  return fd


def release(fd: int) -> None:
  """Ends ``claim``'s lease and closes its descriptor (the bytes written)."""
  try:
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
  finally:
    os.close(fd)


class Pool:
  """This writer's spares, listed once per entry written (``store.write_entry``)."""

  def __init__(self, tier_dir: str, writer: str, now: float | None = None):
    found = _pool_dir(tier_dir, writer)
    self._dir = found or ''
    self._by_size: dict[int, list[str]] = {}
    now = time.time() if now is None else now
    if not found:
      return
    for name in fsafe.names(self._dir):
      p = _parse(name)
      if p is None:
        continue
      try:
        fresh = now - os.lstat(os.path.join(self._dir, name)).st_mtime <= WINDOW_S
      except OSError:
        continue
      if fresh:
        self._by_size.setdefault(p[0], []).append(name)
      else:
        fsafe.remove_tree(os.path.join(self._dir, name))

  def claim(self, nbytes: int, dest: str) -> int | None:
    """A spare of exactly ``nbytes`` renamed to ``dest`` (a new name in an entry being
    written), open for writing under a lease: the caller writes every byte, then ``release``s
    it. None: no spare (write a new file)."""
    names = self._by_size.get(nbytes) if nbytes >= MIN_BYTES else None
    while names:
      src = os.path.join(self._dir, names.pop())
      try:
        os.rename(src, dest)
      except OSError:
        continue  # another process of this node took it, or it went
      fd = _lease(dest, nbytes)
      if fd is not None:
        return fd
      fsafe.remove_tree(dest)  # held elsewhere: never written over; its holder keeps its pages
    return None


def write(fd: int, data: bytes | memoryview) -> None:
  """Writes all of ``data`` over a claimed spare from offset 0 (the same size)."""
  view, offset = memoryview(data).cast('B'), 0
  while offset < len(view):
    offset += os.pwrite(fd, view[offset:], offset)


def drop(tier_dir: str) -> int:
  """Unlinks every spare of every writer under ``tier_dir``; returns the bytes freed."""
  return _remove(tier_dir, lambda st: True)


def expire(tier_dir: str, now: float | None = None) -> int:
  """Unlinks spares retired more than ``WINDOW_S`` ago (a job that stopped saving); returns
  the bytes freed."""
  now = time.time() if now is None else now
  return _remove(tier_dir, lambda st: now - st.st_mtime > WINDOW_S)


def _spares(tier_dir: str) -> Iterator[tuple[str, os.stat_result]]:
  """(path, lstat) of every spare of every writer under ``tier_dir`` (never through a
  symlink: ``.spare`` and each slot must be real directories)."""
  root = os.path.join(tier_dir, POOL)
  if fsafe.is_dir(root):
    for slot in fsafe.subdirs(root):
      yield from fsafe.walk_files(os.path.join(root, slot))


def _remove(tier_dir: str, which: Callable[[os.stat_result], bool]) -> int:
  freed = 0
  for path, st in _spares(tier_dir):
    if which(st):
      fsafe.remove_tree(path)
      freed += st.st_size
  return freed


def pooled(tier_dir: str) -> tuple[int, int]:
  """(spare files, their bytes) under ``tier_dir`` (``orbax-pathways tier``)."""
  found = [st.st_size for _, st in _spares(tier_dir)]
  return len(found), sum(found)
