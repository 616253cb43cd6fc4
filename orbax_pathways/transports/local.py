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


def pinned_available(arrays: Sequence[jax.Array]) -> bool:
  """Whether every device of ``arrays`` is an accelerator with a ``pinned_host`` memory."""
  devices = {d for a in arrays for d in a.sharding.device_set}
  try:
    return bool(devices) and all(
        d.platform != 'cpu' and any(m.kind == 'pinned_host' for m in d.addressable_memories())
        for d in devices)
  except Exception:  # pylint: disable=broad-except  # a backend without memories API
    return False


def use_pinned(arrays: Sequence[jax.Array], mode: str) -> bool:
  """``Options.snapshot`` resolved for these arrays ('auto': pinned where available)."""
  if mode == 'auto':
    return pinned_available(arrays)
  return mode == 'pinned'


def snapshot(arrays: Sequence[jax.Array], plans: Sequence[save_plan.ArrayWritePlan],
             host: str, *, pinned: bool = False) -> list[tuple[writer_lib.Piece, ...]]:
  """Device-to-host copy of every piece ``host`` writes, all copies in flight at once.

  Replica-split pieces are sliced on the device first, so only the piece crosses to the host;
  the shards of a coalesced small array are copied and then gathered into one host buffer.
  With ``pinned``, single-shard pieces are copied in one batched ``jax.device_put`` into pinned
  host memory (DMA speed; whether XLA's host allocator reuses the pinned pages across saves is
  what ``bench.py --mode gpu`` shows as first vs later save() blocking) and stay ``jax.Array``s
  there: the writer turns them into numpy in the background (``writer.host_pieces``), off the
  training thread.
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
  if pinned:
    single = [parts[0][1] for mine in pending for _, parts in mine if len(parts) == 1]
    moved = iter(jax.block_until_ready(jax.device_put(single, [
        jax.sharding.SingleDeviceSharding(next(iter(d.devices())), memory_kind='pinned_host')
        for d in single])) if single else [])
    pending = [[(w, [(parts[0][0], next(moved))] if len(parts) == 1 else parts)
                for w, parts in mine] for mine in pending]
  for mine in pending:
    for _, parts in mine:
      if pinned and len(parts) == 1:
        continue
      for _, data in parts:
        data.copy_to_host_async()
  out = []
  for mine in pending:
    pieces = []
    for w, parts in mine:
      if pinned and len(parts) == 1:
        pieces.append(writer_lib.Piece(w.box, parts[0][1]))
      else:
        pieces.append(writer_lib.Piece(
            w.box, writer_lib.gather(w.box, [(b, np.asarray(d)) for b, d in parts])))
    out.append(tuple(pieces))
  return out
