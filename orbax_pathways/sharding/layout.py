"""Adapters from JAX shardings to the pure plan types (boxes, placements, sharding records).

Called on the controller (or each process) while planning a save or restore. Only this module and
the handler touch ``jax.sharding`` objects; ``plan/`` sees integers.
"""

from __future__ import annotations

import dataclasses
import functools

from typing import Any, Callable, Sequence

import jax
import numpy as np

from orbax_pathways.format import records as records_lib
from orbax_pathways import options as options_lib
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import save as save_plan
from orbax_pathways.plan import shards as shards_lib

Box = boxes_lib.Box
NUM_SLICES_ENV = 'ORBAX_PATHWAYS_NUM_SLICES'


# ---- NamedSharding arithmetic ----------------------------------------------------------------
# A NamedSharding over an evenly divided shape cuts each dimension into equal parts along its
# mesh axes; the boxes follow from the mesh and the spec alone, the same ones JAX's
# ``devices_indices_map`` lists (tests/plan/test_plan_properties.py checks them against it), without
# a Python object per device, and one computation serves every shape laid out the same way.

def _named_axes(sharding: jax.sharding.Sharding,
                ndim: int) -> tuple[jax.sharding.Mesh, tuple[tuple[str, ...], ...]] | None:
  """(mesh, the mesh axes of each dimension) of a NamedSharding on a concrete mesh whose spec
  is plain mesh axes; else None."""
  if not isinstance(sharding, jax.sharding.NamedSharding) or not isinstance(sharding.mesh,
                                                                            jax.sharding.Mesh):
    return None
  spec = sharding.spec
  if getattr(spec, 'unreduced', None) or getattr(spec, 'reduced', None):
    return None
  axes = shards_lib.spec_axes(spec, ndim)
  return None if axes is None else (sharding.mesh, axes)


@functools.lru_cache(maxsize=256)  # a few layouts per model; each holds an int per device
def _mesh_cells(mesh: jax.sharding.Mesh, axes) -> tuple[tuple[int, ...], np.ndarray] | None:
  return shards_lib.mesh_cells(mesh.devices.shape, mesh.axis_names, axes)


@functools.lru_cache(maxsize=64)
def _mesh_devices(mesh: jax.sharding.Mesh) -> tuple[tuple[Any, ...], np.ndarray]:
  """The mesh's devices row-major, and their ids."""
  devices = tuple(mesh.devices.flat)
  return devices, np.fromiter((d.id for d in devices), dtype=np.int64, count=len(devices))


@functools.lru_cache(maxsize=64)
def _mesh_hosts(mesh: jax.sharding.Mesh, host_of: Callable[[Any], str]):
  """``host_of`` of each device of the mesh, once per mesh: (index per device, host keys)."""
  devices, _ = _mesh_devices(mesh)
  return shards_lib.intern_hosts([host_of(d) for d in devices])


@functools.lru_cache(maxsize=256)
def _mesh_grid(mesh: jax.sharding.Mesh, axes, host_of: Callable[[Any], str]) -> shards_lib.Grid | None:
  cells = _mesh_cells(mesh, axes)
  if cells is None:
    return None
  return shards_lib.grid(*cells, _mesh_devices(mesh)[1], *_mesh_hosts(mesh, host_of))


def device_boxes(sharding: jax.sharding.Sharding, shape: Sequence[int], *,
                 addressable_only: bool) -> dict[Any, Box]:
  """Device -> the box it holds, in JAX's ``devices_indices_map`` order (devices holding the
  same box share one ``Box``)."""
  shape = tuple(int(d) for d in shape)
  named = _named_axes(sharding, len(shape))
  cells = _mesh_cells(*named) if named is not None else None
  if named is None or cells is None or not shards_lib.fits(cells[0], shape):
    if addressable_only:
      index_map = sharding.addressable_devices_indices_map(shape)
    else:
      index_map = sharding.devices_indices_map(shape)
    # jax types the addressable map's values Optional; both maps hold every device's index.
    return {d: Box.from_slices(idx, shape)  # type: ignore[arg-type]
            for d, idx in index_map.items()}
  counts, shard_of = cells
  devices, _ = _mesh_devices(named[0])
  pos = np.arange(len(devices))
  if addressable_only and not sharding.is_fully_addressable:  # jax's order: the mesh's, filtered
    mine = sharding.addressable_devices
    pos = np.asarray([i for i, d in enumerate(devices) if d in mine], dtype=np.int64)
  used, which = np.unique(shard_of[pos], return_inverse=True)
  start = shards_lib.cell_coords(counts)[used] * shards_lib.shard_shape(shape, counts)
  stop = start + shards_lib.shard_shape(shape, counts)
  made = np.empty(len(used), dtype=object)
  made[:] = [Box(tuple(a), tuple(b)) for a, b in zip(start.tolist(), stop.tolist())]
  if len(pos) < len(devices):
    devices = tuple(devices[p] for p in pos.tolist())
  return dict(zip(devices, made[which.reshape(-1)]))


