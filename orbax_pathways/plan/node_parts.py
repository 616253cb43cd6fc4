"""Which saved parts of a node step a process reads to restore what its devices hold now: pure
planning, no I/O, no jax.

A node step is saved as one part per process (writer ``p<i>``: the shards its devices held,
and every numpy and scalar leaf). A restore onto another process count, or onto devices laid
out otherwise, needs for each array the parts whose shards overlap the boxes its devices hold
now. The saved layout says which: each array's saved mesh sharding (``SavedLayout``: the mesh,
its devices in mesh order and the PartitionSpec, from its ``ShardingRecord``) gives every saved
device's box, and the step's device
runs (``encode_processes``, kept beside the step by ``multitier/node_layout.py``) say which
process saved each device. Called on every restoring process by ``multitier/node_gather.py``.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any, Callable, Container, Iterable, Sequence

import numpy as np

from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import shards as shards_lib

Box = boxes_lib.Box


@dataclasses.dataclass(frozen=True)
class SavedLayout:
  """How an array was laid out at save time: a mesh sharding (``mesh_shape``, ``axis_names``,
  ``device_ids`` in mesh order, row-major, and the PartitionSpec ``spec``)."""

  mesh_shape: tuple[int, ...]
  axis_names: tuple[str, ...]
  device_ids: tuple[int, ...]
  spec: tuple[Any, ...]


# A layout the records do not say (not a mesh sharding): every part may hold some of the array.
UNKNOWN = SavedLayout((), (), (), ())


def encode_processes(device_process: Iterable[tuple[int, int]]) -> list[list[int]]:
  """``(device id, process)`` pairs as runs ``[first id, count, process]`` of consecutive
  device ids of one process, in id order: a job's devices usually number each process's
  devices together, so this is about one run per process."""
  runs: list[list[int]] = []
  for d, p in sorted((int(d), int(p)) for d, p in device_process):
    if runs and runs[-1][2] == p and runs[-1][0] + runs[-1][1] == d:
      runs[-1][1] += 1
    else:
      runs.append([d, 1, p])
  return runs


def process_of(runs: Sequence[Sequence[int]], device_id: int) -> int | None:
  """The process that held ``device_id`` (``encode_processes``'s runs), or None."""
  i = bisect.bisect_right([r[0] for r in runs], int(device_id)) - 1
  if i >= 0 and runs[i][0] <= device_id < runs[i][0] + runs[i][1]:
    return int(runs[i][2])
  return None


def saved_boxes(record: SavedLayout | None, shape: Sequence[int]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
  """(device ids, box starts, box stops) of every device of the saved mesh, in mesh order
  (JAX's layout of a ``NamedSharding``: dimension ``k`` cut into ``n`` equal shards over its
  mesh axes, the first axis major); None where the record does not say (no mesh sharding, or
  a spec that is not plain mesh axes)."""
  if record is None or not record.device_ids:
    return None
  shape = tuple(int(d) for d in shape)
  axes = shards_lib.spec_axes(record.spec, len(shape))
  cells = (shards_lib.mesh_cells(record.mesh_shape, record.axis_names, axes)
           if axes is not None else None)
  if cells is None or len(record.device_ids) != math.prod(record.mesh_shape):
    return None
  counts, shard_of = cells
  size = np.asarray([-(-d // c) if c else d for d, c in zip(shape, counts)], dtype=np.int64)
  coords = shards_lib.cell_coords(tuple(counts))[shard_of]
  dims = np.asarray(shape, dtype=np.int64)
  start = np.minimum(coords * size, dims)
  stop = np.minimum(start + size, dims)
  return np.asarray(record.device_ids, dtype=np.int64), start, stop


def needed(arrays: Iterable[tuple[SavedLayout | None, Sequence[int], Sequence[Box]]],
           runs: Sequence[Sequence[int]], writers: int, local: Container[int],
           live: Callable[[int], bool] | None = None) -> set[int]:
  """The writers (saving processes) whose parts hold every box of ``arrays``: per array its
  ``SavedLayout`` (None: a numpy or scalar leaf, which every part holds), its shape
  and the boxes this process's devices hold now. Each distinct saved box overlapping one of
  them is taken from one process that held it: one in ``local`` (parts this node holds) where
  there is one, else one already chosen, else the lowest, among those ``live`` says some live
  node holds (asked in that order, only until one answers yes; None: all) where any is. An
  array whose layout is ``UNKNOWN`` needs every writer."""
  need: set[int] = set()
  any_one: list[bool] = []
  for record, shape, boxes in arrays:
    boxes = [b for b in boxes if b.size]
    if not boxes:
      continue
    if record is None:
      any_one.append(True)
      continue
    saved = saved_boxes(record, shape)
    if saved is None:
      return set(range(writers))
    ids, start, stop = saved
    procs = np.asarray([-1 if (p := process_of(runs, i)) is None else p for i in ids.tolist()])
    for box in boxes:
      lo, hi = np.asarray(box.start, np.int64), np.asarray(box.stop, np.int64)
      hit = np.all((start < hi) & (stop > lo), axis=1) & np.all(stop > start, axis=1)
      by_box: dict[tuple[int, ...], list[int]] = {}
      for pos in np.flatnonzero(hit).tolist():
        by_box.setdefault(tuple(start[pos].tolist()), []).append(int(procs[pos]))
      for holders in by_box.values():
        if -1 in holders or not holders:
          return set(range(writers))
        order = list(dict.fromkeys([p for p in holders if p in local]
                                   + [p for p in holders if p in need] + sorted(holders)))
        pick = next((p for p in order if p in local or live is None or live(p)), order[0])
        need.add(pick)
  if any_one and not need:
    need.add(next((w for w in range(writers) if w in local),
                  next((w for w in range(writers) if live is None or live(w)), 0)))
  return need
