"""The one file orbax-pathways adds beside Orbax's own: ``<item>/_pathways/<writer>.msgpack``.

Who writes it: every writer (a multi-controller process, or a Pathways worker host running our
colocated function) writes exactly one file per checkpoint item, in the background part of the save,
before Orbax's commit marker or rename makes the step visible. The primary writer also records
how each array was sharded (mesh, PartitionSpec, slices), which elastic restore and the CLI read.

Who reads it: restore (checksums, saved mesh), ``orbax_pathways.cli``. Stock Orbax ignores it.

The schema is described for humans in ``docs/format.md``; bump ``SCHEMA_VERSION`` on any change
and say so in CHANGELOG.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

import msgpack

from orbax_pathways.format import chunk_index  # noqa: F401  (re-exported: the one definition)

SCHEMA_VERSION = 1
DIRNAME = '_pathways'
SUFFIX = '.msgpack'


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
  """All writer files of one item merged: per array, every chunk and the primary's sharding."""

  writers: tuple[WriterRecord, ...]

  def arrays(self) -> dict[str, ArrayRecord]:
    """Merges the writers' records per array name (chunks concatenated, sharding from primary)."""
    merged: dict[str, ArrayRecord] = {}
    for w in self.writers:
      for a in w.arrays:
        prev = merged.get(a.name)
        if prev is None:
          merged[a.name] = a
        else:
          merged[a.name] = dataclasses.replace(
              prev,
              chunks=prev.chunks + a.chunks,
              sharding=prev.sharding or a.sharding,
          )
    return merged

  def transports(self) -> set[str]:
    return {w.transport for w in self.writers}


def writer_filename(writer: str) -> str:
  return f'{writer}{SUFFIX}'


def merge(records: Iterable[WriterRecord]) -> ItemMetadata:
  return ItemMetadata(tuple(sorted(records, key=lambda r: r.writer)))
