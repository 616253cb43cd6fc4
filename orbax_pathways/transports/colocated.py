"""Colocated transport: the writes and reads run on the hosts that hold the shards.

Under Pathways the controller sees every device as local, but the bytes live on worker hosts.
``jax.experimental.colocated_python`` runs a Python function on the CPU devices colocated with
the accelerators. Each CPU device is one writer (``w<cpu device id>``). Who does what (call
order in ``transports/base.py``):

- Controller, ``snapshot``: plans over the colocated CPU devices (pure), copies each array to them
  with ``jax.device_put`` (a worker-local transfer: the snapshot ``save()`` waits for).
- Controller, ``write`` (Orbax's commit thread): one colocated call per device group. What the
  call ships to every worker does not grow with the fleet: the item, the leaves (no shardings)
  and a few settings (``WorkerSaveTask``). Each worker derives its own writes from its arguments'
  shardings with the same pure planner. It returns, per CPU device, two int64 (bytes, chunks)
  and the crc32c of each chunk it wrote (uint32, in plan order); no tensor byte reaches the
  controller. The controller then writes the item's ``_pathways/index.msgpack`` itself (the
  origins and sizes come from its own plan): no per-worker records.
- Worker (``worker_save``, in ``transports/colocated_worker.py`` with everything else that runs
  on the workers): for each writer host on it, writes the pieces the plan gives that host; hosts
  run concurrently (at most ``colocated_worker.MAX_CONCURRENT_HOSTS``).
- Restore: the controller resolves targets and sends each CPU device, as one row of a sharded
  uint8 argument, only the checksums of the chunks that device needs (the call itself carries
  the targets without their chunk index). ``worker_restore`` (``colocated_worker``) reads
  exactly the boxes its devices need, verifies them and returns CPU arrays plus its counters;
  the controller moves them to the accelerators with ``device_put`` (again worker-local). A
  real worker reads once for all its devices; in the CPU simulation (the "accelerators" are CPU
  devices, every one a simulated host) each simulated host reads its own boxes, concurrently,
  bounded like the writes.

On the CPU backend colocated Python runs in this process, so the same code runs in the tests.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import math
from typing import Any, Awaitable, Callable, Sequence

import jax
import numpy as np

from orbax_pathways import errors
from orbax_pathways.sharding import layout
from orbax_pathways.format import item as item_lib
from orbax_pathways.format import records as records_lib
from orbax_pathways.transports import values
from orbax_pathways import options as options_lib
from orbax_pathways import version
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import save as save_plan
from orbax_pathways.storage import meta_io
from orbax_pathways.transports import base
from orbax_pathways.transports import colocated_calls
from orbax_pathways.transports import colocated_worker as worker_lib
from orbax_pathways.transports import share


NAME = options_lib.TransportName.COLOCATED.value
Box = boxes_lib.Box
# Largest per-device payload row (bytes) of recent restore calls, newest last: what one worker
# host receives beyond the call itself (benchmarks/fleet.py and the tests read it).
payload_row_bytes: collections.deque[int] = collections.deque(maxlen=64)


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


def to_cpu_sharding(sharding: jax.sharding.Sharding, cpus: dict[int, Any]) -> jax.sharding.Sharding:
  if isinstance(sharding, jax.sharding.NamedSharding):
    mesh = sharding.mesh
    devs = np.vectorize(lambda d: cpus[d.id], otypes=[object])(np.asarray(mesh.devices))
    return jax.sharding.NamedSharding(jax.sharding.Mesh(devs, mesh.axis_names), sharding.spec)
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    device: Any = next(iter(sharding.device_set))  # jax.Device: jaxlib ships no types for it
    return jax.sharding.SingleDeviceSharding(cpus[device.id])
  raise ValueError(f'colocated transport: unsupported sharding {sharding!r}; use NamedSharding.')


def _simulated(devices: Sequence[Any]) -> bool:
  """The CPU simulation: the "accelerators" are CPU devices, each its own worker host."""
  return all(d.platform == 'cpu' for d in devices)


def _rows_spec(devices: Sequence[Any], width: int, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((len(devices), width), dtype,
                              sharding=worker_lib.row_sharding(devices))


def _groups(shardings: Sequence[jax.sharding.Sharding]) -> list[list[int]]:
  """Indices of arrays grouped by device set, in first-seen order (colocated Python needs every
  argument of one call on the same device list)."""
  groups: dict[tuple[int, ...], list[int]] = {}
  for i, sh in enumerate(shardings):
    devices: set[Any] = sh.device_set  # of jax.Device: jaxlib ships no types for it
    groups.setdefault(tuple(sorted(d.id for d in devices)), []).append(i)
  return list(groups.values())


# ---- save --------------------------------------------------------------------------------------


def host_chunk_boxes(plans: Sequence[save_plan.ArrayWritePlan]) -> dict[str, list[list[Box]]]:
  """host -> per plan, the chunks that host writes, in the order its checksums come back."""
  out: dict[str, list[list[Box]]] = {}
  for i, p in enumerate(plans):  # one pass over the writes (for_host per host is quadratic)
    for w in p.writes:
      out.setdefault(w.host, [[] for _ in plans])[i] += share.write_chunks(p, w)
  return dict(sorted(out.items()))


def _max_host_bytes(plans: Sequence[save_plan.ArrayWritePlan],
                    leaves: Sequence[values.SaveLeaf]) -> int:
  """The most bytes one writer host of these plans writes (arithmetic over the writes)."""
  out: collections.Counter[str] = collections.Counter()
  for p, leaf in zip(plans, leaves):
    itemsize = np.dtype(leaf.stored_dtype).itemsize
    for w in p.writes:
      out[w.host] += w.box.size * itemsize
  return max(out.values(), default=0)


def _max_device_bytes(targets: Sequence[values.ReadTarget]) -> int:
  """The most bytes one device of these targets receives."""
  out: collections.Counter[Any] = collections.Counter()
  for t in targets:
    itemsize = np.dtype(t.dtype).itemsize
    for d, box in layout.device_boxes(t.sharding, t.shape, addressable_only=False).items():
      out[d.id] += box.size * itemsize
  return max(out.values(), default=0)


def _chunks_per_host(plans: Sequence[save_plan.ArrayWritePlan]) -> collections.Counter:
  """How many chunks each host writes (arithmetic over the writes: no chunk is enumerated)."""
  out: collections.Counter[str] = collections.Counter()
  for p in plans:
    for w in p.writes:
      if w.box.ndim == 0:
        out[w.host] += 1
      elif w.box.size:
        out[w.host] += math.prod((b - 1) // c - a // c + 1
                                 for a, b, c in zip(w.box.start, w.box.stop, p.chunk_shape))
  return out


def _index_arrays(leaves: Sequence[values.SaveLeaf], plans: Sequence[save_plan.ArrayWritePlan],
                  boxes: dict[str, list[list[Box]]],
                  crcs: dict[str, np.ndarray]) -> list[records_lib.ArrayRecord]:
  """Every chunk of every leaf: origins and sizes from the controller's plan (``boxes``),
  checksums from the workers' rows (``crcs``: host -> its row, in the same order)."""
  chunks: list[list[records_lib.ChunkRecord]] = [[] for _ in leaves]
  for host, per_plan in boxes.items():
    row = crcs[host].tolist()
    k = 0
    for i, (leaf, bs) in enumerate(zip(leaves, per_plan)):
      itemsize = np.dtype(leaf.stored_dtype).itemsize
      chunks[i] += [records_lib.ChunkRecord(b.start, int(c), b.size * itemsize, host)
                    for b, c in zip(bs, row[k:k + len(bs)])]
      k += len(bs)
  return [records_lib.ArrayRecord(
      name=leaf.name, dtype=np.dtype(leaf.stored_dtype).name, shape=tuple(leaf.shape),
      chunk_shape=tuple(plan.chunk_shape), chunks=tuple(sorted(cs, key=lambda c: c.origin)),
      sharding=leaf.sharding) for leaf, plan, cs in zip(leaves, plans, chunks)]


