"""Adapters from JAX shardings to the pure plan types (boxes, placements, sharding records).

Called on the controller (or each process) while planning a save or restore. Only this module and
the handler touch ``jax.sharding`` objects; ``plan/`` sees integers.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Sequence

import jax
import numpy as np

from orbax_pathways import metadata
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import save as save_plan

Box = boxes_lib.Box
NUM_SLICES_ENV = 'ORBAX_PATHWAYS_NUM_SLICES'


def device_boxes(sharding: jax.sharding.Sharding, shape: Sequence[int], *,
                 addressable_only: bool) -> dict[Any, Box]:
  if addressable_only:
    index_map = sharding.addressable_devices_indices_map(tuple(shape))
  else:
    index_map = sharding.devices_indices_map(tuple(shape))
  return {d: Box.from_slices(idx, shape) for d, idx in index_map.items()}


def placements(sharding: jax.sharding.Sharding, shape: Sequence[int],
               host_of: Callable[[Any], str]) -> list[save_plan.Placement]:
  """Every device's shard, in device-id order (so 'first holder' is deterministic everywhere)."""
  boxes = device_boxes(sharding, shape, addressable_only=False)
  return [save_plan.Placement(d.id, host_of(d), boxes[d]) for d in sorted(boxes, key=lambda d: d.id)]


@functools.lru_cache(maxsize=4096)
def plan_writes(sharding: jax.sharding.Sharding, shape: tuple[int, ...], itemsize: int,
                host_of: Callable[[Any], str], *, max_chunk_bytes: int, replica_parallel: bool,
                coalesce_bytes: int) -> save_plan.ArrayWritePlan:
  """Who writes which box of an array laid out by ``sharding``, and its chunk grid.

  Called on the controller (every process in multi-controller JAX) at each save. Plans are pure
  functions of these (hashable) inputs; a training loop saves the same layouts every time, so
  each is planned once per process.
  """
  return save_plan.plan_array_writes(
      shape, itemsize, placements(sharding, shape, host_of),
      max_chunk_bytes=max_chunk_bytes, replica_parallel=replica_parallel,
      coalesce_bytes=coalesce_bytes)


def slice_of_devices(devices: Sequence[Any], *, num_slices: int | None = None) -> dict[int, int]:
  """device id -> slice index.

  Sources, in order: ``device.slice_index`` (TPU multislice); an explicit ``num_slices`` (or
  ``ORBAX_PATHWAYS_NUM_SLICES``), splitting devices sorted by id into equal groups (tests, and
  platforms that know their grouping); in multi-controller runs, the owning process; else one slice.
  """
  devices = sorted(devices, key=lambda d: d.id)
  # jax sets slice_index on every device, 0 on non-TPU platforms (CPU/GPU multi-process runs
  # included): it only says something on TPU, or when it actually differs between devices.
  if devices and all(getattr(d, 'slice_index', None) is not None for d in devices) and (
      any(d.platform == 'tpu' for d in devices) or len({d.slice_index for d in devices}) > 1):
    return {d.id: int(d.slice_index) for d in devices}
  n = num_slices or int(os.environ.get(NUM_SLICES_ENV, '0') or 0)
  if n:
    if len(devices) % n:
      raise ValueError(
          f'Cannot split {len(devices)} devices into {n} equal slices ({NUM_SLICES_ENV} or '
          'num_slices). Use a divisor of the device count.'
      )
    per = len(devices) // n
    return {d.id: i // per for i, d in enumerate(devices)}
  if jax.process_count() > 1:
    return {d.id: int(d.process_index) for d in devices}
  return {d.id: 0 for d in devices}


def _spec_entry(p: Any) -> Any:
  if p is None or isinstance(p, str):
    return p
  return tuple(p)


def sharding_record(sharding: jax.sharding.Sharding, *, num_slices: int | None = None) -> metadata.ShardingRecord:
  """What elastic restore needs to rebuild the layout on another topology."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    mesh = sharding.mesh
    devs = np.asarray(mesh.devices)
    slices = slice_of_devices(list(devs.flat), num_slices=num_slices)
    slice_grid = np.vectorize(lambda d: slices[d.id])(devs) if devs.size else devs
    slice_axes = tuple(
        name for axis, name in enumerate(mesh.axis_names)
        if devs.size and np.any(np.diff(slice_grid, axis=axis) != 0)
    )
    return metadata.ShardingRecord(
        kind='named',
        mesh_shape=tuple(int(s) for s in devs.shape),
        axis_names=tuple(str(a) for a in mesh.axis_names),
        device_ids=tuple(int(d.id) for d in devs.flat),
        device_slices=tuple(int(slices[d.id]) for d in devs.flat),
        spec=tuple(_spec_entry(p) for p in sharding.spec),
        slice_axes=slice_axes,
        num_slices=len(set(slices.values())),
    )
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    d = next(iter(sharding.device_set))
    return metadata.ShardingRecord(kind='single_device', device_ids=(int(d.id),))
  return metadata.ShardingRecord(kind='other', device_ids=tuple(sorted(int(d.id) for d in sharding.device_set)))
