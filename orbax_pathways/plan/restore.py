"""Which byte ranges a host reads to fill its devices' shards of a restored array. Pure.

Called on each reading host (a process, or a Pathways worker in the colocated transport) with the
boxes its own devices need. Every needed chunk is read once per host, however many local devices
or replicas need it: the host reads chunk-aligned *regions* and slices device shards out of them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

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


def plan_array_reads(
    global_shape: Sequence[int],
    chunk_shape: Sequence[int] | None,
    needed: Sequence[Box],
) -> ArrayReadPlan:
  """Groups the distinct needed boxes into disjoint chunk-aligned regions.

  Boxes whose aligned regions overlap (they share a chunk) are merged into their bounding
  region, so the shared chunk is decoded once; merging repeats while merged regions overlap, so
  the regions are the finest disjoint ones. ``chunk_shape=None`` (unknown layout, e.g. a stock
  checkpoint not yet inspected) reads each distinct box as is. Near-linear in the number of
  boxes, so a controller that reads for thousands of devices (Pathways) plans in milliseconds.
  """
  global_shape = tuple(int(d) for d in global_shape)
  ndim = len(global_shape)
  needed = list(needed)
  if not needed:
    return ArrayReadPlan(global_shape, ())
  start = np.asarray([b.start for b in needed], dtype=np.int64).reshape(len(needed), ndim)
  stop = np.asarray([b.stop for b in needed], dtype=np.int64).reshape(len(needed), ndim)
  if ndim:  # distinct boxes in Box order (rows sort as (start..., stop...) tuples do)
    rows, first = np.unique(np.concatenate([start, stop], axis=1), axis=0, return_index=True)
    start, stop = rows[:, :ndim], rows[:, ndim:]
  else:
    first = np.zeros(1, dtype=np.int64)
  distinct = [needed[i] for i in first.tolist()]
  if chunk_shape is None or not ndim:
    return ArrayReadPlan(global_shape, tuple(Region(b, (b,)) for b in distinct))
  chunk = np.asarray(chunk_shape, dtype=np.int64)
  box_start, box_stop = start, stop
  start = start // chunk * chunk  # aligned outward to the chunk grid, clipped to the array
  stop = np.minimum(np.asarray(global_shape, dtype=np.int64), -(-stop // chunk) * chunk)
  group, start, stop = _merge(start, stop)
  members: list[list[Box]] = [[] for _ in range(len(start))]
  for b, g in zip(distinct, group.tolist()):
    members[g].append(b)
  # A region that is exactly one needed box (chunks aligned with shards) reuses its Box.
  exact = np.zeros(len(start), dtype=bool)
  exact[group] = (np.all(start[group] == box_start, axis=1) & np.all(stop[group] == box_stop, axis=1)
                  & (np.bincount(group, minlength=len(start)) == 1)[group])
  order = np.lexsort(np.concatenate([start, stop], axis=1).T[::-1])  # regions in Box order
  regions = tuple(Region(members[g][0] if e else Box(tuple(a), tuple(z)), tuple(members[g]))
                  for a, z, g, e in zip(start[order].tolist(), stop[order].tolist(), order.tolist(),
                                        exact[order].tolist()))
  return ArrayReadPlan(global_shape, regions)


def _merge(start: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Merges overlapping boxes into their bounding boxes until none overlap.

  Returns (group of each input box, group starts, group stops). The result is the finest
  grouping whose bounding boxes are disjoint, whatever the order of merging (a merge never
  separates boxes that any disjoint grouping must keep together), so it equals merging one
  pair at a time.
  """
  group = np.arange(len(start))
  while True:
    a, b = _overlapping(start, stop)
    if not len(a):
      return group, start, stop
    _, merged = np.unique(_components(len(start), a, b), return_inverse=True)
    merged = merged.reshape(-1)
    count = int(merged.max()) + 1
    new_start = np.full((count, start.shape[1]), np.iinfo(np.int64).max, dtype=np.int64)
    new_stop = np.full((count, start.shape[1]), np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(new_start, merged, start)
    np.maximum.at(new_stop, merged, stop)
    group, start, stop = merged[group], new_start, new_stop


_PAIR_BATCH = 1 << 21


def _overlapping(start: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """All pairs (i, j) of boxes that overlap, by a sweep along the dimension where the fewest
  pairs overlap in projection (linear for boxes tiling an array, whatever its layout)."""
  n, ndim = start.shape
  best: tuple[np.ndarray, int, np.ndarray] | None = None
  for k in range(ndim):
    order = np.argsort(start[:, k], kind='stable')
    # Boxes after i in start order that begin before i ends: the candidates along k.
    reach = np.searchsorted(start[order, k], stop[order, k], side='left')
    count = np.maximum(reach - np.arange(n) - 1, 0)
    if best is None or count.sum() < best[2].sum():
      best = (order, k, count)
  assert best is not None, 'plan_array_reads merges boxes only for arrays of ndim >= 1'
  order, _, count = best
  found_a, found_b = [], []
  first = 0
  while first < n:  # in batches of about _PAIR_BATCH candidate pairs
    total = np.cumsum(count[first:])
    last = first + max(1, int(np.searchsorted(total, _PAIR_BATCH, side='right')))
    c = count[first:last]
    i = np.repeat(np.arange(first, last), c)
    j = i + 1 + np.arange(len(i)) - np.repeat(np.cumsum(c) - c, c)
    i, j = order[i], order[j]
    hit = np.all((np.maximum(start[i], start[j]) < np.minimum(stop[i], stop[j])), axis=1)
    found_a.append(i[hit])
    found_b.append(j[hit])
    first = last
  return np.concatenate(found_a), np.concatenate(found_b)


def _components(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Connected components of the graph with edges (a, b): each node's smallest member."""
  label = np.arange(n)
  while True:
    la, lb = label[a], label[b]
    low = np.minimum(la, lb)
    new = label.copy()
    np.minimum.at(new, la, low)  # hook each root onto the smaller root it touches
    np.minimum.at(new, lb, low)
    while True:  # pointer jumping: every node to its root
      jumped = new[new]
      if np.array_equal(jumped, new):
        break
      new = jumped
    if np.array_equal(new, label):
      return label
    label = new
