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

What runs here: request building, grouping and the limit checks (tests/test_persistence.py);
the plugin program itself needs a Pathways server and is not run in tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import warnings
from typing import Any, Sequence

from orbax_pathways import metadata
from orbax_pathways import stats as stats_lib
from orbax_pathways._compat import orbax as compat
from orbax_pathways.storage import meta_io

NAME = 'persistence'
TIMEOUT = datetime.timedelta(hours=1)
log = logging.getLogger('orbax_pathways')


@dataclasses.dataclass(frozen=True)
class WriteGroup:
  """One plugin call: arrays in one directory on one device assignment."""

  location: str
  names: tuple[str, ...]
  arrays: tuple[Any, ...]
  request: str  # Orbax's bulk write request JSON


def unsupported(arrays: Sequence[Any], infos: Sequence[Any], args: Sequence[Any]) -> list[str]:
  """Reasons the plugin cannot write this save (empty: it can)."""
  reasons = []
  if any(bool(i.is_ocdbt_checkpoint) for i in infos):
    reasons.append('the checkpoint uses OCDBT, which the persistence plugin cannot write')
  cast = [i.name for i, a in zip(infos, args) if a is not None and a.dtype is not None]
  if cast:
    reasons.append(f'SaveArgs.dtype casts requested for {cast}, which the plugin cannot do')
  bad = [f'{i.name} ({a.dtype})' for i, a in zip(infos, arrays)
         if not compat.persistence_dtype_supported(a.dtype)]
  if bad:
    reasons.append(f'dtypes the plugin cannot store: {bad}')
  return reasons


def build_groups(arrays: Sequence[Any], infos: Sequence[Any], timeout=TIMEOUT) -> list[WriteGroup]:
  """Groups by (parent directory, device assignment), as the plugin requires, in first-seen order."""
  groups: dict[tuple[str, tuple[int, ...]], tuple[list[str], list[Any]]] = {}
  for arr, info in zip(arrays, infos):
    key = (str(info.parent_dir), tuple(d.id for d in arr.sharding._device_assignment))  # pylint: disable=protected-access
    names, members = groups.setdefault(key, ([], []))
    names.append(info.name)
    members.append(arr)
  return [WriteGroup(loc, tuple(n), tuple(a), compat.persistence_bulk_write_request(loc, n, a, timeout))
          for (loc, _), (n, a) in groups.items()]


async def serialize(handler, values, infos, args) -> list[Any]:
  from orbax_pathways import handler as handler_mod  # pylint: disable=g-import-not-at-top
  from orbax_pathways.transports import colocated  # pylint: disable=g-import-not-at-top
  args = list(args)
  arrays, ext = handler_mod._physical(values, infos)  # pylint: disable=protected-access
  reasons = unsupported(arrays, infos, args)
  if reasons:
    warnings.warn(
        'orbax_pathways: the Pathways persistence transport cannot write this save ('
        + '; '.join(reasons) + '); using the colocated transport instead (same on-disk format). '
        'Use use_ocdbt=False, no dtype casts and supported dtypes to use persistence.',
        RuntimeWarning, stacklevel=3)
    return await colocated.serialize(handler, values, infos, args)
  groups = build_groups(arrays, infos)
  st = stats_lib.SaveStats(transport=NAME, arrays=len(arrays), controller_tensor_bytes=0)
  stats_lib.record_save(st)
  await asyncio.gather(*(info.await_path_creation() for info in infos))
  futures = [compat.persistence_write_arrays(g.location, g.names, g.arrays, TIMEOUT) for g in groups]

  async def background():
    for f in futures:
      await asyncio.to_thread(f.result)
    record = metadata.WriterRecord(
        writer='controller', transport=NAME, arrays=tuple(
            dataclasses.replace(a, chunks=()) for a in handler.writer_record(
                'controller', NAME, arrays, infos, args,
                [handler._plan(x, lambda d: 'workers', coalesce=False) for x in arrays],  # pylint: disable=protected-access
                {}, with_sharding=True, st=st).arrays))
    await asyncio.to_thread(meta_io.write_record, infos[0].parent_dir, record)

  return [compat.CommitFuture(background(), name='orbax_pathways_persistence_write')]
