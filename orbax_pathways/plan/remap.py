"""Rebuild a saved mesh over the current slices. Pure integers: no jax, no I/O.

Called on every controller process at restore (each derives the same answer from the same
global device list). The saved mesh's *slice axes* (mesh axes whose coordinate crosses a slice
boundary) are resized by M/N; every other axis, the PartitionSpecs and each device's position
inside its slice are kept. A device count that no single axis can absorb (8 saved devices
restored onto 1, 3, 5 or 7) still gets a mesh: each axis keeps what divides the new count and
the first (slice) axis takes the rest (``NewMesh.fitted``); dims that then do not divide are
replicated (``fit_spec``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np


class RemapError(ValueError):
  """The saved mesh cannot be laid over the current slices (message says why and what to do)."""


@dataclasses.dataclass(frozen=True)
class SavedMesh:
  shape: tuple[int, ...]
  axis_names: tuple[str, ...]
  device_ids: tuple[int, ...]  # row-major over ``shape``
  device_slices: tuple[int, ...]  # slice of each device, same order
  slice_axes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class NewMesh:
  shape: tuple[int, ...]
  axis_names: tuple[str, ...]
  device_ids: tuple[int, ...]
  resized_axes: tuple[str, ...]
  # True when no single axis could absorb the device-count change and several axes were
  # resized to what divides it (the caller then reports one summary line, not a warning a dim).
  fitted: bool = False


def _slices_in_order(current: Mapping[int, Sequence[int]]) -> list[list[int]]:
  return [sorted(current[s]) for s in sorted(current)]


def remap_mesh(saved: SavedMesh, current: Mapping[int, Sequence[int]]) -> NewMesh:
  """Lays ``saved`` over ``current`` (slice index -> device ids).

  With one slice axis whose slices are contiguous blocks of ``k`` along it and equal device
  counts per slice (the multislice layout), the axis becomes ``k * M`` long and the device at
  new coordinate ``c`` is, in slice ``c_a // k``, the device with the same intra-slice rank as
  the saved device at ``c_a % k``. Otherwise (no slice axis, unequal slice sizes) the mesh keeps
  its shape when the device count allows, else one axis (a slice axis, else the first that can)
  is scaled by the device-count ratio, else (no axis can: 8 devices onto 3) every axis is cut
  to what divides the new count and the first takes the rest (``fitted``). Devices are assigned
  in slice-major order. Raises ``RemapError`` only when there are no devices.
  """
  slices = _slices_in_order(current)
  m = len(slices)
  ids = np.asarray(saved.device_ids, dtype=np.int64)
  of = np.asarray(saved.device_slices, dtype=np.int64)
  saved_slices, per_saved = np.unique(of, return_counts=True)
  n = len(saved_slices)
  equal_sizes = len(set(per_saved.tolist()) | {len(v) for v in slices}) == 1

  if len(saved.slice_axes) == 1 and equal_sizes:
    a = saved.axis_names.index(saved.slice_axes[0])
    size = saved.shape[a]
    slice_grid = of.reshape(saved.shape)
    if size % n == 0:
      k = size // n
      blocks = np.repeat(saved_slices, k)  # the slice each coordinate along the axis must be in
      contiguous = bool(np.all(slice_grid == np.expand_dims(
          blocks, tuple(i for i in range(len(saved.shape)) if i != a))))
      if contiguous:
        # Each saved device's rank among its slice's devices sorted by id.
        order = np.lexsort((ids, of))
        rank = np.empty(len(ids), dtype=np.int64)
        rank[order] = np.arange(len(ids)) - np.repeat(np.cumsum(per_saved) - per_saved, per_saved)
        first = np.take(rank.reshape(saved.shape), range(k), axis=a)  # saved slice 0's block
        now = np.asarray(slices, dtype=np.int64)  # (m, devices per slice)
        out = np.concatenate([now[s][first] for s in range(m)] or [np.take(first, [], axis=a)],
                             axis=a)
        return NewMesh(out.shape, saved.axis_names, tuple(out.reshape(-1).tolist()),
                       (saved.axis_names[a],))

  # Fallback: keep the shape if the device count is unchanged, else scale one axis.
  devices = [d for s in slices for d in s]
  total_saved, total_now = int(np.prod(saved.shape)), len(devices)
  if not total_now or (not saved.shape and total_now != total_saved):
    raise RemapError(f'Cannot lay the saved mesh {dict(zip(saved.axis_names, saved.shape))} '
                     f'over {total_now} devices: it has no axis to resize. Pass a restore target '
                     'with explicit shardings.')
  new_shape = list(saved.shape)
  if total_now == total_saved:
    return NewMesh(tuple(new_shape), saved.axis_names, tuple(devices), ())
  axes = [saved.axis_names.index(x) for x in saved.slice_axes] or list(range(len(saved.shape)))
  for a in axes:
    rest = total_saved // saved.shape[a]
    if total_now % rest == 0:
      new_shape[a] = total_now // rest
      return NewMesh(tuple(new_shape), saved.axis_names, tuple(devices), (saved.axis_names[a],))
  # No single axis can absorb it: each axis (slice axes first) keeps the part of its size that
  # divides what is left of the new count; the first of them takes whatever remains.
  left = total_now
  for a in axes + [i for i in range(len(saved.shape)) if i not in axes]:
    new_shape[a] = math.gcd(saved.shape[a], left)
    left //= new_shape[a]
  new_shape[axes[0]] *= left
  resized = tuple(x for x, was, now in zip(saved.axis_names, saved.shape, new_shape) if was != now)
  return NewMesh(tuple(new_shape), saved.axis_names, tuple(devices), resized, fitted=True)


def fit_spec(spec: Sequence[Any], shape: Sequence[int], mesh_shape: Mapping[str, int],
             resized: Sequence[str]) -> tuple[tuple[Any, ...], list[int]]:
  """Keeps the PartitionSpec, except that a dimension that no longer divides over its axes drops
  the resized axes (it becomes replicated along them). Returns (spec, dims that were changed)."""
  out, changed = [], []
  for dim, entry in enumerate(list(spec) + [None] * (len(shape) - len(spec))):
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    parts = math.prod(mesh_shape[x] for x in axes) if axes else 1
    if axes and shape[dim] % parts:
      kept = tuple(x for x in axes if x not in resized)
      changed.append(dim)
      entry = None if not kept else (kept[0] if len(kept) == 1 else kept)
      if kept and shape[dim] % math.prod(mesh_shape[x] for x in kept):
        entry = None
    out.append(entry)
  while out and out[-1] is None:  # P('x', None) == P('x') as a layout; keep the short form
    out.pop()
  return tuple(out), changed
