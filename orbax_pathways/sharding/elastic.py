"""Elastic restore: lay a checkpoint's saved shardings over the devices this job has now.

Called on the controller (every process in multi-controller JAX) at restore time, by the front
doors: for Orbax's ``metadata`` call (it asks for the saved shardings when a restore has no
target, or a target whose leaves carry no sharding), and for restore args that name no sharding.
A saved sharding is kept when all its devices still exist and the slice count is unchanged;
otherwise the saved mesh is rebuilt over the current slices (``plan/remap.py``), keeping the
PartitionSpecs. Any device count works: what no longer divides is replicated. Each remapping
call logs one INFO line saying which mesh was laid over which and what got replicated.
``remapped_abstract_state`` shows the result before restoring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import warnings
from typing import Any, Sequence

import jax
import numpy as np

from orbax_pathways import errors
from orbax_pathways.sharding import layout
from orbax_pathways.format import records as records_lib
from orbax_pathways._compat import orbax as compat
from orbax_pathways.plan import remap as plan
from orbax_pathways.storage import meta_io

log = logging.getLogger('orbax_pathways')

_lock = threading.Lock()
_override: tuple[tuple[Any, ...] | None, int | None] = (None, None)


@contextlib.contextmanager
def topology(devices: Sequence[Any] | None = None, *, num_slices: int | None = None):
  """Restores inside this block target ``devices`` split into ``num_slices`` equal slices.

  Real jobs do not need it (devices come from ``jax.devices()``, slices from
  ``device.slice_index`` or the process grouping). Tests and platforms that know better use it
  to say "this job now has these slices".
  """
  global _override
  with _lock:
    previous = _override
    _override = (tuple(devices) if devices is not None else None, num_slices)
  try:
    yield
  finally:
    with _lock:
      _override = previous


@dataclasses.dataclass(frozen=True)
class Topology:
  devices: tuple[Any, ...]
  slices: dict[int, list[int]]  # slice -> device ids
  slices_known: bool  # False when nothing says how devices group into slices


def current_topology(num_slices: int | None = None) -> Topology:
  devices, forced = _override
  devices = tuple(devices if devices is not None else jax.devices())
  n = forced or num_slices
  of = layout.slice_of_devices(devices, num_slices=n)
  slices: dict[int, list[int]] = {}
  for d in sorted(devices, key=lambda d: d.id):
    slices.setdefault(of[d.id], []).append(d.id)
  known = bool(n) or jax.process_count() > 1 or all(
      getattr(d, 'slice_index', None) is not None for d in devices)
  return Topology(devices, slices, known)


def _saved_mesh(record: records_lib.ShardingRecord) -> plan.SavedMesh:
  return plan.SavedMesh(record.mesh_shape, record.axis_names, record.device_ids,
                        record.device_slices or (0,) * len(record.device_ids), record.slice_axes)


def _record_from_orbax(sm: Any) -> records_lib.ShardingRecord | None:
  """Our record's fields from Orbax's ``_sharding`` entry (stock checkpoints: one slice)."""
  name = type(sm).__name__
  if name == 'NamedShardingMetadata':
    shape = tuple(int(s) for s in np.asarray(sm.shape).reshape(-1))
    ids = tuple(range(math.prod(shape)))
    if sm.device_mesh is not None:
      ids = tuple(int(d.id) for d in jax.tree.leaves(
          sm.device_mesh.mesh, is_leaf=lambda x: hasattr(x, 'id')))
    return records_lib.ShardingRecord(kind='named', mesh_shape=shape, axis_names=tuple(sm.axis_names),
                                   device_ids=ids, device_slices=(0,) * len(ids),
                                   spec=tuple(sm.partition_spec))
  if name == 'SingleDeviceShardingMetadata':
    return records_lib.ShardingRecord(kind='single_device', device_ids=())
  return None


def needs_remap(record: records_lib.ShardingRecord, topo: Topology) -> bool:
  ids = {d.id for d in topo.devices}
  if any(i not in ids for i in record.device_ids):
    return True
  return record.kind == 'named' and topo.slices_known and len(topo.slices) != record.num_slices


@dataclasses.dataclass
class Laid:
  """What one restore laid where, for its one INFO line (``say``): filled by ``remap_sharding``
  and said by ``remap_value_metadata`` / ``remapped_abstract_state``, on each controller process."""
  meshes: dict[tuple[str, str], list[str]] = dataclasses.field(default_factory=dict)
  replicated: dict[tuple[str, str], list[str]] = dataclasses.field(default_factory=dict)

  def add(self, saved: str, now: str, name: str, replicated: str | None) -> None:
    self.meshes.setdefault((saved, now), []).append(name)
    if replicated:
      self.replicated.setdefault((saved, now), []).append(replicated)

  def say(self, devices: int) -> None:
    parts = []
    for key, names in self.meshes.items():
      reps = self.replicated.get(key, [])
      shown = ', '.join(reps[:5]) + (f' and {len(reps) - 5} more' if len(reps) > 5 else '')
      parts.append(f'saved mesh {key[0]} laid over them as {key[1]}: {len(names) - len(reps)} '
                   f'of {len(names)} arrays keep their PartitionSpec, {len(reps)} are replicated '
                   'along a dim that does not divide' + (f' ({shown})' if reps else ''))
    if parts:
      log.info('orbax_pathways: restoring without target shardings onto %d device(s): %s. '
               'Values are read as saved; pass a target with shardings to choose the layout.',
               devices, '; '.join(parts))


def _mesh_text(shape: Sequence[int], names: Sequence[str]) -> str:
  return f'{dict(zip(names, (int(x) for x in shape)))} ({math.prod(shape)} device(s))'


def remap_sharding(name: str, shape: Sequence[int], dtype: Any, record: records_lib.ShardingRecord,
                   topo: Topology, *, divisibility: str,
                   laid: Laid | None = None) -> jax.sharding.Sharding:
  """The sharding ``name`` gets on ``topo`` (see module docstring for the rule). A dim that no
  longer divides is replicated along the resized axes: with a warning naming it, or, on a device
  count no single axis could absorb, noted in ``laid`` for the caller's one line."""
  by_id = {d.id: d for d in topo.devices}
  if record.kind != 'named':
    first = by_id.get(record.device_ids[0]) if record.device_ids else None
    return jax.sharding.SingleDeviceSharding(first or by_id[topo.slices[min(topo.slices)][0]])
  try:
    new = plan.remap_mesh(_saved_mesh(record), topo.slices)
  except plan.RemapError as e:
    raise errors.TopologyError(f'Array {name!r}: {e}') from None
  mesh = jax.sharding.Mesh(np.asarray([by_id[i] for i in new.device_ids]).reshape(new.shape),
                           new.axis_names)
  sizes = dict(zip(new.axis_names, new.shape))
  spec, changed = plan.fit_spec(record.spec, shape, sizes, new.resized_axes)
  if changed:
    itemsize = np.dtype(dtype).itemsize if dtype is not None else 1
    got = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    per_device = math.prod(got.shard_shape(tuple(shape))) * itemsize
    parts = 1
    for entry in record.spec:
      for axis in ((entry,) if isinstance(entry, str) else tuple(entry or ())):
        parts *= sizes[axis]
    extra = per_device - math.prod(shape) * itemsize // parts
    dims = ', '.join(f'dim {d} (size {shape[d]}) over {record.spec[d]}' for d in changed)
    facts = (f'array {name!r} {tuple(shape)}: {dims} does not divide after resizing mesh axes '
             f'{list(new.resized_axes)} to {[sizes[a] for a in new.resized_axes]}')
    if divisibility == 'strict':
      raise errors.TopologyError(
          f'Cannot restore {facts}. Pass an explicit target sharding for it, or use '
          "Options(divisibility='replicate') to replicate it along those axes.")
    if not new.fitted:
      warnings.warn(
          f'orbax_pathways: {facts}; replicating it along them instead (spec '
          f'{tuple(record.spec)} -> {spec}): {per_device} bytes per device, {extra} more than an '
          'even split would be.', RuntimeWarning, stacklevel=2)
  if laid is not None:
    laid.add(_mesh_text(record.mesh_shape, record.axis_names), _mesh_text(new.shape, new.axis_names),
             name, f'{name!r} {tuple(shape)} dim {", ".join(map(str, changed))}' if changed else None)
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _saved_record(name: str, records: dict[str, records_lib.ArrayRecord],
                  orbax_sharding: Any) -> records_lib.ShardingRecord | None:
  rec = records.get(name)
  if rec is not None and rec.sharding is not None:
    return rec.sharding
  return _record_from_orbax(orbax_sharding) if orbax_sharding is not None else None


