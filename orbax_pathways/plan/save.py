"""Who writes which box of an array, and the chunk grid it is stored with. Pure; no jax.

Called on every host (controller or process) with the same global description, so every host
derives the same plan and each then executes only the writes assigned to it.
"""

from __future__ import annotations

import dataclasses
import itertools
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
class Source:
  """Where a write's bytes come from: the shard ``shard_box`` held on device ``device_id``."""

  device_id: int
  shard_box: Box


@dataclasses.dataclass(frozen=True)
class ShardWrite:
  """``host`` writes ``box``, gathered from ``sources`` (all on devices of ``host``).

  One source: a whole shard, or a replica-split piece of it (``box`` inside its shard box).
  Several sources: whole shards that tile ``box`` exactly (a coalesced small array).
  """

  host: str
  box: Box
  sources: tuple[Source, ...]


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
    coalesce_bytes: int = 0,
) -> ArrayWritePlan:
  """Each distinct shard is written exactly once.

  Without replica splitting, the first placement (device order) holding a box writes it, which
  matches Orbax's replica 0. With ``replica_parallel`` and a shard held on R >= 2 distinct hosts
  (the minimum over shards), the shard is cut into R equal pieces along its first axis divisible
  by R, each written by a different host, when a piece is at least ``min_split_bytes``.
  An array of at most ``coalesce_bytes`` (and ``max_chunk_bytes``) whose shards tile it evenly
  is instead written in as few writes (and chunks) as possible: each write gathers the adjacent
  shards that one host holds (see ``coalesced_writes``), so a small array sharded over 8 devices
  of one host is one chunk, not 8.
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

  writes = None
  if axis is None and math.prod(global_shape) * itemsize <= min(coalesce_bytes, max_chunk_bytes):
    writes = coalesced_writes(global_shape, by_box)
  if writes is None:
    writes = []
    for b in shard_boxes:
      holders = by_box[b]
      if axis is None:
        writes.append(ShardWrite(holders[0].host, b, (Source(holders[0].device_id, b),)))
        continue
      step = b.shape[axis] // parts
      for i, host in enumerate(hosts_per_box[b][:parts]):
        holder = next(p for p in holders if p.host == host)
        start = list(b.start)
        stop = list(b.stop)
        start[axis] = b.start[axis] + i * step
        stop[axis] = start[axis] + step
        writes.append(ShardWrite(host, Box(tuple(start), tuple(stop)),
                                 (Source(holder.device_id, b),)))

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


MAX_COALESCE_SHARDS = 256  # beyond this many shards the search is not worth it for a small array


def coalesced_writes(global_shape: tuple[int, ...],
                     by_box: dict[Box, list[Placement]]) -> list[ShardWrite] | None:
  """The fewest equal blocks of whole shards such that one host holds every shard of a block.

  Applies when the distinct shards have one shape and tile the array (even sharding); returns
  None otherwise, or when there is nothing to gather. Blocks are tried from the whole array
  down (fewest blocks first), so with every shard on one host (one process, or one Pathways
  worker) the array becomes a single write; across hosts, each host's contiguous share does.
  A block's writer is the first host, in device order of its first shard, that holds them all.
  """
  boxes = sorted(by_box)
  if len(boxes) < 2 or len(boxes) > MAX_COALESCE_SHARDS or not global_shape:
    return None
  shard = boxes[0].shape
  if (0 in shard or any(b.shape != shard for b in boxes)
      or any(d % s for d, s in zip(global_shape, shard))
      or len(boxes) * math.prod(shard) != math.prod(global_shape)):
    return None
  counts = tuple(d // s for d, s in zip(global_shape, shard))
  at = {tuple(a // s for a, s in zip(b.start, shard)): b for b in boxes}
  if len(at) != len(boxes):
    return None
  hosts = {b: list(dict.fromkeys(p.host for p in by_box[b])) for b in boxes}

  candidates = sorted(itertools.product(*(boxes_lib.divisors(c) for c in counts)),
                      key=lambda k: (math.prod(c // f for c, f in zip(counts, k)), k[::-1]))
  for block in candidates:
    if math.prod(block) == 1:
      return None  # every block a single shard: the plain plan is the same
    writes = _blocks(block, counts, shard, at, hosts, by_box)
    if writes is not None:
      return writes
  return None


def _blocks(block, counts, shard, at, hosts, by_box) -> list[ShardWrite] | None:
  writes = []
  for origin in itertools.product(*(range(0, c, f) for c, f in zip(counts, block))):
    members = [at[tuple(o + i for o, i in zip(origin, idx))]
               for idx in itertools.product(*(range(f) for f in block))]
    common = set(hosts[members[0]])
    for m in members[1:]:
      common &= set(hosts[m])
    if not common:
      return None
    host = next(h for h in hosts[members[0]] if h in common)
    sources = tuple(Source(next(p.device_id for p in by_box[m] if p.host == host), m)
                    for m in members)
    start = tuple(o * s for o, s in zip(origin, shard))
    stop = tuple(a + f * s for a, f, s in zip(start, block, shard))
    writes.append(ShardWrite(host, Box(start, stop), sources))
  return writes
