"""Which byte ranges a host reads to fill its devices' shards of a restored array. Pure.

Called on each reading host (a process, or a Pathways worker in the colocated transport) with the
boxes its own devices need. Every needed chunk is read once per host, however many local devices
or replicas need it: the host reads chunk-aligned *regions* and slices device shards out of them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from orbax_pathways.plan import boxes as boxes_lib

Box = boxes_lib.Box


@dataclasses.dataclass(frozen=True)
class Region:
  """A chunk-aligned box read in one tensorstore call, and the device boxes cut from it."""

  box: Box
  device_boxes: tuple[Box, ...]


@dataclasses.dataclass(frozen=True)
class ArrayReadPlan:
  global_shape: tuple[int, ...]
  regions: tuple[Region, ...]

  def bytes_read(self, itemsize: int) -> int:
    return sum(r.box.size for r in self.regions) * itemsize


def _align(box: Box, chunk_shape: Sequence[int], shape: Sequence[int]) -> Box:
  start = tuple((a // c) * c for a, c in zip(box.start, chunk_shape))
  stop = tuple(min(d, -(-b // c) * c) for b, c, d in zip(box.stop, chunk_shape, shape))
  return Box(start, stop)


def _bounding(a: Box, b: Box) -> Box:
  return Box(tuple(map(min, a.start, b.start)), tuple(map(max, a.stop, b.stop)))


def plan_array_reads(
    global_shape: Sequence[int],
    chunk_shape: Sequence[int] | None,
    needed: Sequence[Box],
) -> ArrayReadPlan:
  """Groups the distinct needed boxes into disjoint chunk-aligned regions.

  Boxes whose aligned regions overlap (they share a chunk) are merged into their bounding
  region, so the shared chunk is decoded once. ``chunk_shape=None`` (unknown layout, e.g. a
  stock checkpoint not yet inspected) reads each distinct box as is.
  """
  global_shape = tuple(int(d) for d in global_shape)
  distinct = sorted(set(needed))
  if chunk_shape is None or not global_shape:
    return ArrayReadPlan(global_shape, tuple(Region(b, (b,)) for b in distinct))
  groups: list[tuple[Box, list[Box]]] = []
  for b in distinct:
    region = _align(b, chunk_shape, global_shape)
    members = [b]
    merged = True
    while merged:  # Merge with every existing group this region touches, transitively.
      merged = False
      for i, (g_box, g_members) in enumerate(groups):
        if g_box.intersect(region) is not None:
          region = _bounding(region, g_box)
          members += g_members
          del groups[i]
          merged = True
          break
    groups.append((region, members))
  regions = tuple(Region(r, tuple(sorted(m))) for r, m in sorted(groups, key=lambda g: g[0]))
  return ArrayReadPlan(global_shape, regions)
