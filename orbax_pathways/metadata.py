"""What orbax-pathways adds beside Orbax's own files, in ``<item>/_pathways/``: one record per
writer (``<writer>.msgpack``) and the item's merged index (``index.msgpack``).

Who writes them: under the local transport every writer (a multi-controller process) writes one
record per checkpoint item in the background part of the save, and the primary host merges them
into the index in Orbax's finalize (``storage/index.py``), before Orbax's commit marker or rename
makes the step visible. Under the colocated transport the controller writes the index itself
from what the workers returned (no per-worker records). The primary writer records how each
array was sharded (mesh, PartitionSpec, slices), which elastic restore and the CLI read.

Who reads them: restore (checksums, saved mesh) and ``orbax_pathways.cli`` read the index, one
object per item; a checkpoint written before schema 2 has no index, and its records are read
instead. Stock Orbax ignores the directory.

The schema is described for humans in ``docs/format.md``; bump ``SCHEMA_VERSION`` on any change
and say so in CHANGELOG.md.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
from typing import Any, Iterable, Mapping, Sequence

import msgpack
import numpy as np

from orbax_pathways import errors
from orbax_pathways import format as format_lib

SCHEMA_VERSION = 2
DIRNAME = format_lib.PATHWAYS_DIR
SUFFIX = format_lib.PATHWAYS_SUFFIX
INDEX_FILENAME = 'index.msgpack'  # never a writer name: writers are p<i>, w<id>[.g<k>], controller


@dataclasses.dataclass(frozen=True)
class ChunkRecord:
  """One chunk written by one writer: where it starts, its crc32c and its raw byte count.

  The checksum covers the chunk's elements in the stored dtype, C order, native (little-endian)
  byte order, clipped to the array bounds: exactly what ``np.asarray(t[box]).tobytes()`` returns.
  """

  origin: tuple[int, ...]
  crc32c: int
  nbytes: int


@dataclasses.dataclass(frozen=True)
class ShardingRecord:
  """How the array was laid out over devices at save time (written by the primary writer only).

  ``kind`` is 'named' (mesh fields set), 'single_device' or 'other'. ``device_slices[i]`` is the
  slice index of ``device_ids[i]`` (mesh order, row-major). ``slice_axes`` are the mesh axes whose
  coordinate changes across slices: the axes elastic restore resizes.
  """

  kind: str
  mesh_shape: tuple[int, ...] = ()
  axis_names: tuple[str, ...] = ()
  device_ids: tuple[int, ...] = ()
  device_slices: tuple[int, ...] = ()
  spec: tuple[Any, ...] = ()
  slice_axes: tuple[str, ...] = ()
  num_slices: int = 1


class ChunkGrid(collections.abc.Sequence):
  """The chunks of one array as the index stores them: one crc32c per cell of the array's
  regular chunk grid (C order), cells without a record marked absent; each chunk's origin and
  byte count follow from its cell.

  Behaves as the sequence of its ``ChunkRecord``s (C order of the grid) and, through ``get``,
  as a mapping origin -> ``ChunkRecord``; records are made on access, so a host that restores a
  few chunks of a large checkpoint pays for those only.
  """

  def __init__(self, shape: Sequence[int], chunk_shape: Sequence[int], itemsize: int,
               crc32c: np.ndarray, present: np.ndarray | None = None):
    self.shape = tuple(int(d) for d in shape)
    self.chunk_shape = tuple(int(c) for c in chunk_shape)
    self.grid = grid_shape(self.shape, self.chunk_shape)
    self.itemsize = int(itemsize)
    self.crc32c = crc32c
    self.present = present  # None: every cell has a record
    if crc32c.shape != (math.prod(self.grid),) or (present is not None and present.shape != crc32c.shape):
      raise ValueError(f'chunk grid {self.grid} needs {math.prod(self.grid)} checksums, '
                       f'got {crc32c.shape[0]}')

  @functools.cached_property
  def _cells(self) -> np.ndarray:
    """Flat indices of the cells that have a record."""
    n = self.crc32c.shape[0]
    return np.arange(n) if self.present is None else np.flatnonzero(self.present)

  def _record(self, flat: int) -> ChunkRecord:
    cell = np.unravel_index(flat, self.grid) if self.grid else ()
    origin = tuple(int(i) * c for i, c in zip(cell, self.chunk_shape))
    n = math.prod(min(o + c, d) - o for o, c, d in zip(origin, self.chunk_shape, self.shape))
    return ChunkRecord(origin, int(self.crc32c[flat]), n * self.itemsize)

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
    return cls(shape, chunk_shape, itemsize, crc, None if present.all() else present)


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


def itemsize(dtype: str) -> int:
  """Bytes per element of a stored dtype name (``bfloat16``, ``float8_e4m3fn``, ... included)."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top,unused-import  (registers its names)
  return np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class ArrayRecord:
  """What one writer wrote of one array (in an index: what every writer wrote; ``chunks`` is
  then a ``ChunkGrid``)."""

  name: str
  dtype: str
  shape: tuple[int, ...]
  chunk_shape: tuple[int, ...]
  chunks: Sequence[ChunkRecord]
  sharding: ShardingRecord | None = None


