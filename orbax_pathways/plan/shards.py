"""Which hosts hold each distinct shard of an array, as integer tables. Pure; no jax, no I/O.

``sharding/layout.py`` builds these on the controller (or on each process) from a JAX sharding, and
``save.plan_array_writes`` from a list of placements; ``save.plan_shards`` plans the writes from
them. Every step is numpy over devices, never a Python object per device, so a sharding with
thousands of replicas of a few shards costs little more than its distinct shards do, and one
``Grid`` (an even mesh layout) serves every array laid out the same way whatever its shape.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterable, Sequence

import numpy as np
import numpy.typing as npt


@dataclasses.dataclass(frozen=True, eq=False)
class Holders:
  """For each distinct shard ``0..S-1``, the hosts holding it, first holder first.

  One row per (shard, host) pair, sorted by shard, then by where the host's first device
  holding the shard comes in the input order (device-id order in ``sharding/layout.py``): ``rank`` 0 is
  the host of the shard's first holder, the one that writes it unless replicas split it.
  """

  hosts: tuple[str, ...]  # host index -> host key
  shard: np.ndarray  # (P,) the shard of each pair, non-decreasing
  host: np.ndarray  # (P,) host index
  device: np.ndarray  # (P,) that host's first device (input order) holding the shard
  rank: np.ndarray  # (P,) position of the host among the shard's hosts
  count: np.ndarray  # (S,) hosts per shard

  @functools.cached_property
  def host_index(self) -> dict[str, int]:
    return {h: i for i, h in enumerate(self.hosts)}

  @property
  def num_shards(self) -> int:
    return len(self.count)


def holders(shard_of: np.ndarray, device_ids: np.ndarray, host_of: np.ndarray,
            hosts: tuple[str, ...], num_shards: int) -> Holders:
  """From one entry per device, in the order that decides who holds a shard first.

  ``shard_of``: the device's shard index; ``host_of``: index into ``hosts``.
  """
  shard_of = np.asarray(shard_of, dtype=np.int64)
  host_of = np.asarray(host_of, dtype=np.int64)
  device_ids = np.asarray(device_ids, dtype=np.int64)
  order = np.argsort(shard_of, kind='stable')  # by shard, input order inside each shard
  key = shard_of[order] * max(1, len(hosts)) + host_of[order]
  _, first = np.unique(key, return_index=True)  # each (shard, host) pair's first device
  pos = order[np.sort(first)]
  shard = shard_of[pos]
  count = np.bincount(shard, minlength=num_shards)
  offsets = np.cumsum(count) - count
  rank = np.arange(len(pos), dtype=np.int64) - offsets[shard]
  return Holders(hosts, shard, host_of[pos], device_ids[pos], rank, count)


def intern_hosts(names: Sequence[str]) -> tuple[np.ndarray, tuple[str, ...]]:
  """Host keys -> (index per entry, distinct keys in first-seen order)."""
  index: dict[str, int] = {}
  idx = np.fromiter((index.setdefault(h, len(index)) for h in names), dtype=np.int64,
                    count=len(names))
  return idx, tuple(index)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardTable:
  """The distinct shard boxes of one array, sorted as ``boxes.Box`` sorts, and their holders."""

  global_shape: tuple[int, ...]
  start: np.ndarray  # (S, ndim)
  stop: np.ndarray  # (S, ndim)
  holders: Holders


def from_boxes(global_shape: Sequence[int], device_ids: Sequence[int], host_names: Sequence[str],
               start: npt.ArrayLike, stop: npt.ArrayLike) -> ShardTable:
  """From every device's box (rows of ``start``/``stop``), in the order that decides first
  holders. Devices with equal boxes hold the same shard."""
  global_shape = tuple(int(d) for d in global_shape)
  ndim = len(global_shape)
  n = len(device_ids)
  start = np.asarray(start, dtype=np.int64).reshape(n, ndim)
  stop = np.asarray(stop, dtype=np.int64).reshape(n, ndim)
  host_idx, hosts = intern_hosts(host_names)
  if n == 0 or ndim == 0:
    rows = np.zeros((min(n, 1), 2 * ndim), dtype=np.int64)
    inverse = np.zeros(n, dtype=np.int64)
  else:
    # np.unique over rows sorts them lexicographically: (start..., stop...), the order of Box.
    rows, inverse = np.unique(np.concatenate([start, stop], axis=1), axis=0, return_inverse=True)
  return ShardTable(global_shape, rows[:, :ndim], rows[:, ndim:],
                    holders(inverse.reshape(-1), np.asarray(device_ids), host_idx, hosts, len(rows)))


@dataclasses.dataclass(frozen=True, eq=False)
class Grid:
  """An even layout, independent of the array's shape: dimension ``k`` is cut into
  ``counts[k]`` equal parts, and shard ``i`` is the ``i``-th cell in row-major order (the order
  of its boxes for any shape the grid divides)."""

  counts: tuple[int, ...]
  holders: Holders

  def fits(self, shape: Sequence[int]) -> bool:
    return fits(self.counts, shape)

  def table(self, shape: Sequence[int]) -> ShardTable:
    shape = tuple(int(d) for d in shape)
    start = cell_coords(self.counts) * shard_shape(shape, self.counts)
    return ShardTable(shape, start, start + shard_shape(shape, self.counts), self.holders)


def fits(counts: Sequence[int], shape: Sequence[int]) -> bool:
  """Whether ``shape`` cuts into ``counts`` distinct equal shards per dimension (a zero-size
  dimension cut more than once does not: its shards would all be the same empty box)."""
  return len(shape) == len(counts) and all(
      d % c == 0 and (d > 0 or c == 1) for d, c in zip(shape, counts))


def shard_shape(shape: Sequence[int], counts: Sequence[int]) -> np.ndarray:
  return np.asarray([d // c for d, c in zip(shape, counts)], dtype=np.int64)


@functools.lru_cache(maxsize=256)
def cell_coords(counts: tuple[int, ...]) -> np.ndarray:
  """(S, ndim) coordinates of every cell of a grid of ``counts`` cells, row-major (read-only)."""
  out = np.indices(counts, dtype=np.int64).reshape(len(counts), -1).T if counts else \
      np.zeros((1, 0), dtype=np.int64)
  out.flags.writeable = False
  return out


def spec_axes(spec: Iterable[Any], ndim: int) -> tuple[tuple[str, ...], ...] | None:
  """PartitionSpec entries (None, an axis name, or a sequence of names) as one tuple of mesh
  axes per array dimension; None when the spec is longer than ``ndim`` or has other entries."""
  spec = tuple(spec)
  if len(spec) > ndim:
    return None
  out: list[tuple[str, ...]] = []
  for entry in spec + (None,) * (ndim - len(spec)):
    if entry is None:
      out.append(())
    elif isinstance(entry, str):
      out.append((entry,))
    elif isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
      out.append(tuple(entry))
    else:
      return None
  return tuple(out)


def mesh_cells(mesh_shape: Sequence[int], axis_names: Sequence[str],
               axes: tuple[tuple[str, ...], ...]) -> tuple[tuple[int, ...], np.ndarray] | None:
  """(shard counts per array dimension, the shard index of every mesh position in row-major
  order) for a mesh sharding whose dimension ``k`` is split over the mesh axes ``axes[k]``,
  the first axis major: as JAX lays out a ``NamedSharding``. None if an axis is unknown or
  used twice."""
  names = list(axis_names)
  used = [a for dim in axes for a in dim]
  if len(set(used)) != len(used) or any(a not in names for a in used):
    return None
  size = dict(zip(names, (int(s) for s in mesh_shape)))
  coords = np.indices(tuple(size[a] for a in names), dtype=np.int64).reshape(len(names), -1)
  npos = math.prod(size.values())
  counts, shard = [], np.zeros(npos, dtype=np.int64)
  for dim in axes:
    cell, parts = np.zeros(npos, dtype=np.int64), 1
    for a in dim:
      cell = cell * size[a] + coords[names.index(a)]
      parts *= size[a]
    counts.append(parts)
    shard = shard * parts + cell
  return tuple(counts), shard


def mesh_grid(mesh_shape: Sequence[int], axis_names: Sequence[str], spec: Sequence[Any], ndim: int,
              device_ids: Sequence[int], host_of: Sequence[int], hosts: tuple[str, ...]) -> Grid | None:
  """The ``Grid`` of a mesh sharding of an ``ndim``-dimensional array.

  ``device_ids`` and ``host_of`` (index into ``hosts``) list the mesh's devices row-major, as
  ``mesh.devices.flat`` does. None when the spec is not a plain mesh-axis spec (the caller asks
  JAX for every device's index instead).
  """
  axes = spec_axes(spec, ndim)
  cells = mesh_cells(mesh_shape, axis_names, axes) if axes is not None else None
  return None if cells is None else grid(*cells, device_ids, host_of, hosts)


def grid(counts: tuple[int, ...], shard_of: np.ndarray, device_ids: npt.ArrayLike,
         host_of: npt.ArrayLike, hosts: tuple[str, ...]) -> Grid:
  """From ``mesh_cells`` and the mesh's devices (row-major); first holders in device-id order."""
  ids = np.asarray(device_ids, dtype=np.int64).reshape(-1)
  order = np.argsort(ids, kind='stable')
  return Grid(counts, holders(np.asarray(shard_of)[order], ids[order],
                              np.asarray(host_of, dtype=np.int64).reshape(-1)[order], hosts,
                              math.prod(counts)))
