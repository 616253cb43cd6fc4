"""Persistence transport: Pathways' server-side persistence plugin writes the shards.

Used under Pathways when ``ENABLE_PATHWAYS_PERSISTENCE=1`` (or ``transport='persistence'``). The
controller groups arrays by (directory, device assignment), builds Orbax's own bulk write request
per group (through ``_compat.orbax``: we never hand-write the wire format), and runs the plugin
program on the workers; only the request JSON and a completion token cross the controller.

The plugin's limits, checked before anything is sent:
- no OCDBT (it writes one zarr directory per array), no dtype cast on save, and only the dtypes in
  Orbax's table (no float16, bool, float8, int4). A save that hits one of these falls back to the
  colocated transport (same on-disk format) with a warning naming the arrays and the reason;
- the plugin computes no checksums, so our metadata records the sharding but no chunk crc32c.
Restores read through the colocated transport (workers read their own boxes).

What runs here: request building, grouping and the limit checks (tests/transports/test_persistence.py);
the plugin program itself needs a Pathways server and is not run in tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from typing import Any, Awaitable, Callable, Sequence

import jax
import numpy as np

from orbax_pathways.format import records as records_lib
from orbax_pathways.transports import values
from orbax_pathways import options as options_lib
from orbax_pathways._compat import orbax as compat
from orbax_pathways.storage import meta_io
from orbax_pathways.transports import base
from orbax_pathways.transports import colocated
from orbax_pathways.transports import share

NAME = options_lib.TransportName.PERSISTENCE.value
TIMEOUT = datetime.timedelta(hours=1)


@dataclasses.dataclass(frozen=True)
class WriteGroup:
  """One plugin call: arrays in one directory on one device assignment."""

  location: str
  names: tuple[str, ...]
  arrays: tuple[Any, ...]
  request: str  # Orbax's bulk write request JSON


def unsupported(leaves: Sequence[values.SaveLeaf], item: values.Item) -> list[str]:
  """Reasons the plugin cannot write this save (empty: it can)."""
  reasons = []
  if item.use_ocdbt:
    reasons.append('the checkpoint uses OCDBT, which the persistence plugin cannot write')
  cast = [leaf.name for leaf in leaves if np.dtype(leaf.stored_dtype) != np.dtype(leaf.dtype)]
  if cast:
    reasons.append(f'SaveArgs.dtype casts requested for {cast}, which the plugin cannot do')
  bad = [f'{leaf.name} ({np.dtype(leaf.dtype).name})' for leaf in leaves
         if not compat.persistence_dtype_supported(leaf.dtype)]
  if bad:
    reasons.append(f'dtypes the plugin cannot store: {bad}')
  return reasons


def build_groups(arrays: Sequence[jax.Array], leaves: Sequence[values.SaveLeaf],
                 item: values.Item, timeout=TIMEOUT) -> list[WriteGroup]:
  """Groups by device assignment, as the plugin requires (one directory per call here), in
  first-seen order."""
  groups: dict[tuple[int, ...], tuple[list[str], list[Any]]] = {}
  for arr, leaf in zip(arrays, leaves):
    names, members = groups.setdefault(compat.device_assignment_ids(arr.sharding), ([], []))
    names.append(leaf.name)
    members.append(arr)
  return [WriteGroup(item.directory, tuple(n), tuple(a),
                     compat.persistence_bulk_write_request(item.directory, n, a, timeout))
          for n, a in groups.values()]


def _one_writer(device) -> str:
  del device
  return 'workers'


class PersistenceTransport:
  """Pathways' persistence plugin writes; reads (and saves it cannot do) go through colocated."""

  name = NAME

  def __init__(self, *, save: base.SaveConfig | None = None, read: base.ReadConfig | None = None):
    self._save = save
    self.fallback = colocated.ColocatedTransport(save=save, read=read)

  def unsupported(self, leaves: Sequence[values.SaveLeaf], item: values.Item) -> list[str]:
    return unsupported(leaves, item)

  async def snapshot(self, arrays: Sequence[jax.Array], leaves: Sequence[values.SaveLeaf],
                     item: values.Item, ready: Callable[[], Awaitable[None]]) -> base.Snapshot:
    # The plugin program takes its inputs when it is enqueued: that is the snapshot, and it
    # needs the directory to exist.
    await ready()
    groups = build_groups(arrays, leaves, item)
    futures = [compat.persistence_write_arrays(g.location, g.names, g.arrays, TIMEOUT)
               for g in groups]
    whole_shards = values.PlanSettings(replica_parallel=False, coalesce_bytes=0)
    plans = [share.plan(a.sharding, leaf, _one_writer, whole_shards)
             for a, leaf in zip(arrays, leaves)]
    return base.Snapshot(
        layouts=[values.LeafLayout.of(leaf, plan) for leaf, plan in zip(leaves, plans)],
        layouts_exact=False, controller_tensor_bytes=0,
        state=(futures, item, tuple(leaves), plans))

  async def write(self, snap: base.Snapshot) -> list[values.WriterOutcome]:
    futures, item, leaves, plans = snap.state
    for f in futures:
      await asyncio.to_thread(f.result)
    # The plugin computes no checksums: the record carries the layout and shardings only.
    record = records_lib.writer_record('controller', NAME, [
        records_lib.ArrayRecord(name=leaf.name, dtype=np.dtype(leaf.stored_dtype).name,
                                shape=leaf.shape, chunk_shape=plan.chunk_shape, chunks=(),
                                sharding=leaf.sharding)
        for leaf, plan in zip(leaves, plans)])
    await asyncio.to_thread(meta_io.write_record, item.directory, record)
    return []

  async def read(self, targets, item):
    return await self.fallback.read(targets, item)
