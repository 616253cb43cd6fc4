"""crc32c of array chunks, the integrity check recorded at save and verified at restore.

Computed on whichever host holds the chunk's bytes (writer host at save, reader host at restore,
the CLI for ``verify``). Definition: crc32c (Castagnoli) of the chunk's elements in the stored
dtype, C order, native little-endian bytes. The ``crc32c`` package hashes numpy memory in place
and releases the GIL for buffers of 32 KiB or more. A chunk that is a strided view of a larger
buffer (a column block of a row-major region) is hashed run by run where its runs are at least
``BLOCK_BYTES`` long; shorter runs (thousands of 8 KiB rows, each one Python call holding the
GIL) are copied slab by slab into a per-thread scratch buffer of ``BLOCK_BYTES`` and hashed
there: two C calls per slab, both without the GIL, and never more than that buffer of memory.
"""

from __future__ import annotations

import threading

import crc32c as _crc32c
import numpy as np

BLOCK_BYTES = 1 << 20
_scratch = threading.local()


def _contiguous_tail(a: np.ndarray) -> int:
  """How many trailing dimensions of ``a`` are laid out contiguously (C order)."""
  expected = a.itemsize
  k = 0
  for dim, stride in zip(reversed(a.shape), reversed(a.strides)):
    if dim != 1 and stride != expected:
      break
    expected *= dim
    k += 1
  return k


def of_array(a: np.ndarray) -> int:
  """crc32c of ``a``'s elements in C order, without copying strided views."""
  if a.size == 0:
    return 0
  if a.flags.c_contiguous:
    return _crc32c.crc32c(a.reshape(-1).view(np.uint8).data)
  k = _contiguous_tail(a)
  if k == 0:  # innermost dimension strided (rare: transposed views): copy.
    return of_array(np.ascontiguousarray(a))
  if int(np.prod(a.shape[a.ndim - k:])) * a.itemsize >= BLOCK_BYTES:
    return _runs(a, k, 0)
  return _slabs(a, 0)


def _slabs(a: np.ndarray, crc: int) -> int:
  """Extends ``crc`` over ``a`` (C order), copying consecutive slabs along its first dimension
  into this thread's scratch buffer of ``BLOCK_BYTES`` and hashing them there."""
  if a.flags.c_contiguous:
    return _crc32c.crc32c(a.reshape(-1).view(np.uint8).data, crc)
  row = a.nbytes // a.shape[0]
  if row > BLOCK_BYTES:  # one index of the first dimension is more than a slab: go down one
    for sub in a:
      crc = _slabs(sub, crc)
    return crc
  buf = getattr(_scratch, 'buf', None)
  if buf is None:
    buf = _scratch.buf = np.empty(BLOCK_BYTES, np.uint8)
  step = BLOCK_BYTES // row
  for i in range(0, a.shape[0], step):
    part = a[i:i + step]
    n = part.nbytes
    np.copyto(buf[:n].view(a.dtype).reshape(part.shape), part, casting='no')
    crc = _crc32c.crc32c(buf[:n].data, crc)
  return crc


def _runs(a: np.ndarray, k: int, crc: int) -> int:
  """Extends ``crc`` over ``a`` block by block, each block its ``k`` contiguous trailing
  dimensions (iterating an array yields views: one C call per block, no copies)."""
  if a.ndim == k:
    # numpy's stubs give ndarray __buffer__ only for Python >= 3.12; crc32c < 2.5 has no types.
    return _crc32c.crc32c(a, crc)  # type: ignore[arg-type, unused-ignore]
  for sub in a:
    crc = _runs(sub, k, crc)
  return crc
