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
- ``merge_pending(item_dir, part_dir)`` runs on the primary host from Orbax v1's partial-save
  finalize (``ocp.v1.partial.finalize``, through ``_compat/orbax_finalize.py``), once per item
  of each pending partial save, oldest first, before Orbax moves the rest of that save's files:
  it joins the part's records (and index, colocated) into the item's, since every part has the
  same writer's record (``p0.msgpack``) and Orbax refuses to overwrite a file. Orbax's finalize
  then runs ``merge_item``, which indexes every part.

The merge reads the records concurrently (``meta_io.read_records``): one listing, one read per
writer, one write, on the primary only and once per save.
"""

from __future__ import annotations

from typing import Any

from orbax_pathways.format import item as item_lib

from orbax_pathways.format import partial as partial_lib
from orbax_pathways.storage import meta_io


def merge_item(item_dir: Any) -> item_lib.ItemMetadata | None:
  """Writes ``item_dir``'s index from its writer records; returns what it wrote. Does nothing
  (returns None) if the item has no records (an item none of whose arrays went through
  orbax-pathways, or saved by the colocated transport) or an index that already covers them.
  Records beside an existing index are joined into it: a partial save's colocated parts bring
  their index, and the colocated controller's index does not list the numpy and scalar leaves
  process 0 recorded beside it (``ProxyNumpyHandler``); the index is then written again, still
  before the commit. A record or index that cannot be read fails the save."""
  keys, has_index = meta_io.list_item(item_dir)
  if not keys:
    return None
  item = item_lib.merge(meta_io.read_records(item_dir, keys))
  if has_index:
    have = meta_io.read_index(item_dir)
    if have is not None:
      joined = partial_lib.join_indexes(have, item)
      if joined is have:
        return None
      item = joined
  meta_io.write_index(item_dir, item)
  return item


def merge_pending(item_dir: Any, part_dir: Any) -> None:
  """Joins the ``_pathways`` files of ``part_dir`` (one item of one pending partial save) into
  ``item_dir``'s: each writer record with that writer's record there, the index (colocated
  parts) with the index there; a file ``item_dir`` lacks is copied. Idempotent (a part joined
  before adds nothing), so a finalize that failed after this can run again; the caller removes
  ``part_dir``'s ``_pathways`` afterwards. Writes only what changes, records before the index."""
  keys, has_index = meta_io.list_item(part_dir)
  if keys:
    have = {r.writer: r for r in meta_io.read_records(item_dir, meta_io.list_item(item_dir)[0])}
    for new in meta_io.read_records(part_dir, keys):
      old = have.get(new.writer)
      joined = new if old is None else partial_lib.join_records(old, new)
      if joined is not old:
        meta_io.write_record(item_dir, joined)
  if has_index:
    new_index = meta_io.read_index(part_dir)
    old_index = meta_io.read_index(item_dir)
    if new_index is not None:
      joined_index = (new_index if old_index is None
                      else partial_lib.join_indexes(old_index, new_index))
      if joined_index is not old_index:
        meta_io.write_index(item_dir, joined_index)
