"""Colocated transport: the writes and reads run on the hosts that hold the shards.

Under Pathways the controller sees every device as local, but the bytes live on worker hosts.
``jax.experimental.colocated_python`` runs a Python function on the CPU devices colocated with
the accelerators. Who does what (call order in ``transports/base.py``):

- Controller, ``snapshot``: plans over the colocated CPU devices (pure), copies each array to them
  with ``jax.device_put`` (a worker-local transfer: the snapshot ``save()`` waits for).
- Controller, ``write`` (Orbax's commit thread): one colocated call per device group, whose
  closure holds only a ``WorkerSaveTask`` (the item, the leaves, the plans). It gets back two
  int64 per CPU device (bytes and chunks written) and never touches tensor bytes.
- Worker (``worker_save``): for each writer host on it (``w<cpu device id>``), writes the pieces
  the plan gives that host and ``_pathways/w<id>.g<group>.msgpack``; hosts run concurrently.
- Restore: the controller resolves targets; ``worker_restore`` reads on each worker exactly the
  boxes its devices need, verifies them and returns CPU arrays plus its counters; the controller
  moves them to the accelerators with ``device_put`` (again worker-local).

On the CPU backend colocated Python runs in this process, so the same code runs in the tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Awaitable, Callable, Sequence

import jax
import numpy as np

from orbax_pathways import layout
from orbax_pathways import values
from orbax_pathways._compat import orbax as compat
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import save as save_plan
from orbax_pathways.storage import writer as writer_lib
from orbax_pathways.transports import base
from orbax_pathways.transports import share

NAME = 'colocated'
Box = boxes_lib.Box
# Writer hosts one worker call serves at once (on a real worker: its own CPU devices; in the
# CPU simulation: every simulated worker, so this bounds the in-process fan-out).
MAX_CONCURRENT_HOSTS = 16


def _colocated():
  from jax.experimental import colocated_python  # pylint: disable=g-import-not-at-top
  return colocated_python


def trace(name: str):
  return jax.profiler.TraceAnnotation(f'orbax_pathways.{name}')


def cpu_map(devices: Sequence[Any]) -> dict[int, Any]:
  """accelerator device id -> its colocated CPU device."""
  devices = list(devices)
  cpus = _colocated().colocated_cpu_devices(devices)
  return {d.id: c for d, c in zip(devices, cpus)}


def worker_key(cpu_device) -> str:
  return f'w{cpu_device.id}'


def to_cpu_sharding(sharding: jax.sharding.Sharding, cpus: dict[int, Any]) -> jax.sharding.Sharding:
  if isinstance(sharding, jax.sharding.NamedSharding):
    mesh = sharding.mesh
    devs = np.vectorize(lambda d: cpus[d.id], otypes=[object])(np.asarray(mesh.devices))
    return jax.sharding.NamedSharding(jax.sharding.Mesh(devs, mesh.axis_names), sharding.spec)
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return jax.sharding.SingleDeviceSharding(cpus[next(iter(sharding.device_set)).id])
  raise ValueError(f'colocated transport: unsupported sharding {sharding!r}; use NamedSharding.')


def _sorted_devices(shardings) -> list[Any]:
  return sorted({d for s in shardings for d in s.device_set}, key=lambda d: d.id)


def _counts_result(devices: Sequence[Any], counts: dict[int, tuple[int, int]]) -> jax.Array:
  """Two int64 per CPU device of the call (e.g. bytes, chunks): a tiny array returned to the
  controller. Each worker supplies the rows of its own (addressable) devices."""
  sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.asarray(devices), ('w',)),
                                        jax.sharding.PartitionSpec('w'))
  shards = [jax.device_put(np.asarray([counts.get(d.id, (0, 0))], np.int64), d)
            for d in sharding.addressable_devices]
  return jax.make_array_from_single_device_arrays((len(devices), 2), sharding, shards)


def _counts_spec(devices: Sequence[Any]) -> jax.ShapeDtypeStruct:
  mesh = jax.sharding.Mesh(np.asarray(devices), ('w',))
  return jax.ShapeDtypeStruct((len(devices), 2), np.int64,
                              sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('w')))


def _groups(shardings: Sequence[jax.sharding.Sharding]) -> list[list[int]]:
  """Indices of arrays grouped by device set, in first-seen order (colocated Python needs every
  argument of one call on the same device list)."""
  groups: dict[tuple[int, ...], list[int]] = {}
  for i, sh in enumerate(shardings):
    groups.setdefault(tuple(sorted(d.id for d in sh.device_set)), []).append(i)
  return list(groups.values())


async def _bounded(coros: Sequence[Awaitable[Any]], limit: int) -> list[Any]:
  """Runs ``coros`` at most ``limit`` at a time; all settle before the first error is raised."""
  sem = asyncio.Semaphore(limit)

  async def one(c):
    async with sem:
      return await c

  done = await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)
  for d in done:
    if isinstance(d, BaseException):
      raise d
  return list(done)


# ---- save --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerSaveTask:
  """Everything a worker needs to write its share of one device group (pickled to workers)."""

  group: int
  item: values.Item
  leaves: tuple[values.SaveLeaf, ...]
  plans: tuple[save_plan.ArrayWritePlan, ...]
  max_inflight_bytes: int


def _creates(host: str, plan: save_plan.ArrayWritePlan, local_hosts: Sequence[str]) -> bool:
  """The host of an array's first piece writes its zarr metadata (exactly one per array)."""
  if plan.writes:
    return plan.writes[0].host == host
  return host == local_hosts[0]  # zero-size array: no pieces at all


