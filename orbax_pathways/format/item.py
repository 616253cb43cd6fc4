"""One item's metadata (``ItemMetadata``: every array's chunks and sharding, and who wrote
them), built from its writers' records or from its index, and the index codec
(``_pathways/index.msgpack``: per array the checksums over its chunk grid, per writer a summary).

Who calls it: the primary host's finalize writes the index (``storage/index.py``); every
restoring host and the CLI read it (``storage/meta_io.py``). Pure: no I/O.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
from typing import Any, Iterable, Mapping, Sequence

import msgpack
import numpy as np

from orbax_pathways.format.grid import ChunkGrid
from orbax_pathways.format.records import (
    SCHEMA_VERSION, ArrayRecord, ChunkRecord, DamagedIndexError, MetadataError, ShardingRecord,
    WriterRecord, _sharding_from_obj, _sharding_to_obj, _what_is_wrong, itemsize)


@dataclasses.dataclass(frozen=True)
class ItemMetadata:
  """One item's metadata: per array every chunk and the primary's sharding, and who wrote it.

  Built from the index (``source='index'``: ``writers`` are one summary per writer, with no
  arrays of their own; ``merged`` holds the arrays) or, for a checkpoint without an index, from
  every writer's record (``source='records'``: ``merged`` is None and ``arrays()`` merges).
  ``damaged_index`` is set (the error's text) when the item has an index that could not be
  decoded and was rebuilt from its records instead (``meta_io.read_item``).
  """

  writers: Sequence[WriterRecord]
  merged: tuple[ArrayRecord, ...] | None = None
  source: str = 'records'
  damaged_index: str | None = None

  @functools.cached_property
  def _arrays(self) -> dict[str, ArrayRecord]:
    if self.merged is not None:
      return {a.name: a for a in self.merged}
    chunks: dict[str, list[ChunkRecord]] = {}
    first: dict[str, ArrayRecord] = {}
    sharding: dict[str, ShardingRecord | None] = {}
    for w in self.writers:
      for a in w.arrays:
        first.setdefault(a.name, a)
        chunks.setdefault(a.name, []).extend(a.chunks)
        sharding[a.name] = sharding.get(a.name) or a.sharding
    return {name: dataclasses.replace(a, chunks=tuple(chunks[name]), sharding=sharding[name])
            for name, a in first.items()}

  def arrays(self) -> dict[str, ArrayRecord]:
    """Per array name: every writer's chunks concatenated, the sharding from the primary."""
    return dict(self._arrays)

  def transports(self) -> set[str]:
    if isinstance(self.writers, WriterSummaries):
      return self.writers.transports()
    return {w.transport for w in self.writers}


class WriterSummaries(collections.abc.Sequence):
  """The index's writers (stored column-wise) as ``WriterRecord`` summaries, made on access."""

  def __init__(self, columns: Mapping[str, Any], schema: int):
    self._c = columns
    self._schema = schema
    self._n = len(columns['writer'])
    for k in ('transport', 'library_version'):
      if len(columns[k]) != self._n:
        raise ValueError(f'writers.{k} has {len(columns[k])} entries for {self._n} writers')
    stats = columns.get('stats', {})
    if not isinstance(stats, Mapping):  # checked now, not when a writer is looked up
      raise TypeError(f'writers.stats is a {type(stats).__name__}, not a map')
    for k, v in stats.items():
      if not isinstance(v, (list, tuple)) or len(v) != self._n:
        raise ValueError(f'writers.stats.{k} is not a column of {self._n} entries')

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, i):
    if isinstance(i, slice):
      return tuple(self[j] for j in range(*i.indices(self._n)))
    c = self._c
    stats = {k: v[i] for k, v in c.get('stats', {}).items() if v[i] is not None}
    save_ids = c.get('save_id') or ()
    return WriterRecord(writer=c['writer'][i], transport=c['transport'][i], arrays=(),
                        library_version=c['library_version'][i], stats=stats, schema=self._schema,
                        save_id=str(save_ids[i] or '') if i < len(save_ids) else '')

  def transports(self) -> set[str]:
    return set(self._c['transport'])

  def __eq__(self, other) -> bool:
    if not isinstance(other, collections.abc.Sequence):
      return NotImplemented
    return tuple(self) == tuple(other)

  def __hash__(self) -> int:
    return hash(tuple(self._c['writer']))


def merge(records: Iterable[WriterRecord]) -> ItemMetadata:
  """The item as its writers' records describe it (sorted by writer, so the same every time)."""
  return ItemMetadata(tuple(sorted(records, key=lambda r: r.writer)))


def summary(record: WriterRecord) -> WriterRecord:
  """A writer as the index lists it: who, which transport and version, its stats; no arrays."""
  return dataclasses.replace(record, arrays=())


def index_of(item: ItemMetadata) -> ItemMetadata:
  """The index content of ``item``: its merged arrays plus one summary per writer."""
  merged = tuple(item.arrays()[name] for name in sorted(item.arrays()))
  return ItemMetadata(tuple(summary(w) for w in item.writers), merged, source='index')


def _writer_column(grid: ChunkGrid, position: Mapping[str, int]) -> bytes | None:
  """The grid's writer column as the index stores it: per cell the writer's position in the
  index's writers column, little-endian ``u2`` (``u4`` from 65,535 writers on), the type's
  largest value where unknown. None when no cell's writer is known."""
  if grid.writer is None:
    return None
  kind = '<u2' if len(position) < 0xFFFF else '<u4'
  absent = np.iinfo(kind).max
  remap = np.array([position.get(n, absent) for n in grid.writer_names] + [absent], np.int64)
  return remap[grid.writer].astype(kind).tobytes()  # -1 (unknown) picks the last: absent