# ---- restore -----------------------------------------------------------------------------------


def payload_rows(targets: Sequence[values.ReadTarget], devices: Sequence[Any]) -> np.ndarray:
  """The (len(devices), width) uint8 payload of one restore call: row i is device i's checksums
  (``encode_row``). Computed on the controller from the targets' chunk index."""
  maps = [layout.device_boxes(t.sharding, t.shape, addressable_only=False) for t in targets]
  rows = [worker_lib.encode_row(targets, [m.get(d) for m in maps]) for d in devices]
  width = max(len(r) for r in rows)
  out = np.zeros((len(devices), width), np.uint8)
  for i, r in enumerate(rows):
    out[i, :len(r)] = np.frombuffer(r, np.uint8)
  return out


# ---- the transport -----------------------------------------------------------------------------


class ColocatedTransport(base.ConfiguredTransport):
  """Worker hosts move every tensor byte (see the module docstring)."""

  name = NAME

  async def snapshot(self, arrays: Sequence[jax.Array], leaves: Sequence[values.SaveLeaf],
                     item: values.Item, ready: Callable[[], Awaitable[None]]) -> base.Snapshot:
    del ready
    cfg = self.save_config()
    cpus = cpu_map(worker_lib.sorted_devices(a.sharding for a in arrays))
    cpu_shardings = [to_cpu_sharding(a.sharding, cpus) for a in arrays]
    with trace('plan'):
      # Planned over the CPU devices: the workers find their sources among the CPU arrays'
      # shards by device id, and a CPU device's id is not its accelerator's under Pathways.
      plans = [worker_lib.plan_for(cs, leaf, cfg.plan) for cs, leaf in zip(cpu_shardings, leaves)]
    with trace('snapshot'):
      cpu_arrays = [jax.device_put(a, cs) for a, cs in zip(arrays, cpu_shardings)]
      jax.block_until_ready(cpu_arrays)  # the snapshot: training may now donate its buffers
    calls = []
    save_id = share.new_save_id()  # one per save: every worker's tier copy and the index carry it
    for g, idx in enumerate(_groups(cpu_shardings)):
      width = max(_chunks_per_host([plans[i] for i in idx]).values(), default=0) or 1
      task = worker_lib.WorkerSaveTask(
          g, item, tuple(dataclasses.replace(leaves[i], sharding=None) for i in idx),
          cfg.plan, cfg.max_inflight_bytes, width, tier=cfg.tier, save_id=save_id,
          call_id=colocated_calls.new_call_id())
      fn = _colocated().colocated_python(worker_lib.make_worker_save(task)).specialize(
          out_specs_fn=lambda *xs, w=width: (
              _rows_spec(worker_lib.sorted_devices(x.sharding for x in xs), 2, np.int64),
              _rows_spec(worker_lib.sorted_devices(x.sharding for x in xs), w, np.uint32)))
      calls.append((fn, idx, [cpu_arrays[i] for i in idx], task.call_id))
    return base.Snapshot(
        layouts=[values.LeafLayout.of(leaf, plan) for leaf, plan in zip(leaves, plans)],
        controller_tensor_bytes=0, state=(item, tuple(leaves), plans, calls, save_id))

  async def write(self, snap: base.Snapshot) -> list[values.WriterOutcome]:
    item, leaves, plans, calls, save_id = snap.state
    cfg = self.save_config()
    outcomes: dict[str, list[int]] = {}
    records: list[records_lib.ArrayRecord] = []
    with trace('write'):
      # Sequential: the groups share each worker's OCDBT database.
      for fn, idx, group_arrays, call_id in calls:
        devices = worker_lib.sorted_devices(x.sharding for x in group_arrays)
        counts, crcs = await colocated_calls.call_with_deadline(
            functools.partial(colocated_calls.call_and_fetch, fn, group_arrays), devices,
            colocated_calls.call_deadline_s(_max_host_bytes([plans[i] for i in idx],
                                                            [leaves[i] for i in idx]),
                                            cfg.peer_timeout_s),
            f'Colocated save to {item.directory}', call_id, peer_timeout_s=cfg.peer_timeout_s)
        rows = {}
        for d, (nbytes, chunks), row in zip(devices, counts.tolist(), crcs):
          if nbytes or chunks:
            acc = outcomes.setdefault(worker_lib.worker_key(d), [0, 0])
            acc[0] += int(nbytes)
            acc[1] += int(chunks)
          rows[worker_lib.worker_key(d)] = (int(chunks), row)
        boxes = host_chunk_boxes([plans[i] for i in idx])
        wrong = {h: (sum(map(len, bs)), rows.get(h, (0,))[0]) for h, bs in boxes.items()
                 if sum(map(len, bs)) != rows.get(h, (0,))[0]}
        if wrong:
          raise errors.SaveError(
              f'Colocated save to {item.directory}: workers wrote other chunks than the '
              f'controller planned (host: (planned, written)) {dict(sorted(wrong.items())[:8])}. '
              'The step is not committed. Check that every worker runs the same orbax-pathways '
              f'version as the controller ({version.VERSION}).')
        records += _index_arrays([leaves[i] for i in idx], [plans[i] for i in idx], boxes,
                                 {h: row for h, (_, row) in rows.items()})
    writers = tuple(
        records_lib.writer_record(w, NAME, written_bytes=b, chunks=c, save_id=save_id)
        for w, (b, c) in sorted(outcomes.items()))
    with trace('index'):
      await asyncio.to_thread(meta_io.write_index, item.directory,
                              item_lib.ItemMetadata(writers, tuple(records), source='index'))
    return [values.WriterOutcome(w, b, c) for w, (b, c) in outcomes.items()]

  async def read(self, targets: Sequence[values.ReadTarget],
                 item: values.Item) -> tuple[list[jax.Array], list[values.ReadOutcome]]:
    cfg = self.read_config()
    accel = worker_lib.sorted_devices(t.sharding for t in targets)
    cpus = cpu_map(accel)
    simulated = _simulated(accel)
    out: list[Any] = [None] * len(targets)
    outcomes: dict[str, list[int]] = {}
    committed = meta_io.cached_index(item.directory) if cfg.tier is not None else None
    ids = {w.save_id for w in committed.writers if w.save_id} if committed is not None else set()
    save_id = next(iter(ids)) if len(ids) == 1 else ''
    for idx in _groups([t.sharding for t in targets]):
      full = [dataclasses.replace(targets[i], sharding=to_cpu_sharding(targets[i].sharding, cpus))
              for i in idx]
      group_devices = worker_lib.sorted_devices([full[0].sharding])
      with trace('plan_read'):
        rows = payload_rows(full, group_devices)
      payload_row_bytes.append(int(rows.shape[1]))
      cpu_targets = tuple(dataclasses.replace(t, chunks={}) for t in full)
      call_id = colocated_calls.new_call_id()
      fn = _colocated().colocated_python(
          worker_lib.make_worker_restore(worker_lib.WorkerReadTask(
              item, cpu_targets, cfg.verify, simulated, tier=cfg.tier if save_id else None,
              save_id=save_id, call_id=call_id))).specialize(
              out_specs_fn=lambda p, ct=cpu_targets, gd=group_devices: tuple(
                  jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=t.sharding) for t in ct)
              + (_rows_spec(gd, 3, np.int64),))
      with trace('read'):
        payload = jax.device_put(rows, worker_lib.row_sharding(group_devices))
        *arrays, counts = await colocated_calls.call_with_deadline(
            functools.partial(colocated_calls.call_ready, fn, payload), group_devices,
            colocated_calls.call_deadline_s(_max_device_bytes(full), cfg.peer_timeout_s),
            f'Colocated restore from {item.directory}', call_id, peer_timeout_s=cfg.peer_timeout_s)
      with trace('device_put'):
        for i, arr in zip(idx, arrays):
          out[i] = jax.device_put(arr, targets[i].sharding)
      for d, (nbytes, chunks, storage) in zip(group_devices, np.asarray(counts).tolist()):
        if nbytes or chunks:
          acc = outcomes.setdefault(worker_lib.worker_key(d), [0, 0, 0])
          acc[0] += int(nbytes)
          acc[1] += int(chunks)
          acc[2] += int(storage)
    return out, [values.ReadOutcome(w, b, c, bytes_by_source={'storage': st, 'local': b - st})
                 for w, (b, c, st) in outcomes.items()]