def _records_sharding(host: str, plans: Sequence[save_plan.ArrayWritePlan]) -> bool:
  """The host writing the first piece of the first array also records the shardings."""
  for plan in plans:
    if plan.writes:
      return plan.writes[0].host == host
  return True


def _host_pieces(host: str, cpu_arrays: Sequence[jax.Array],
                 plans: Sequence[save_plan.ArrayWritePlan]) -> list[tuple[writer_lib.Piece, ...]]:
  out = []
  for arr, plan in zip(cpu_arrays, plans):
    shards = {s.device.id: s for s in arr.addressable_shards}
    mine = []
    for w in plan.for_host(host):
      parts = [(src.shard_box, np.asarray(shards[src.device_id].data)) for src in w.sources]
      mine.append(writer_lib.Piece(w.box, writer_lib.gather(w.box, parts)))
    out.append(tuple(mine))
  return out


def make_worker_save(task: WorkerSaveTask) -> Callable[..., jax.Array]:
  """The function shipped to the workers of one device group; its closure is ``task`` only."""

  def worker_save(*cpu_arrays):
    devices = _sorted_devices(a.sharding for a in cpu_arrays)
    local_hosts = sorted({worker_key(s.device) for a in cpu_arrays for s in a.addressable_shards})

    async def one(host: str) -> tuple[int, values.WriterOutcome]:
      outcome = await share.write_share(
          f'{host}.g{task.group}', NAME, task.item, task.leaves, task.plans,
          _host_pieces(host, cpu_arrays, task.plans),
          creates=[_creates(host, p, local_hosts) for p in task.plans], process_id=host,
          with_sharding=_records_sharding(host, task.plans),
          max_inflight_bytes=task.max_inflight_bytes)
      return int(host[1:]), outcome

    async def run():
      return await _bounded([one(h) for h in local_hosts], MAX_CONCURRENT_HOSTS)

    done = compat.run_sync(run())
    return _counts_result(devices, {dev: (o.bytes_written, o.chunks_written) for dev, o in done})

  return worker_save


# ---- restore -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerReadTask:
  """Everything a worker needs to read its devices' boxes of one device group (pickled)."""

  item: values.Item
  targets: tuple[values.ReadTarget, ...]  # shardings over the colocated CPU devices
  verify: bool


def make_worker_restore(task: WorkerReadTask) -> Callable[[], tuple[jax.Array, ...]]:
  """The restore function shipped to workers: reads only their devices' boxes and returns the
  arrays plus its read counters (attributed to its first CPU device)."""

  def worker_restore():
    devices = _sorted_devices([t.sharding for t in task.targets])
    local = sorted(task.targets[0].sharding.addressable_devices, key=lambda d: d.id)
    mine = [layout.device_boxes(t.sharding, t.shape, addressable_only=True) for t in task.targets]
    buffers, stats = compat.run_sync(share.read_share(
        task.targets, [list(m.values()) for m in mine], item=task.item, verify=task.verify))
    out = []
    for t, m, bufs in zip(task.targets, mine, buffers):
      arrays = [jax.device_put(bufs[b], d) for d, b in m.items()]
      out.append(jax.make_array_from_single_device_arrays(t.shape, t.sharding, arrays))
    counts = {local[0].id: (stats.bytes_read, stats.chunks_verified)} if local else {}
    return tuple(out) + (_counts_result(devices, counts),)

  return worker_restore


# ---- the transport -----------------------------------------------------------------------------


