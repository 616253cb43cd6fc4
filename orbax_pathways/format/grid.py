"""An array's chunks as the index stores them: one crc32c per cell of its regular chunk grid
(``ChunkGrid``), looked up by origin without building every record (``ChunkMap``), and the
join of several writers' chunk lists (``chunk_index``).

Who calls it: ``format/item.py`` (the index codec), every reading host (the records of the
chunks it reads), the CLI. Pure: numpy arithmetic, no I/O.
"""

from __future__ import annotations

import collections.abc
import functools
import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from orbax_pathways.format.records import ArrayRecord, ChunkRecord


class ChunkGrid(collections.abc.Sequence):
  """The chunks of one array as the index stores them: one crc32c per cell of the array's
  regular chunk grid (C order), cells without a record marked absent; each chunk's origin and
  byte count follow from its cell.

  Behaves as the sequence of its ``ChunkRecord``s (C order of the grid) and, through ``get``,
  as a mapping origin -> ``ChunkRecord``; records are made on access, so a host that restores a
  few chunks of a large checkpoint pays for those only.

  The writer column (``writer``: per cell an index into ``writer_names``, -1 where unknown; None
  when the index has none) says who wrote each chunk: a restore asks only the holders of those
  writers' copies for the chunks it lacks (``peer/client.PeerSource``).
  """

  def __init__(self, shape: Sequence[int], chunk_shape: Sequence[int], itemsize: int,
               crc32c: np.ndarray, present: np.ndarray | None = None,
               writer: np.ndarray | None = None, writer_names: Sequence[str] = ()):
    self.shape = tuple(int(d) for d in shape)
    self.chunk_shape = tuple(int(c) for c in chunk_shape)
    self.grid = grid_shape(self.shape, self.chunk_shape)
    self.itemsize = int(itemsize)
    self.crc32c = crc32c
    self.present = present  # None: every cell has a record
    if crc32c.shape != (math.prod(self.grid),) or (present is not None and present.shape != crc32c.shape):
      raise ValueError(f'chunk grid {self.grid} needs {math.prod(self.grid)} checksums, '
                       f'got {crc32c.shape[0]}')
    if writer is not None and (writer.shape != crc32c.shape
                               or (writer.size and int(writer.max()) >= len(writer_names))
                               or (writer.size and int(writer.min()) < -1)):
      raise ValueError(f'chunk grid {self.grid}: a writer column of {writer.shape[0]} cells '
                       f'that are not indices into its {len(writer_names)} writers')
    self.writer = writer
    self.writer_names = tuple(writer_names)

  def writers_at(self, origins: Sequence[Sequence[int]]) -> set[str]:
    """The writers of the cells at ``origins`` that the column names (vectorized: one numpy
    pass, however many origins; origins off the grid are ignored)."""
    if self.writer is None or not len(origins) or not self.grid:
      return set()
    o = np.asarray(origins, np.int64).reshape(len(origins), len(self.grid))
    c = np.asarray(self.chunk_shape, np.int64)
    cells = o // c
    ok = ((o % c == 0) & (cells >= 0) & (cells < np.asarray(self.grid))).all(axis=1)
    if not ok.any():
      return set()
    flat = np.ravel_multi_index(tuple(cells[ok].T), self.grid)
    ids = np.unique(self.writer[flat])
    return {self.writer_names[i] for i in ids.tolist() if i >= 0}

  def writer_of(self, flat: int) -> str:
    """Who wrote cell ``flat`` ('' where the column is absent or does not say)."""
    if self.writer is None:
      return ''
    w = int(self.writer[flat])
    return self.writer_names[w] if w >= 0 else ''

  @functools.cached_property
  def _cells(self) -> np.ndarray:
    """Flat indices of the cells that have a record."""
    n = self.crc32c.shape[0]
    return np.arange(n) if self.present is None else np.flatnonzero(self.present)

  def _record(self, flat: int) -> ChunkRecord:
    cell = np.unravel_index(flat, self.grid) if self.grid else ()
    origin = tuple(int(i) * c for i, c in zip(cell, self.chunk_shape))
    n = math.prod(min(o + c, d) - o for o, c, d in zip(origin, self.chunk_shape, self.shape))
    return ChunkRecord(origin, int(self.crc32c[flat]), n * self.itemsize, self.writer_of(flat))

  def get(self, origin: Sequence[int], default: Any = None) -> ChunkRecord | Any:
    if len(origin) != len(self.grid):
      return default
    flat = 0
    for o, c, g in zip(origin, self.chunk_shape, self.grid):
      if o % c or not 0 <= o // c < g:
        return default
      flat = flat * g + o // c
    if self.present is not None and not self.present[flat]:
      return default
    return self._record(flat)

  def __len__(self) -> int:
    return int(self._cells.shape[0])

  def __getitem__(self, i):
    if isinstance(i, slice):
      return tuple(self._record(int(f)) for f in self._cells[i])
    return self._record(int(self._cells[i]))

  def __iter__(self):
    return (self._record(int(f)) for f in self._cells)

  def __eq__(self, other) -> bool:
    if not isinstance(other, collections.abc.Sequence) or isinstance(other, (str, bytes)):
      return NotImplemented
    return len(self) == len(other) and sorted(self, key=_origin) == sorted(other, key=_origin)

  def __hash__(self) -> int:
    return hash((self.shape, self.chunk_shape, self.crc32c.tobytes()))

  def __repr__(self) -> str:
    return f'ChunkGrid(grid={self.grid}, chunks={len(self)})'

  def mapping(self) -> 'ChunkMap':
    """This grid as the mapping origin -> ``ChunkRecord`` (``chunk_index``)."""
    return ChunkMap(self)

  @classmethod
  def of(cls, shape: Sequence[int], chunk_shape: Sequence[int], itemsize: int,
         chunks: Sequence[ChunkRecord]) -> 'ChunkGrid | None':
    """``chunks`` on their grid, or None if one does not sit on it (an origin off the grid, or a
    byte count other than its clipped cell's)."""
    if isinstance(chunks, ChunkGrid):
      return chunks
    shape, chunk_shape = tuple(shape), tuple(chunk_shape)
    if len(shape) != len(chunk_shape) or any(c <= 0 for c in chunk_shape):
      return None
    grid = grid_shape(shape, chunk_shape)
    crc = np.zeros(math.prod(grid), np.uint32)
    present = np.zeros(crc.shape, bool)
    writer = np.full(crc.shape, -1, np.int32)
    names: dict[str, int] = {}
    for c in chunks:
      if len(c.origin) != len(grid):
        return None
      flat = 0
      for o, k, g in zip(c.origin, chunk_shape, grid):
        if o % k or not 0 <= o // k < g:
          return None
        flat = flat * g + o // k
      n = math.prod(min(o + k, d) - o for o, k, d in zip(c.origin, chunk_shape, shape))
      if c.nbytes != n * itemsize:
        return None
      crc[flat] = c.crc32c
      present[flat] = True
      if c.writer:
        writer[flat] = names.setdefault(c.writer, len(names))
    return cls(shape, chunk_shape, itemsize, crc, None if present.all() else present,
               writer if names else None, tuple(names))


