"""crc32c of array chunks, the integrity check recorded at save and verified at restore.

Computed on whichever host holds the chunk's bytes (writer host at save, reader host at restore,
the CLI for ``verify``). Definition: crc32c (Castagnoli) of the chunk's elements in the stored
dtype, C order, native little-endian bytes. The ``crc32c`` package hashes numpy memory in place
and releases the GIL; a chunk that is a strided view of a larger buffer (a column block of a
row-major region) is hashed run by run, extending the crc, so it is never copied.
"""

from __future__ import annotations

import crc32c as _crc32c
import numpy as np


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
  return _runs(a, k, 0)


def _runs(a: np.ndarray, k: int, crc: int) -> int:
  """Extends ``crc`` over ``a`` block by block, each block its ``k`` contiguous trailing
  dimensions (iterating an array yields views: one C call per block, no copies)."""
  if a.ndim == k:
    # numpy's stubs give ndarray __buffer__ only for Python >= 3.12; crc32c < 2.5 has no types.
    return _crc32c.crc32c(a, crc)  # type: ignore[arg-type, unused-ignore]
  for sub in a:
    crc = _runs(sub, k, crc)
  return crc
