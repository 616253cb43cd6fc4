"""Local transport: this process moves the bytes of the shards its own devices hold.

Used in single-process and multi-controller JAX. Called by the handler on each process:
``snapshot`` in the caller's thread (the only part ``save()`` blocks on), ``write`` in Orbax's
background commit thread, ``read`` during restore.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from orbax_pathways.plan import save as save_plan
from orbax_pathways.storage import writer as writer_lib

NAME = 'local'


def host_key(process_index: int) -> str:
  return f'p{process_index}'


def host_of(device) -> str:
  return host_key(device.process_index)


def this_host() -> str:
  return host_key(jax.process_index())


def snapshot(arrays: Sequence[jax.Array], plans: Sequence[save_plan.ArrayWritePlan],
             host: str) -> list[tuple[writer_lib.Piece, ...]]:
  """Device-to-host copy of every piece ``host`` writes, all copies in flight at once.

  Replica-split pieces are sliced on the device first, so only the piece crosses to the host.
  """
  pending = []
  for arr, plan in zip(arrays, plans):
    shards = {s.device.id: s for s in arr.addressable_shards}
    mine = []
    for w in plan.for_host(host):
      data = shards[w.device_id].data
      if w.box != w.shard_box:
        data = data[w.box.relative_to(w.shard_box)]
      mine.append((w, data))
    pending.append(mine)
  for mine in pending:
    for _, data in mine:
      data.copy_to_host_async()
  return [tuple(writer_lib.Piece(w.box, np.asarray(data)) for w, data in mine) for mine in pending]