class ColocatedTransport:
  """Worker hosts move every tensor byte (see the module docstring)."""

  name = NAME
  fallback = None

  def __init__(self, *, save: base.SaveConfig | None = None, read: base.ReadConfig | None = None):
    self._save, self._read = save, read

  def unsupported(self, leaves, item) -> list[str]:
    del leaves, item
    return []

  async def snapshot(self, arrays: Sequence[jax.Array], leaves: Sequence[values.SaveLeaf],
                     item: values.Item, ready: Callable[[], Awaitable[None]]) -> base.Snapshot:
    del ready
    cfg = self._save
    cpus = cpu_map(_sorted_devices(a.sharding for a in arrays))
    cpu_shardings = [to_cpu_sharding(a.sharding, cpus) for a in arrays]
    with trace('plan'):
      # Planned over the CPU devices: the workers find their sources among the CPU arrays'
      # shards by device id, and a CPU device's id is not its accelerator's under Pathways.
      plans = [layout.plan_writes(cs, leaf.shape, np.dtype(leaf.dtype).itemsize, worker_key,
                                  max_chunk_bytes=leaf.max_chunk_bytes,
                                  replica_parallel=cfg.replica_parallel,
                                  coalesce_bytes=cfg.coalesce_bytes)
               for cs, leaf in zip(cpu_shardings, leaves)]
    with trace('snapshot'):
      cpu_arrays = [jax.device_put(a, cs) for a, cs in zip(arrays, cpu_shardings)]
      jax.block_until_ready(cpu_arrays)  # the snapshot: training may now donate its buffers
    calls = []
    for g, idx in enumerate(_groups(cpu_shardings)):
      task = WorkerSaveTask(g, item, tuple(leaves[i] for i in idx), tuple(plans[i] for i in idx),
                            cfg.max_inflight_bytes)
      fn = _colocated().colocated_python(make_worker_save(task)).specialize(
          out_specs_fn=lambda *xs: _counts_spec(_sorted_devices(x.sharding for x in xs)))
      calls.append((fn, [cpu_arrays[i] for i in idx]))
    return base.Snapshot(
        layouts=[values.LeafLayout.of(leaf, plan) for leaf, plan in zip(leaves, plans)],
        controller_tensor_bytes=0, state=calls)

  async def write(self, snap: base.Snapshot) -> list[values.WriterOutcome]:
    outcomes: dict[str, list[int]] = {}
    with trace('write'):
      for fn, group_arrays in snap.state:  # sequential: groups share each worker's OCDBT database
        counts = await asyncio.to_thread(
            lambda f=fn, xs=group_arrays: np.asarray(jax.block_until_ready(f(*xs))))
        devices = _sorted_devices(x.sharding for x in group_arrays)
        for d, (nbytes, chunks) in zip(devices, counts.tolist()):
          if nbytes or chunks:
            acc = outcomes.setdefault(worker_key(d), [0, 0])
            acc[0] += int(nbytes)
            acc[1] += int(chunks)
    return [values.WriterOutcome(w, b, c) for w, (b, c) in outcomes.items()]

  async def read(self, targets: Sequence[values.ReadTarget],
                 item: values.Item) -> tuple[list[jax.Array], list[values.ReadOutcome]]:
    cfg = self._read
    cpus = cpu_map(_sorted_devices(t.sharding for t in targets))
    out: list[Any] = [None] * len(targets)
    outcomes: dict[str, list[int]] = {}
    for idx in _groups([t.sharding for t in targets]):
      cpu_targets = tuple(dataclasses.replace(targets[i], sharding=to_cpu_sharding(targets[i].sharding, cpus))
                          for i in idx)
      group_devices = _sorted_devices([cpu_targets[0].sharding])
      fn = _colocated().colocated_python(
          make_worker_restore(WorkerReadTask(item, cpu_targets, cfg.verify))).specialize(
              devices=group_devices,
              out_specs_fn=lambda ct=cpu_targets, gd=group_devices: tuple(
                  jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=t.sharding) for t in ct)
              + (_counts_spec(gd),))
      with trace('read'):
        *arrays, counts = await asyncio.to_thread(fn)
      with trace('device_put'):
        for i, arr in zip(idx, arrays):
          out[i] = jax.device_put(arr, targets[i].sharding)
      for d, (nbytes, chunks) in zip(group_devices, np.asarray(counts).tolist()):
        if nbytes or chunks:
          acc = outcomes.setdefault(worker_key(d), [0, 0])
          acc[0] += int(nbytes)
          acc[1] += int(chunks)
    return out, [values.ReadOutcome(w, b, c) for w, (b, c) in outcomes.items()]
