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

  Replica-split pieces are sliced on the device first, so only the piece crosses to the host;
  the shards of a coalesced small array are copied and then gathered into one host buffer.
  """
  pending = []
  for arr, plan in zip(arrays, plans):
    shards = {s.device.id: s for s in arr.addressable_shards}
    mine = []
    for w in plan.for_host(host):
      parts = []
      for src in w.sources:
        data = shards[src.device_id].data
        if len(w.sources) == 1 and w.box != src.shard_box:
          data, box = data[w.box.relative_to(src.shard_box)], w.box
        else:
          box = src.shard_box
        parts.append((box, data))
      mine.append((w, parts))
    pending.append(mine)
  for mine in pending:
    for _, parts in mine:
      for _, data in parts:
        data.copy_to_host_async()
  return [tuple(writer_lib.Piece(w.box, writer_lib.gather(w.box, [(b, np.asarray(d)) for b, d in parts]))
                for w, parts in mine) for mine in pending]
