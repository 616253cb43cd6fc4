"""The item index: every writer's record merged into ``<item>/_pathways/index.msgpack``, once per
save, before the step becomes visible, so that a restore reads one object per item however many
hosts wrote it.

Who calls what, on which host:

- ``merge_item(item_dir)`` runs on the primary host from Orbax's PyTree finalize
  (``_compat/orbax_finalize.py``, installed by ``orbax_pathways.install()``): after every
  process's background writes finished (Orbax's ``async_write_complete`` barrier) and before
  Orbax's commit (the rename, or ``commit_success.txt`` on object stores). That finalize serves
  Orbax v0 (``CheckpointManager``, ``Checkpointer``, ``AsyncCheckpointer``) and v1 (v1's
  ``PyTreeHandler`` awaits the same ``_finalize_async``). A front door that commits by other
  means calls ``merge_item`` itself, on one host, after all writers finished.
- The colocated transport's controller writes the index itself, from what its workers
  returned (``transports/colocated.py``); ``merge_item`` then finds it and leaves it.

The merge reads the records concurrently (``meta_io.read_records``): one listing, one read per
writer, one write, on the primary only and once per save.
"""

from __future__ import annotations

from typing import Any

from orbax_pathways import metadata
from orbax_pathways.storage import meta_io


def merge_item(item_dir: Any) -> metadata.ItemMetadata | None:
  """Writes ``item_dir``'s index from its writer records; returns what it wrote. Does nothing
  (returns None) if the item has no records (an item none of whose arrays went through
  orbax-pathways) or already has an index listing every record's writer. A record that cannot
  be read fails the save."""
  keys, has_index = meta_io.list_item(item_dir)
  if not keys:
    return None
  if has_index:
    return _merge_late_records(item_dir, keys)
  item = metadata.merge(meta_io.read_records(item_dir, keys))
  meta_io.write_index(item_dir, item)
  return item


def _writer_of(key: str) -> str:
  return key.rsplit('/', 1)[-1][:-len(metadata.SUFFIX)]


def _merge_late_records(item_dir: Any, keys: list[str]) -> metadata.ItemMetadata | None:
  """An index already written (the colocated controller's) plus records it does not list (the
  numpy and scalar leaves process 0 wrote beside it, ``ProxyNumpyHandler``): the index is
  written again with them, still before the commit. Nothing to do (None) when it lists them
  all, the colocated case without host leaves."""
  index = meta_io.read_index(item_dir)
  if index is None:
    return None
  listed = {w.writer for w in index.writers}
  late = [k for k in keys if _writer_of(k) not in listed]
  if not late:
    return None
  records = meta_io.read_records(item_dir, late)
  arrays = dict(index.arrays())
  for r in records:
    for a in r.arrays:
      arrays.setdefault(a.name, a)
  item = metadata.ItemMetadata(tuple(index.writers) + tuple(metadata.summary(r) for r in records),
                               tuple(arrays[n] for n in sorted(arrays)), source='index')
  meta_io.write_index(item_dir, item)
  return item