def _writer_column_from(data: Any, cells: int, names: Sequence[str]) -> np.ndarray | None:
  if data is None:
    return None
  kind = {2 * cells: '<u2', 4 * cells: '<u4'}.get(len(data)) if cells else '<u2'
  if kind is None:
    raise ValueError(f'grid_writer has {len(data)} bytes for {cells} chunks')
  raw = np.frombuffer(data, kind).astype(np.int64)
  raw[raw >= len(names)] = -1  # absent (the type's largest value), or past the column: unknown
  return raw.astype(np.int32)


def _array_to_index_obj(a: ArrayRecord, position: Mapping[str, int]) -> dict:
  obj = {'dtype': a.dtype, 'shape': list(a.shape), 'chunk_shape': list(a.chunk_shape),
         'sharding': _sharding_to_obj(a.sharding)}
  grid = ChunkGrid.of(a.shape, a.chunk_shape, itemsize(a.dtype), a.chunks)
  if grid is not None:
    obj['grid_crc32c'] = grid.crc32c.astype('<u4').tobytes()
    obj['grid_present'] = None if grid.present is None else np.packbits(grid.present).tobytes()
    column = _writer_column(grid, position)
    if column is not None:
      obj['grid_writer'] = column
  else:  # chunks off the regular grid (never written by this version): as in a writer record
    obj.update(origins=[list(c.origin) for c in a.chunks], crc32c=[c.crc32c for c in a.chunks],
               nbytes=[c.nbytes for c in a.chunks])
  return obj


def _array_from_index_obj(name: str, a: Mapping[str, Any], writers: Sequence[str]) -> ArrayRecord:
  shape, chunk_shape = tuple(a['shape']), tuple(a['chunk_shape'])
  chunks: Sequence[ChunkRecord]
  if 'grid_crc32c' in a:
    crc = np.frombuffer(a['grid_crc32c'], '<u4')
    present = a.get('grid_present')
    if present is not None:
      present = np.unpackbits(np.frombuffer(present, np.uint8), count=crc.shape[0]).astype(bool)
    column = _writer_column_from(a.get('grid_writer'), crc.shape[0], writers)
    chunks = ChunkGrid(shape, chunk_shape, itemsize(a['dtype']), crc, present,
                       column, writers if column is not None else ())
  else:
    chunks = tuple(ChunkRecord(tuple(org), int(crc), int(n))
                   for org, crc, n in zip(a['origins'], a['crc32c'], a['nbytes']))
  return ArrayRecord(name=name, dtype=a['dtype'], shape=shape, chunk_shape=chunk_shape,
                     chunks=chunks, sharding=_sharding_from_obj(a.get('sharding')))


def encode_index(item: ItemMetadata, *, library_version: str = '') -> bytes:
  """Serializes an item's index (``_pathways/index.msgpack``): per array the checksums over its
  chunk grid (``ChunkGrid``), per writer a summary. ``item`` may come from records or be an
  index already."""
  ws = sorted(item.writers, key=lambda w: w.writer)
  position = {w.writer: i for i, w in enumerate(ws)}
  arrays = {name: _array_to_index_obj(a, position) for name, a in sorted(item.arrays().items())}
  keys = sorted({k for w in ws for k in w.stats})
  writers = {'writer': [w.writer for w in ws], 'transport': [w.transport for w in ws],
             'library_version': [w.library_version for w in ws],
             'stats': {k: [w.stats.get(k) for w in ws] for k in keys}}
  if any(w.save_id for w in ws):
    writers['save_id'] = [w.save_id for w in ws]
  return msgpack.packb(
      {'schema': SCHEMA_VERSION, 'kind': 'index', 'library_version': library_version,
       'writers': writers, 'arrays': arrays},
      use_bin_type=True)


def decode_index(data: bytes, *, path: str = '<bytes>') -> ItemMetadata:
  """Parses an item's index; raises MetadataError naming ``path`` if damaged or too new."""
  try:
    o = msgpack.unpackb(data, raw=False, strict_map_key=False)
    schema = int(o['schema'])
    kind = o.get('kind')
  except Exception as e:  # msgpack raises several unrelated types.
    raise DamagedIndexError(
        f'orbax-pathways index {path} is damaged ({type(e).__name__}: {e}). Run '
        '`orbax-pathways verify` on the step. Restore rebuilds the index from the writers\' '
        'records beside it; where there are none, deleting the index restores without checksum '
        'verification.'
    ) from e
  if schema > SCHEMA_VERSION:
    raise MetadataError(
        f'orbax-pathways index {path} has schema {schema}, this version reads up to '
        f'{SCHEMA_VERSION}. Upgrade orbax-pathways.')
  if kind != 'index':
    raise DamagedIndexError(f'orbax-pathways index {path} is not an index (kind {kind!r}); it is '
                        'damaged. Run `orbax-pathways verify` on the step.')
  try:
    writers = WriterSummaries(o['writers'], schema)
    names = tuple(str(w) for w in o['writers']['writer'])
    merged = tuple(_array_from_index_obj(name, a, names) for name, a in o['arrays'].items())
  except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
    raise DamagedIndexError(
        f'orbax-pathways index {path} {_what_is_wrong(e)}; it is damaged. Run '
        '`orbax-pathways verify` on the step.') from e
  return ItemMetadata(writers, merged, source='index')
