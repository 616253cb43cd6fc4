"""Region buffers as page mappings of their own, and a tier chunk file mapped into one in place
of a copy.

Who calls what, on which host: the reader (``storage/reader.aligned_empty``, on the restoring
host) allocates every region buffer of ``reader.MAPPED_BYTES`` or more with ``anonymous``; the
restore's source chain (``tier/chunk_read.Place.fill_from_file``, in the restore's executor
threads) asks ``map_file`` to put a chunk file of this node's tier where the chunk lies in such
a buffer. No jax; numpy, ``mmap`` and one libc call.

Why: a chunk that this node's tier holds is already in memory (tmpfs is page cache). Copying it
into the region buffer costs the copy plus the first touch of the buffer's fresh pages; mapping
the file's pages privately there costs neither. The chain still checks the crc32c of the bytes
as they lie in the buffer, so a damaged copy is caught as before; the pages are read-populated
without breaking copy-on-write (``MADV_POPULATE_READ``), so that pass costs no page faults
either. On the CPU backend ``jax.device_put`` then aliases the buffer: the restored array is the
tier's own pages until something writes to them.

What a mapping means (``docs/format.md``): the mapping is private (``MAP_PRIVATE``), so a write
into the buffer (a later source's copy over a chunk whose crc32c failed, a storage read, a
donated array) copies that page and never reaches the tier's file. The tier's files are never
rewritten in place once their entry is complete (an entry's name carries its save id; the tier
GC unlinks), so the bytes stay those that were checked; a same-uid process that rewrote or
truncated a file under a live mapping could change or fault it, which the tier's threat model
(``docs/architecture.md``: another uid is the adversary; a same-uid process can do anything a
restore does) already grants. Unlinked files keep their pages until the last array that maps
them goes.

Bounds: only a chunk of at least ``MIN_BYTES`` that is one run of the buffer, starts on a page
boundary there and ends on one (or at the buffer's end) is mapped; at most ``MAX_MAPPED`` chunks
are mapped into live buffers per process (every mapping is one more kernel memory area, and the
system's limit is ~65,000 for everything the process maps); past it, and wherever mapping
fails, the caller copies as before. ``ORBAX_PATHWAYS_MAP_TIER=0`` turns mapping off.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from typing import Any
import weakref

import numpy as np

PAGE = mmap.PAGESIZE
MIN_BYTES = 1 << 20
MAX_MAPPED = 16384
ENV = 'ORBAX_PATHWAYS_MAP_TIER'

_MAP_FIXED = 0x10  # Linux's value on every architecture it runs on
_MADV_POPULATE_READ = 22  # Linux 5.14; older kernels say EINVAL and the pages fault on first read


class Pages(mmap.mmap):
  """An anonymous private mapping that holds region buffers (``anonymous``), and tier chunk
  files mapped into it (``map_file``). Given back, whole, when the last array on it goes."""

  mapped: list[int] | None = None  # [chunk files mapped into it], once there is one


_libc: Any = None
_lock = threading.Lock()
_live = 0  # chunk files mapped into buffers still alive, this process
_enabled: bool | None = None


def _mmap_fn():
  global _libc
  if _libc is None:
    lib = ctypes.CDLL(None, use_errno=True)
    fn = lib.mmap
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_long]
    _libc = fn
  return _libc


def enabled() -> bool:
  """Mapping is on: Linux, and not turned off with ``ORBAX_PATHWAYS_MAP_TIER=0``."""
  global _enabled
  if _enabled is None:
    _enabled = (sys.platform.startswith('linux')
                and os.environ.get(ENV, '1').strip().lower() not in ('0', 'false', 'off', 'no'))
  return _enabled


def anonymous(shape: Any, dtype: Any) -> np.ndarray:
  """An uninitialized C-order array of ``shape`` and ``dtype`` on a fresh page mapping of its
  own (page-aligned)."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  # Private: Python's default (shared) makes the mapping shmem, whose first touch costs ~1.4x a
  # private page's here (``benchmarks/RESULTS.md``), and nothing else ever maps these pages.
  buf = Pages(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
  return np.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize).reshape(shape)


def owner(arr: np.ndarray) -> Pages | None:
  """The ``Pages`` that ``arr``'s bytes lie on, or None (numpy's own memory, anything else)."""
  base: Any = arr
  while isinstance(base, np.ndarray):
    base = base.base
  if isinstance(base, memoryview):
    base = base.obj
  return base if isinstance(base, Pages) else None


def _release(count: int) -> None:
  global _live
  with _lock:
    _live -= count


def _release_all(mapped: list[int]) -> None:
  """A ``Pages`` went (munmapped whole): its chunk mappings leave the budget."""
  _release(mapped[0])


def map_file(buffer: np.ndarray, offset: int, nbytes: int, fd: int) -> memoryview | None:
  """Maps the first ``nbytes`` of the file ``fd`` privately over ``buffer``'s bytes
  ``[offset, offset + nbytes)`` and returns those bytes (read-populated), or None where that
  cannot be done (the caller copies): mapping off, ``buffer`` not on ``Pages``, the range not on
  page boundaries (its end may be the buffer's end), under ``MIN_BYTES``, the per-process
  budget spent, or the kernel refused (the range then holds fresh zero pages again)."""
  global _live
  if not enabled() or nbytes < MIN_BYTES:
    return None
  pages = owner(buffer)
  if pages is None or not buffer.flags.c_contiguous:
    return None
  flat = buffer.reshape(-1).view(np.uint8)
  start = flat.ctypes.data + offset
  if start % PAGE or (nbytes % PAGE and offset + nbytes != flat.nbytes):
    return None
  base = ctypes.addressof(ctypes.c_char.from_buffer(pages))
  length = -(-nbytes // PAGE) * PAGE
  if not (base <= start and start + length <= base + -(-len(pages) // PAGE) * PAGE):
    return None
  try:
    if os.fstat(fd).st_size < nbytes:  # a mapping past a file's end faults (SIGBUS) on read
      return None
  except OSError:
    return None
  with _lock:
    if _live >= MAX_MAPPED:
      return None
    _live += 1
  fn = _mmap_fn()
  got = fn(start, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
  if got != start:
    # MAP_FIXED that failed may have left the range unmapped: put fresh anonymous pages back
    # (the buffer's bytes there were never written: the chunk is copied in next).
    back = fn(start, length, mmap.PROT_READ | mmap.PROT_WRITE,
              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
    _release(1)
    if back != start:
      raise OSError(ctypes.get_errno(), f'could not restore the region buffer at {start:#x} '
                    f'after a failed mapping of a tier file: {os.strerror(ctypes.get_errno())}')
    return None
  with _lock:
    if pages.mapped is None:
      pages.mapped = [0]
      weakref.finalize(pages, _release_all, pages.mapped)  # holds the count, not the pages
    pages.mapped[0] += 1
  view = flat.data[offset:offset + nbytes]
  try:
    pages.madvise(_MADV_POPULATE_READ, start - base, length)
  except (OSError, ValueError):
    pass  # an older kernel: the pages fault on first read instead
  return view


def live() -> int:
  """Chunk files mapped into region buffers still alive in this process."""
  return _live