def placements(sharding: jax.sharding.Sharding, shape: Sequence[int],
               host_of: Callable[[Any], str]) -> list[save_plan.Placement]:
  """Every device's shard, in device-id order (so 'first holder' is deterministic everywhere)."""
  boxes = device_boxes(sharding, shape, addressable_only=False)
  return [save_plan.Placement(d.id, host_of(d), boxes[d]) for d in sorted(boxes, key=lambda d: d.id)]


def shard_table(sharding: jax.sharding.Sharding, shape: Sequence[int],
                host_of: Callable[[Any], str]) -> shards_lib.ShardTable:
  """The distinct shards of an array laid out by ``sharding`` and their holders, first holders
  in device-id order. A NamedSharding that divides ``shape`` evenly is pure arithmetic on its
  mesh (cached per mesh, spec and ``host_of``); anything else asks JAX for every device's index."""
  shape = tuple(int(d) for d in shape)
  named = _named_axes(sharding, len(shape))
  grid = _mesh_grid(*named, host_of) if named is not None else None
  if grid is not None and grid.fits(shape):
    return grid.table(shape)
  boxes = device_boxes(sharding, shape, addressable_only=False)
  devices = sorted(boxes, key=lambda d: d.id)
  return shards_lib.from_boxes(shape, [d.id for d in devices], [host_of(d) for d in devices],
                               [boxes[d].start for d in devices], [boxes[d].stop for d in devices])


@functools.lru_cache(maxsize=4096)
def plan_writes(sharding: jax.sharding.Sharding, shape: tuple[int, ...], itemsize: int,
                host_of: Callable[[Any], str], *, max_chunk_bytes: int, replica_parallel: bool,
                coalesce_bytes: int, min_split_bytes: int | None = None,
                max_replicas: int | None = None,
                split_axes: tuple[int, ...] | None = None) -> save_plan.ArrayWritePlan:
  """Who writes which box of an array laid out by ``sharding``, and its chunk grid.

  Called on the controller (every process in multi-controller JAX) at each save. Plans are pure
  functions of these (hashable) inputs; a training loop saves the same layouts every time, so
  each is planned once per process, and arrays sharing a layout share its holder table.
  """
  return save_plan.plan_shards(
      shard_table(sharding, shape, host_of), itemsize, max_chunk_bytes=max_chunk_bytes,
      replica_parallel=replica_parallel, coalesce_bytes=coalesce_bytes,
      min_split_bytes=(1 << 20) if min_split_bytes is None else min_split_bytes,
      max_replicas=max_replicas, split_axes=split_axes)


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
  n = num_slices or (options_lib.num_slices_from_env() or 0)
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



def slice_of_processes(devices: Sequence[Any], *, num_slices: int | None = None) -> dict[int, int]:
  """process index -> the slice of its devices (``slice_of_devices``; the lowest where a
  process's devices span several)."""
  by_device = slice_of_devices(devices, num_slices=num_slices)
  out: dict[int, int] = {}
  for d in devices:
    out[d.process_index] = min(out.get(d.process_index, by_device[d.id]), by_device[d.id])
  return out

def _spec_entry(p: Any) -> Any:
  if p is None or isinstance(p, str):
    return p
  return tuple(p)


def sharding_record(sharding: jax.sharding.Sharding, *, num_slices: int | None = None) -> records_lib.ShardingRecord:
  """What elastic restore needs to rebuild the layout on another topology.

  Written with every save by the primary writer; the mesh part is computed once per mesh (a
  model's arrays share a few meshes of up to tens of thousands of devices).
  """
  if isinstance(sharding, jax.sharding.NamedSharding):
    n = num_slices or (options_lib.num_slices_from_env() or 0)
    mesh_part = _mesh_record(sharding.mesh, n or None, jax.process_count())
    return dataclasses.replace(mesh_part, spec=tuple(_spec_entry(p) for p in sharding.spec))
  devices: set[Any] = sharding.device_set  # of jax.Device: jaxlib ships no types for it
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    d = next(iter(devices))
    return records_lib.ShardingRecord(kind='single_device', device_ids=(int(d.id),))
  return records_lib.ShardingRecord(kind='other', device_ids=tuple(sorted(int(d.id) for d in devices)))


@functools.lru_cache(maxsize=64)
def _mesh_record(mesh: jax.sharding.Mesh, num_slices: int | None,
                 process_count: int) -> records_lib.ShardingRecord:
  """The mesh fields of a 'named' record (``process_count`` keys the cache: the slices of a
  multi-process run without slice information are its processes)."""
  del process_count
  devs = np.asarray(mesh.devices)
  slices = slice_of_devices(list(devs.flat), num_slices=num_slices)
  slice_grid = np.asarray([slices[d.id] for d in devs.flat], dtype=np.int64).reshape(devs.shape)
  slice_axes = tuple(
      name for axis, name in enumerate(mesh.axis_names)
      if devs.size and np.any(np.diff(slice_grid, axis=axis) != 0)
  )
  return records_lib.ShardingRecord(
      kind='named',
      mesh_shape=tuple(int(s) for s in devs.shape),
      axis_names=tuple(str(a) for a in mesh.axis_names),
      device_ids=tuple(int(d.id) for d in devs.flat),
      device_slices=tuple(slice_grid.reshape(-1).tolist()),
      slice_axes=slice_axes,
      num_slices=len(set(slices.values())),
  )
