"""Reads and writes the ``_pathways/<writer>.msgpack`` files (see ``orbax_pathways.metadata``).

Called on each writer host from the background part of a save (``write_record``), and on any
host at restore or by the CLI (``read_item``). Paths are ``etils.epath`` paths: a local directory
or ``gs://``. One object per writer per item, written once: never rewritten in place.
"""

from __future__ import annotations

from etils import epath

from orbax_pathways import metadata


def record_path(item_dir: epath.PathLike, writer: str) -> epath.Path:
  return epath.Path(item_dir) / metadata.DIRNAME / metadata.writer_filename(writer)


def write_record(item_dir: epath.PathLike, record: metadata.WriterRecord) -> epath.Path:
  """Writes one writer's record. On a local disk the write is atomic (temp file + rename)."""
  path = record_path(item_dir, record.writer)
  data = metadata.encode(record)
  path.parent.mkdir(parents=True, exist_ok=True)
  if str(path).startswith('gs://'):
    path.write_bytes(data)  # One PUT: GCS object writes are atomic.
  else:
    tmp = path.parent / f'.{path.name}.tmp'
    tmp.write_bytes(data)
    tmp.rename(path)
  return path


def read_item(item_dir: epath.PathLike) -> metadata.ItemMetadata | None:
  """All writer records of an item, or None for a checkpoint written without orbax-pathways."""
  d = epath.Path(item_dir) / metadata.DIRNAME
  if not d.exists():
    return None
  records = []
  for p in sorted(d.glob(f'*{metadata.SUFFIX}')):
    records.append(metadata.decode(p.read_bytes(), path=str(p)))
  return metadata.merge(records)
