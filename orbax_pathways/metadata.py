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

import dataclasses
import functools
from typing import Any, Iterable, Mapping, Sequence

import msgpack

SCHEMA_VERSION = 2
DIRNAME = '_pathways'
SUFFIX = '.msgpack'
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


@dataclasses.dataclass(frozen=True)
class ArrayRecord:
  """What one writer wrote of one array."""

  name: str
  dtype: str
  shape: tuple[int, ...]
  chunk_shape: tuple[int, ...]
  chunks: tuple[ChunkRecord, ...]
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
      },
      use_bin_type=True,
  )


class MetadataError(ValueError):
  """A ``_pathways`` file that cannot be decoded (damaged, or written by a newer schema)."""


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
    )
  except (KeyError, TypeError, ValueError) as e:
    raise MetadataError(
        f'orbax-pathways metadata file {path} is missing field {e}; it is damaged. '
        'Run `orbax-pathways verify` on the step.'
    ) from e


@dataclasses.dataclass(frozen=True)
class ItemMetadata:
  """One item's metadata: per array every chunk and the primary's sharding, and who wrote it.

  Built from the index (``source='index'``: ``writers`` are one summary per writer, with no
  arrays of their own; ``merged`` holds the arrays) or, for a checkpoint without an index, from
  every writer's record (``source='records'``: ``merged`` is None and ``arrays()`` merges).
  """

  writers: tuple[WriterRecord, ...]
  merged: tuple[ArrayRecord, ...] | None = None
  source: str = 'records'

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
    return {w.transport for w in self.writers}


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


def encode_index(item: ItemMetadata, *, library_version: str = '') -> bytes:
  """Serializes an item's index (``_pathways/index.msgpack``); chunks column-wise as in a writer
  record. ``item`` may come from records or be an index already."""
  arrays = {}
  for name, a in sorted(item.arrays().items()):
    arrays[name] = {
        'dtype': a.dtype,
        'shape': list(a.shape),
        'chunk_shape': list(a.chunk_shape),
        'origins': [list(c.origin) for c in a.chunks],
        'crc32c': [c.crc32c for c in a.chunks],
        'nbytes': [c.nbytes for c in a.chunks],
        'sharding': _sharding_to_obj(a.sharding),
    }
  writers = [{'writer': w.writer, 'transport': w.transport,
              'library_version': w.library_version, 'stats': dict(w.stats)}
             for w in sorted(item.writers, key=lambda w: w.writer)]
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
    raise MetadataError(
        f'orbax-pathways index {path} is damaged ({type(e).__name__}: {e}). Run '
        '`orbax-pathways verify` on the step; deleting the index makes restore read the writers\' '
        'records beside it, or restore without checksum verification where there are none.'
    ) from e
  if schema > SCHEMA_VERSION:
    raise MetadataError(
        f'orbax-pathways index {path} has schema {schema}, this version reads up to '
        f'{SCHEMA_VERSION}. Upgrade orbax-pathways.')
  if kind != 'index':
    raise MetadataError(f'orbax-pathways index {path} is not an index (kind {kind!r}); it is '
                        'damaged. Run `orbax-pathways verify` on the step.')
  try:
    writers = tuple(
        WriterRecord(writer=w['writer'], transport=w['transport'], arrays=(),
                     library_version=w.get('library_version', ''), stats=w.get('stats', {}),
                     schema=schema)
        for w in o['writers'])
    merged = tuple(
        ArrayRecord(
            name=name, dtype=a['dtype'], shape=tuple(a['shape']),
            chunk_shape=tuple(a['chunk_shape']),
            chunks=tuple(ChunkRecord(tuple(org), int(crc), int(n))
                         for org, crc, n in zip(a['origins'], a['crc32c'], a['nbytes'])),
            sharding=_sharding_from_obj(a.get('sharding')))
        for name, a in o['arrays'].items())
  except (KeyError, TypeError, ValueError) as e:
    raise MetadataError(
        f'orbax-pathways index {path} is missing field {e}; it is damaged. Run '
        '`orbax-pathways verify` on the step.') from e
  return ItemMetadata(writers, merged, source='index')


def chunk_index(records: Sequence[ArrayRecord]) -> dict[tuple[int, ...], ChunkRecord]:
  """Origin -> chunk record for one array across writers (later duplicates must agree)."""
  out: dict[tuple[int, ...], ChunkRecord] = {}
  for r in records:
    for c in r.chunks:
      out[c.origin] = c
  return out
