"""Damaging stored bytes the way a bad disk or a truncated copy would, for checksum tests.

Called by tests in the test process, on files under the test's own ``tmp_path``; the bytes to
damage are found by content (a run of the array's stored bytes), never by guessing offsets.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Iterable

_CHUNK = re.compile(r'^\d+(\.\d+)*$')  # a zarr v2 chunk key with the '.' separator


def is_node_data_file(path: str | os.PathLike) -> bool:
  """Whether ``path`` holds array bytes of a node step (``multitier/node_steps.py``): a chunk
  file of one of its arrays (zarr without OCDBT: a file per chunk beside the array's
  ``.zarray``), or a data file (``d/``) of a node step saved as OCDBT, as older versions did."""
  p = pathlib.Path(path)
  if p.parent.name == 'd':
    return True
  return bool(_CHUNK.match(p.name)) and (p.parent / '.zarray').is_file()


def flip_middle_bit(files: Iterable[pathlib.Path]) -> None:
  """Flips bit 4 of the middle byte of each of ``files`` (a chunk's bytes, or an OCDBT data
  file's chunks and B-tree alike)."""
  for path in files:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def node_data_files(directory: str | os.PathLike) -> list[pathlib.Path]:
  """Every data file (``is_node_data_file``) under ``directory``: a node step, one of its
  items, or a partner copy; sorted."""
  return sorted(p for p in pathlib.Path(directory).rglob('*')
                if p.is_file() and is_node_data_file(p))


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