def remap_value_metadata(infos: Sequence[Any], metas: list[Any],
                         records: dict[str, records_lib.ArrayRecord], *, num_slices: int | None,
                         divisibility: str) -> list[Any]:
  """Orbax ArrayMetadata with ``sharding`` replaced by the remapped one where needed.

  ``records`` are the item's ``_pathways`` records by array name (empty for a stock checkpoint,
  whose ``_sharding`` entries then say how it was laid out). No I/O.
  """
  if not metas:
    return metas
  topo = current_topology(num_slices)
  laid = Laid()
  out = []
  for info, meta in zip(infos, metas):
    rec = _saved_record(info.name, records, getattr(meta, 'sharding', None))
    if rec is not None and needs_remap(rec, topo):
      with jax.profiler.TraceAnnotation('orbax_pathways.reshard'):
        sharding = remap_sharding(info.name, meta.shape, meta.dtype, rec, topo,
                                  divisibility=divisibility, laid=laid)
      meta = dataclasses.replace(meta, sharding=compat.sharding_metadata_from_jax(sharding))
    out.append(meta)
  laid.say(len(topo.devices))
  return out


def has_sharding(arg: Any) -> bool:
  """Whether restore args name a sharding (``sharding``, or ``mesh`` + ``mesh_axes``)."""
  return getattr(arg, 'sharding', None) is not None or (
      getattr(arg, 'mesh', None) is not None and getattr(arg, 'mesh_axes', None) is not None)


