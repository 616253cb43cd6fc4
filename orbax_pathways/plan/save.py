"""Who writes which box of an array, and the chunk grid it is stored with. Pure; no jax.

Called on every host (controller or process) with the same global description, so every host
derives the same plan and each then executes only the writes assigned to it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from orbax_pathways.plan import boxes as boxes_lib

Box = boxes_lib.Box


@dataclasses.dataclass(frozen=True)
class Placement:
  """One device's shard of an array: the device, the host that can write it, the box it holds."""

  device_id: int
  host: str
  box: Box


@dataclasses.dataclass(frozen=True)
class ShardWrite:
  """``host`` writes ``box`` (a whole shard or a replica-split piece of one) from ``device_id``."""

  host: str
  device_id: int
  box: Box
  shard_box: Box


@dataclasses.dataclass(frozen=True)
class ArrayWritePlan:
  global_shape: tuple[int, ...]
  chunk_shape: tuple[int, ...]
  writes: tuple[ShardWrite, ...]

  def for_host(self, host: str) -> tuple[ShardWrite, ...]:
    return tuple(w for w in self.writes if w.host == host)

  def chunks(self, write: ShardWrite) -> list[Box]:
    """The chunks ``write`` covers (the plan guarantees they tile it exactly), clipped."""
    return [boxes_lib.clip(c, self.global_shape)
            for c in boxes_lib.chunk_grid(write.box, self.chunk_shape)]

  def bytes_by_host(self, itemsize: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for w in self.writes:
      out[w.host] = out.get(w.host, 0) + w.box.size * itemsize
    return out


def _split_axis(shape: Sequence[int], parts: int) -> int | None:
  for axis, d in enumerate(shape):
    if d % parts == 0 and d >= parts:
      return axis
  return None


def plan_array_writes(
    global_shape: Sequence[int],
    itemsize: int,
    placements: Sequence[Placement],
    *,
    max_chunk_bytes: int,
    replica_parallel: bool = True,
    min_split_bytes: int = 1 << 20,
) -> ArrayWritePlan:
  """Each distinct shard is written exactly once.

  Without replica splitting, the first placement (device order) holding a box writes it, which
  matches Orbax's replica 0. With ``replica_parallel`` and a shard held on R >= 2 distinct hosts
  (the minimum over shards), the shard is cut into R equal pieces along its first axis divisible
  by R, each written by a different host, when a piece is at least ``min_split_bytes``.
  The chunk shape divides every piece and every piece start, so no chunk has two writers.
  """
  global_shape = tuple(int(d) for d in global_shape)
  by_box: dict[Box, list[Placement]] = {}
  for p in placements:
    by_box.setdefault(p.box, []).append(p)
  shard_boxes = sorted(by_box)

  hosts_per_box = {b: list(dict.fromkeys(p.host for p in by_box[b])) for b in shard_boxes}
  parts = min((len(h) for h in hosts_per_box.values()), default=1)
  axis = None
  if replica_parallel and parts > 1 and shard_boxes:
    shard_shape = shard_boxes[0].shape
    if all(b.shape == shard_shape for b in shard_boxes):
      axis = _split_axis(shard_shape, parts)
      if axis is not None and math.prod(shard_shape) * itemsize // parts < min_split_bytes:
        axis = None

  writes = []
  for b in shard_boxes:
    holders = by_box[b]
    if axis is None:
      writes.append(ShardWrite(holders[0].host, holders[0].device_id, b, b))
      continue
    step = b.shape[axis] // parts
    for i, host in enumerate(hosts_per_box[b][:parts]):
      holder = next(p for p in holders if p.host == host)
      start = list(b.start)
      stop = list(b.stop)
      start[axis] = b.start[axis] + i * step
      stop[axis] = start[axis] + step
      writes.append(ShardWrite(host, holder.device_id, Box(tuple(start), tuple(stop)), b))

  # One regular chunk grid for the whole array: it must divide every piece and start offset.
  grid = []
  for dim in range(len(global_shape)):
    g = 0
    for w in writes:
      g = math.gcd(g, w.box.start[dim])
      g = math.gcd(g, w.box.shape[dim])
    grid.append(g or max(1, global_shape[dim]))
  chunk_shape = boxes_lib.choose_chunk_shape(grid, itemsize, max_chunk_bytes)
  return ArrayWritePlan(global_shape, chunk_shape, tuple(writes))
