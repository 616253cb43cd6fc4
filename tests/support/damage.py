"""Damaging stored bytes the way a bad disk or a truncated copy would, for checksum tests.

Called by tests in the test process, on files under the test's own ``tmp_path``; the bytes to
damage are found by content (a run of the array's stored bytes), never by guessing offsets.
"""

from __future__ import annotations

import pathlib
from typing import Iterable


def flip_bit_in(files: Iterable[pathlib.Path], needle: bytes, *, what: str,
                offset: int = 10) -> pathlib.Path:
  """Flips the lowest bit of the byte ``offset`` bytes into the first occurrence of ``needle``,
  in the first of ``files`` that holds it (directories are skipped); returns that file. Raises
  ``AssertionError`` naming ``what`` when no file holds the bytes."""
  assert 0 <= offset < len(needle), (offset, len(needle))
  for path in files:
    if not path.is_file():
      continue
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    if at >= 0:
      data[at + offset] ^= 0x01
      path.write_bytes(bytes(data))
      return path
  raise AssertionError(f'{what}: bytes not found in any data file')
