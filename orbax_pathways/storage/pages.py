"""Region buffers as page mappings of their own, and a tier chunk file mapped into one in place
of a copy.

Who calls what, on which host: the reader (``storage/reader.aligned_empty``, on the restoring
host) allocates every region buffer of ``reader.MAPPED_BYTES`` or more with ``anonymous``; the
restore's source chain (``tier/chunk_read.Place.fill_from_file``, in the restore's executor
threads) asks ``map_file`` to put a chunk file of this node's tier where the chunk lies in such
a buffer. Region buffers come from pages a freed buffer left where there are some
(``page_pool``). No jax; numpy and libc's ``mmap``, ``munmap`` and ``madvise``.

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
import time
from typing import Any

import numpy as np

from orbax_pathways.storage import page_pool

PAGE = mmap.PAGESIZE
MIN_BYTES = 1 << 20
MAX_MAPPED = 16384
ENV = 'ORBAX_PATHWAYS_MAP_TIER'

_MAP_FIXED = 0x10  # Linux's value on every architecture it runs on
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15
HUGE = 2 << 20  # the transparent huge page size of x86-64 and of arm64 with 4 KiB pages
HUGE_FAULT_S = 0.001  # a first huge-page fault slower than this: small pages for a while
SMALL_PAGES_S = 1.0


class _State:
  """This module's process-wide state (one object: no `global` statement)."""

  enabled: bool | None = None
  libc: Any = None
  live = 0  # chunk files mapped into buffers still alive, this process
  small_until = 0.0  # monotonic time until which fresh mappings take small pages


_state = _State()
_MADV_POPULATE_READ = 22  # Linux 5.14; older kernels say EINVAL and the pages fault on first read


class Pages:
  """The page range one region buffer lies on (``anonymous``), and the tier chunk files mapped
  into it (``map_file``). numpy arrays on it hold it as their base (``__array_interface__``);
  when the last one goes, the range goes to ``page_pool`` (kept for the next buffers of this
  process), or, with a tier file mapped into it, back to the system at once."""

  __slots__ = ('addr', 'length', 'mapped', '__weakref__')

  def __init__(self, addr: int, length: int):
    self.addr = addr
    self.length = length
    self.mapped = 0  # chunk files mapped into it

  @property
  def __array_interface__(self) -> dict[str, Any]:
    return {'version': 3, 'shape': (self.length,), 'typestr': '|u1',
            'data': (self.addr, False)}

  def __del__(self):
    try:
      if self.mapped:
        _lib().munmap(self.addr, self.length)
        _release(self.mapped)
      else:
        page_pool.give(self.addr, self.length)
    except Exception:  # pylint: disable=broad-except
      pass  # interpreter shutdown: the process's mappings go with it


_lock = threading.Lock()


def _lib() -> Any:
  if _state.libc is None:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int, ctypes.c_long]
    lib.munmap.restype = ctypes.c_int
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.madvise.restype = ctypes.c_int
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _state.libc = lib
  return _state.libc


def _mmap_fn():
  return _lib().mmap


def enabled() -> bool:
  """Mapping is on: Linux, and not turned off with ``ORBAX_PATHWAYS_MAP_TIER=0``."""
  if _state.enabled is None:
    _state.enabled = (sys.platform.startswith('linux') and os.environ.get(ENV, '1').strip()
                      .lower() not in ('0', 'false', 'off', 'no'))
  return _state.enabled