def fill_shardings(args: Sequence[Any], missing: Sequence[int], infos: Sequence[Any],
                   metas: Sequence[Any]) -> list[Any]:
  """``args`` with the (remapped) saved sharding filled in at the indices in ``missing``."""
  filled = list(args)
  for i, meta in zip(missing, metas):
    if meta.sharding is None:
      raise errors.RestoreError(
          f'No sharding for array {infos[i].name!r} at {infos[i].parent_dir}: the restore '
          'target gives none and the checkpoint records none. Pass a target with a sharding.')
    filled[i] = dataclasses.replace(args[i], sharding=meta.sharding)
  return filled


def remapped_abstract_state(directory: Any, step: int, *, item: str = 'default',
                            num_slices: int | None = None, divisibility: str = 'replicate') -> Any:
  """The tree of ``jax.ShapeDtypeStruct`` a no-target restore of ``step`` would produce here.

  Reads metadata only. Use it to inspect (or edit) the layout before
  ``mngr.restore(step, args=ocp.args.StandardRestore(abstract))``.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top

  item_dir = epath.Path(directory) / str(step) / item
  tree = ocp.StandardCheckpointHandler().metadata(item_dir).tree
  ours = meta_io.read_item(item_dir)
  records = ours.arrays() if ours else {}
  topo = current_topology(num_slices)
  laid = Laid()

  def leaf(path, meta):
    if not hasattr(meta, 'sharding') or meta.sharding is None:
      return meta
    name = '.'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)
    found = records.get(name)
    rec = (found.sharding if found is not None and found.sharding
           else _record_from_orbax(meta.sharding))
    if rec is not None and needs_remap(rec, topo):
      sharding = remap_sharding(name, meta.shape, meta.dtype, rec, topo, divisibility=divisibility,
                                laid=laid)
    else:
      sharding = meta.sharding.to_jax_sharding()
    return jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=sharding)

  out = jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=lambda x: hasattr(x, 'sharding'))
  laid.say(len(topo.devices))
  return out