class ChunkMap(collections.abc.Mapping):
  """A ``ChunkGrid`` as the mapping origin -> ``ChunkRecord`` that ``chunk_index`` returns."""

  def __init__(self, grid: ChunkGrid):
    self.grid = grid

  def __getitem__(self, origin):
    rec = self.grid.get(origin)
    if rec is None:
      raise KeyError(origin)
    return rec

  def get(self, origin, default=None):
    return self.grid.get(origin, default)

  def __iter__(self):
    return (c.origin for c in self.grid)

  def __len__(self) -> int:
    return len(self.grid)

  def values(self):
    return list(self.grid)

  def __repr__(self) -> str:
    return f'ChunkMap({self.grid!r})'


def chunk_index(records: Iterable[ArrayRecord]) -> Mapping[tuple[int, ...], ChunkRecord]:
  """Origin -> chunk record for one array across writers (later duplicates must agree). The
  record of an item's index holds a ``ChunkGrid``: its mapping view, which makes each record
  when looked up (a restoring host pays for the chunks it reads, not for all)."""
  records = list(records)
  if len(records) == 1 and isinstance(records[0].chunks, ChunkGrid):
    return records[0].chunks.mapping()
  out = {}
  for r in records:
    for c in r.chunks:
      out[tuple(c.origin)] = c
  return out


def _origin(c: ChunkRecord) -> tuple[int, ...]:
  return c.origin


def grid_shape(shape: Sequence[int], chunk_shape: Sequence[int]) -> tuple[int, ...]:
  """Cells of the regular chunk grid per dimension (0 for an empty dimension)."""
  return tuple(-(-int(d) // int(c)) for d, c in zip(shape, chunk_shape))