def anonymous(shape: Any, dtype: Any) -> np.ndarray:
  """An uninitialized C-order array of ``shape`` and ``dtype`` on page-aligned memory of its
  own: pages a freed buffer of this process left (``page_pool``: already faulted in), else a
  fresh private anonymous mapping."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  length = -(-max(nbytes, 1) // PAGE) * PAGE
  addr = page_pool.take(length)
  if addr is None:
    addr = _fresh(length)
  buf = np.asarray(Pages(addr, length))
  return buf[:nbytes].view(dtype).reshape(shape)


def _fresh(length: int) -> int:
  """A fresh private anonymous mapping of ``length`` bytes, with transparent huge pages where
  they are cheap right now.

  A huge page costs one fault for 2 MiB where small pages cost 512, so it is the cheaper way to
  fill memory the system has at hand (this process's or another's freshly freed memory). But
  its first touch can cost far more than those 512 faults: memory a VM's host has taken back
  (this project's VMs: ~5 ms a huge page in a fresh process, 1.1 GiB restored in 4-5 s against
  ~1 s on small pages), or direct compaction of fragmented memory. So the mapping asks for huge
  pages and times the first one's fault: past ``HUGE_FAULT_S`` (about what its 512 small pages
  cost here) the rest of the mapping, and every fresh mapping for ``SMALL_PAGES_S`` after it,
  take small pages instead; then huge pages are tried again."""
  # Private: a shared mapping is shmem, whose first touch costs ~1.4x a private page's (45 ms
  # against 32 ms for 59 MB, 3 runs each of a /tmp micro-benchmark on this project's 2-core VM,
  # 2026-12-04), and nothing else ever maps these pages.
  lib = _lib()
  addr = lib.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE,
                  mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
  if addr is None or addr == ctypes.c_void_p(-1).value:
    err = ctypes.get_errno()
    raise MemoryError(f'mmap of {length} bytes for a region buffer failed: {os.strerror(err)}')
  first = -(-addr // HUGE) * HUGE  # the first whole huge page inside the mapping
  if first + HUGE <= addr + length and time.monotonic() >= _state.small_until:
    if lib.madvise(addr, length, _MADV_HUGEPAGE) == 0:
      t0 = time.perf_counter()
      ctypes.memset(first, 0, 1)
      if time.perf_counter() - t0 > HUGE_FAULT_S:
        _state.small_until = time.monotonic() + SMALL_PAGES_S
        lib.madvise(addr, length, _MADV_NOHUGEPAGE)
  return addr


def owner(arr: np.ndarray) -> Pages | None:
  """The ``Pages`` that ``arr``'s bytes lie on, or None (numpy's own memory, anything else)."""
  base: Any = arr
  while isinstance(base, np.ndarray):
    base = base.base
  return base if isinstance(base, Pages) else None


def _release(count: int) -> None:
  """``count`` chunk files' mappings went (their ``Pages`` was unmapped whole)."""
  with _lock:
    _state.live -= count


def map_file(buffer: np.ndarray, offset: int, nbytes: int, fd: int) -> memoryview | None:
  """Maps the first ``nbytes`` of the file ``fd`` privately over ``buffer``'s bytes
  ``[offset, offset + nbytes)`` and returns those bytes (read-populated), or None where that
  cannot be done (the caller copies): mapping off, ``buffer`` not on ``Pages``, the range not on
  page boundaries (its end may be the buffer's end), under ``MIN_BYTES``, the per-process
  budget spent, or the kernel refused (the range then holds fresh zero pages again)."""
  if not enabled() or nbytes < MIN_BYTES:
    return None
  pages = owner(buffer)
  if pages is None or not buffer.flags.c_contiguous:
    return None
  flat = buffer.reshape(-1).view(np.uint8)
  start = flat.ctypes.data + offset
  if start % PAGE or (nbytes % PAGE and offset + nbytes != flat.nbytes):
    return None
  base = pages.addr
  length = -(-nbytes // PAGE) * PAGE
  if not (base <= start and start + length <= base + pages.length):
    return None
  try:
    if os.fstat(fd).st_size < nbytes:  # a mapping past a file's end faults (SIGBUS) on read
      return None
  except OSError:
    return None
  with _lock:
    if _state.live >= MAX_MAPPED:
      return None
    _state.live += 1
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
    pages.mapped += 1  # the whole mapping is unmapped, never pooled, when its arrays go
  view = flat.data[offset:offset + nbytes]
  # An older kernel says EINVAL: the pages then fault on first read instead.
  _lib().madvise(start, length, _MADV_POPULATE_READ)
  return view


def live() -> int:
  """Chunk files mapped into region buffers still alive in this process."""
  return _state.live
