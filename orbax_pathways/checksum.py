"""crc32c of array chunks, the integrity check recorded at save and verified at restore.

Computed on whichever host holds the chunk's bytes (writer host at save, reader host at restore,
the CLI for ``verify``). Definition: crc32c (Castagnoli) of the chunk's elements in the stored
dtype, C order, native little-endian bytes. The ``crc32c`` package hashes the numpy buffer in
place (no copy) and releases the GIL, so several chunks hash in parallel threads.
"""

from __future__ import annotations

import crc32c as _crc32c
import numpy as np


def of_array(a: np.ndarray) -> int:
  """crc32c of ``a``'s elements in C order (copies only when ``a`` is not C-contiguous)."""
  a = np.ascontiguousarray(a)
  if a.size == 0:
    return 0
  return _crc32c.crc32c(a.reshape(-1).view(np.uint8).data)
