"""The records orbax-pathways adds beside Orbax's own files, in ``<item>/_pathways/``, and the
codec of one writer's record (``<writer>.msgpack``).

Who writes them: under the in-process transport every writer (a multi-controller process) writes one
record per checkpoint item in the background part of the save, and the primary host merges them
into the index in Orbax's finalize (``storage/index.py``), before Orbax's commit marker or rename
makes the step visible. Under the colocated transport the controller writes the index itself
from what the workers returned (no per-worker records). The primary writer records how each
array was sharded (mesh, PartitionSpec, slices), which elastic restore and the CLI read.

Who reads them: restore (checksums, saved mesh) and ``orbax_pathways.cli`` read the index
(``format/item.py``), one object per item; a checkpoint written before schema 2 has no index,
and its records are read instead. Stock Orbax ignores the directory.

The rest of the format beside this module: ``format/names.py`` (file and directory names, chunk
keys), ``format/grid.py`` (an index's chunks as a grid of checksums), ``format/item.py`` (an
item's records merged, and the index codec), ``format/partial.py`` (the parts of a partial save
joined), ``format/checksum.py`` (the crc32c of a chunk). The schema is described for humans in
``docs/format.md``; bump ``SCHEMA_VERSION`` on any change and say so in CHANGELOG.md. Pure: no
I/O, no jax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import msgpack
import numpy as np

from orbax_pathways import errors
from orbax_pathways import version
from orbax_pathways.format import names as format_lib

SCHEMA_VERSION = 2
DIRNAME = format_lib.PATHWAYS_DIR
SUFFIX = format_lib.PATHWAYS_SUFFIX
INDEX_FILENAME = 'index.msgpack'  # never a writer name: writers are p<i>, w<id>[.g<k>], controller


@dataclasses.dataclass(frozen=True)
class ChunkRecord:
  """One chunk written by one writer: where it starts, its crc32c and its raw byte count.

  The checksum covers the chunk's elements in the stored dtype, C order, native (little-endian)
  byte order, clipped to the array bounds: exactly what ``np.asarray(t[box]).tobytes()`` returns.
  ``writer`` names who wrote it (a writer record's chunks carry their writer; an index's carry
  its writer column, where it has one; '' where unknown). Not part of equality: the same chunk
  is the same record whoever is known to have written it.
  """

  origin: tuple[int, ...]
  crc32c: int
  nbytes: int
  writer: str = dataclasses.field(default='', compare=False)


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
  # used only when it carries the save id the committed step records (``fleet/chain.py``).
  save_id: str = ''


def writer_record(writer: str, transport: str, arrays: Sequence[ArrayRecord] = (), *,
                  written_bytes: int | None = None, chunks: int | None = None,
                  save_id: str = '') -> WriterRecord:
  """A writer's record as this library writes it (every writer host, every transport): this
  library's version stamped, the write's stats when given (the persistence plugin's writes
  report none) and the save's id."""
  stats = {} if written_bytes is None else {'written_bytes': int(written_bytes),
                                            'chunks': int(chunks or 0)}
  return WriterRecord(writer=writer, transport=transport, arrays=tuple(arrays),
                      library_version=version.VERSION, stats=stats, save_id=save_id)


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
    writer = str(o['writer'])
    arrays = tuple(
        ArrayRecord(
            name=name,
            dtype=a['dtype'],
            shape=tuple(a['shape']),
            chunk_shape=tuple(a['chunk_shape']),
            chunks=tuple(
                ChunkRecord(tuple(org), int(crc), int(n), writer)
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



def writer_filename(writer: str) -> str:
  return f'{writer}{SUFFIX}'


def _what_is_wrong(e: BaseException) -> str:
  if isinstance(e, KeyError):
    return f'is missing field {e}'
  return f'has a malformed field ({type(e).__name__}: {e})'