@dataclasses.dataclass(frozen=True)
class WriterRecord:
  """The whole content of one ``_pathways/<writer>.msgpack`` file."""

  writer: str
  transport: str
  arrays: tuple[ArrayRecord, ...]
  library_version: str = ''
  stats: Mapping[str, int] = dataclasses.field(default_factory=dict)
  schema: int = SCHEMA_VERSION
  # Identifies this writer's save of the step (random, per save): a node-local tier copy is
  # used only when it carries the save id the committed step records (``tier/chain.py``).
  save_id: str = ''


def _sharding_to_obj(s: ShardingRecord | None) -> Any:
  if s is None:
    return None
  return {
      'kind': s.kind,
      'mesh_shape': list(s.mesh_shape),
      'axis_names': list(s.axis_names),
      'device_ids': list(s.device_ids),
      'device_slices': list(s.device_slices),
      'spec': [list(p) if isinstance(p, tuple) else p for p in s.spec],
      'slice_axes': list(s.slice_axes),
      'num_slices': s.num_slices,
  }


def _sharding_from_obj(o: Any) -> ShardingRecord | None:
  if o is None:
    return None
  return ShardingRecord(
      kind=o['kind'],
      mesh_shape=tuple(o['mesh_shape']),
      axis_names=tuple(o['axis_names']),
      device_ids=tuple(o['device_ids']),
      device_slices=tuple(o['device_slices']),
      spec=tuple(tuple(p) if isinstance(p, list) else p for p in o['spec']),
      slice_axes=tuple(o['slice_axes']),
      num_slices=o.get('num_slices', 1),
  )


def encode(record: WriterRecord) -> bytes:
  """Serializes a writer record. Chunks are stored column-wise to keep the file compact."""
  arrays = {}
  for a in record.arrays:
    arrays[a.name] = {
        'dtype': a.dtype,
        'shape': list(a.shape),
        'chunk_shape': list(a.chunk_shape),
        'origins': [list(c.origin) for c in a.chunks],
        'crc32c': [c.crc32c for c in a.chunks],
        'nbytes': [c.nbytes for c in a.chunks],
        'sharding': _sharding_to_obj(a.sharding),
    }
  return msgpack.packb(
      {
          'schema': record.schema,
          'writer': record.writer,
          'transport': record.transport,
          'library_version': record.library_version,
          'stats': dict(record.stats),
          'arrays': arrays,
          **({'save_id': record.save_id} if record.save_id else {}),
      },
      use_bin_type=True,
  )


MetadataError = errors.MetadataError  # a damaged ``_pathways`` file, or one from a newer schema


class DamagedIndexError(MetadataError):
  """An index that cannot be decoded (truncated, empty, garbage, not an index): unlike an index
  from a newer schema, its item can be rebuilt from the writer records beside it
  (``storage/meta_io.read_item`` does)."""


def decode(data: bytes, *, path: str = '<bytes>') -> WriterRecord:
  """Parses one writer file; raises MetadataError naming ``path`` if it is damaged or too new."""
  try:
    o = msgpack.unpackb(data, raw=False, strict_map_key=False)
    schema = int(o['schema'])
  except Exception as e:  # msgpack raises several unrelated types.
    raise MetadataError(
        f'orbax-pathways metadata file {path} is damaged ({type(e).__name__}: {e}). '
        'Run `orbax-pathways verify` on the step; delete the file to restore without '
        'checksum verification.'
    ) from e
  if schema > SCHEMA_VERSION:
    raise MetadataError(
        f'orbax-pathways metadata file {path} has schema {schema}, this version reads up to '
        f'{SCHEMA_VERSION}. Upgrade orbax-pathways.'
    )
  try:
    arrays = tuple(
        ArrayRecord(
            name=name,
            dtype=a['dtype'],
            shape=tuple(a['shape']),
            chunk_shape=tuple(a['chunk_shape']),
            chunks=tuple(
                ChunkRecord(tuple(org), int(crc), int(n))
                for org, crc, n in zip(a['origins'], a['crc32c'], a['nbytes'])
            ),
            sharding=_sharding_from_obj(a.get('sharding')),
        )
        for name, a in o['arrays'].items()
    )
    return WriterRecord(
        writer=o['writer'],
        transport=o['transport'],
        arrays=arrays,
        library_version=o.get('library_version', ''),
        stats=o.get('stats', {}),
        schema=schema,
        save_id=str(o.get('save_id') or ''),
    )
  except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
    raise MetadataError(
        f'orbax-pathways metadata file {path} {_what_is_wrong(e)}; it is damaged. '
        'Run `orbax-pathways verify` on the step.'
    ) from e


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


def writer_filename(writer: str) -> str:
  return f'{writer}{SUFFIX}'


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


# ---- partial saves: one save's parts joined -----------------------------------------------------
#
# An Orbax v1 partial save (``ocp.v1.partial.save`` called several times, then ``finalize``)
# writes each call's arrays into a pending directory of its own, each with the same writer's
# record (``p0.msgpack``) or, under the colocated transport, its own index. Finalize joins them
# (``storage/index.merge_pending``): later parts win for an array saved twice (as Orbax's own
# metadata merge does), and joining a part that is already in is a no-op, so a retried finalize
# gives the same files.


def _adds(have: Mapping[str, ArrayRecord], new: Iterable[ArrayRecord]) -> bool:
  return any(have.get(a.name) != a for a in new)


def _sum_stats(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, int]:
  return {k: int(a.get(k) or 0) + int(b.get(k) or 0) for k in sorted({*a, *b})}


def join_records(have: WriterRecord, new: WriterRecord) -> WriterRecord:
  """One writer's record of two parts of a partial save: ``have``'s arrays, then ``new``'s
  (``new`` wins for a name in both), stats added up. Returns ``have`` itself if ``new`` adds
  nothing (joined before: a retried finalize)."""
  if have.writer != new.writer:
    raise ValueError(f'cannot join the records of writers {have.writer!r} and {new.writer!r}')
  if not _adds({a.name: a for a in have.arrays}, new.arrays):
    return have
  names = {a.name for a in new.arrays}
  return dataclasses.replace(
      new, arrays=tuple(a for a in have.arrays if a.name not in names) + tuple(new.arrays),
      stats=_sum_stats(have.stats, new.stats))


def join_indexes(have: ItemMetadata, new: ItemMetadata) -> ItemMetadata:
  """The index of two parts of a partial save (each an index, or records to index): every
  array of both (``new`` wins for a name in both), one summary per writer with its stats added
  up. Returns ``have`` itself if ``new`` adds nothing (no array or writer it lacks)."""
  arrays = have.arrays()
  known = {w.writer for w in have.writers}
  if not _adds(arrays, new.arrays().values()) and all(w.writer in known for w in new.writers):
    return have
  arrays.update(new.arrays())
  writers = {w.writer: summary(w) for w in have.writers}
  for w in new.writers:
    old = writers.get(w.writer)
    writers[w.writer] = summary(w) if old is None else dataclasses.replace(
        summary(w), stats=_sum_stats(old.stats, w.stats))
  return ItemMetadata(tuple(writers[k] for k in sorted(writers)),
                      tuple(arrays[k] for k in sorted(arrays)), source='index')


def _array_to_index_obj(a: ArrayRecord) -> dict:
  obj = {'dtype': a.dtype, 'shape': list(a.shape), 'chunk_shape': list(a.chunk_shape),
         'sharding': _sharding_to_obj(a.sharding)}
  grid = ChunkGrid.of(a.shape, a.chunk_shape, itemsize(a.dtype), a.chunks)
  if grid is not None:
    obj['grid_crc32c'] = grid.crc32c.astype('<u4').tobytes()
    obj['grid_present'] = None if grid.present is None else np.packbits(grid.present).tobytes()
  else:  # chunks off the regular grid (never written by this version): as in a writer record
    obj.update(origins=[list(c.origin) for c in a.chunks], crc32c=[c.crc32c for c in a.chunks],
               nbytes=[c.nbytes for c in a.chunks])
  return obj


def _array_from_index_obj(name: str, a: Mapping[str, Any]) -> ArrayRecord:
  shape, chunk_shape = tuple(a['shape']), tuple(a['chunk_shape'])
  chunks: Sequence[ChunkRecord]
  if 'grid_crc32c' in a:
    crc = np.frombuffer(a['grid_crc32c'], '<u4')
    present = a.get('grid_present')
    if present is not None:
      present = np.unpackbits(np.frombuffer(present, np.uint8), count=crc.shape[0]).astype(bool)
    chunks = ChunkGrid(shape, chunk_shape, itemsize(a['dtype']), crc, present)
  else:
    chunks = tuple(ChunkRecord(tuple(org), int(crc), int(n))
                   for org, crc, n in zip(a['origins'], a['crc32c'], a['nbytes']))
  return ArrayRecord(name=name, dtype=a['dtype'], shape=shape, chunk_shape=chunk_shape,
                     chunks=chunks, sharding=_sharding_from_obj(a.get('sharding')))


def encode_index(item: ItemMetadata, *, library_version: str = '') -> bytes:
  """Serializes an item's index (``_pathways/index.msgpack``): per array the checksums over its
  chunk grid (``ChunkGrid``), per writer a summary. ``item`` may come from records or be an
  index already."""
  arrays = {name: _array_to_index_obj(a) for name, a in sorted(item.arrays().items())}
  ws = sorted(item.writers, key=lambda w: w.writer)
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


def _what_is_wrong(e: BaseException) -> str:
  if isinstance(e, KeyError):
    return f'is missing field {e}'
  return f'has a malformed field ({type(e).__name__}: {e})'


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
    merged = tuple(_array_from_index_obj(name, a) for name, a in o['arrays'].items())
  except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
    raise DamagedIndexError(
        f'orbax-pathways index {path} {_what_is_wrong(e)}; it is damaged. Run '
        '`orbax-pathways verify` on the step.') from e
  return ItemMetadata(writers, merged, source='index')
