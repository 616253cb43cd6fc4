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
- Worker (``worker_save``): for each writer host on it, writes the pieces the plan gives that
  host; hosts run concurrently (at most ``MAX_CONCURRENT_HOSTS``).
- Restore: the controller resolves targets and sends each CPU device, as one row of a sharded
  uint8 argument, only the checksums of the chunks that device needs (the call itself carries
  the targets without their chunk index). ``worker_restore`` reads exactly the boxes its devices
  need, verifies them and returns CPU arrays plus its counters; the controller moves them to the
  accelerators with ``device_put`` (again worker-local). A real worker reads once for all its
  devices; in the CPU simulation (the "accelerators" are CPU devices, every one a simulated host)
  each simulated host reads its own boxes, concurrently, bounded like the writes.

On the CPU backend colocated Python runs in this process, so the same code runs in the tests.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import math
import struct
import threading
from typing import Any, Awaitable, Callable, Sequence

import jax
import msgpack
import numpy as np

from orbax_pathways import errors
from orbax_pathways.sharding import layout
from orbax_pathways.format import item as item_lib
from orbax_pathways.format import records as records_lib
from orbax_pathways.transports import values
from orbax_pathways import options as options_lib
from orbax_pathways import version
from orbax_pathways._compat import orbax as compat
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import save as save_plan
from orbax_pathways.storage import meta_io
from orbax_pathways.storage import writer as writer_lib
from orbax_pathways.transports import base
from orbax_pathways.transports import colocated_calls
from orbax_pathways.format import names as format_names
from orbax_pathways.tier import chain as tier_chain
from orbax_pathways.transports import share

worker_key = colocated_calls.worker_key  # 'w<cpu device id>': a worker host's name

NAME = options_lib.TransportName.COLOCATED.value
Box = boxes_lib.Box
# Writer (or, in the CPU simulation, reader) hosts one worker call serves at once: on a real
# worker its own CPU devices; in the CPU simulation every simulated host, so this bounds the
# in-process fan-out.
MAX_CONCURRENT_HOSTS = 16
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


def _sorted_devices(shardings) -> list[Any]:
  return sorted({d for s in shardings for d in s.device_set}, key=lambda d: d.id)


def _simulated(devices: Sequence[Any]) -> bool:
  """The CPU simulation: the "accelerators" are CPU devices, each its own worker host."""
  return all(d.platform == 'cpu' for d in devices)


def _row_sharding(devices: Sequence[Any]) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(jax.sharding.Mesh(np.asarray(devices), ('w',)),
                                    jax.sharding.PartitionSpec('w'))


def _rows_result(devices: Sequence[Any], rows: dict[int, np.ndarray], width: int,
                 dtype) -> jax.Array:
  """A (len(devices), width) array returned to the controller; each worker supplies the rows of
  its own (addressable) devices (zeros for devices it has nothing for)."""
  sharding = _row_sharding(devices)
  shards = []
  mine: set[Any] = sharding.addressable_devices  # of jax.Device: jaxlib ships no types for it
  for d in mine:
    row = np.zeros((1, width), dtype)
    got = rows.get(d.id)
    if got is not None:
      row[0, :len(got)] = got
    shards.append(jax.device_put(row, d))
  return jax.make_array_from_single_device_arrays((len(devices), width), sharding, shards)


def _rows_spec(devices: Sequence[Any], width: int, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((len(devices), width), dtype, sharding=_row_sharding(devices))


def _groups(shardings: Sequence[jax.sharding.Sharding]) -> list[list[int]]:
  """Indices of arrays grouped by device set, in first-seen order (colocated Python needs every
  argument of one call on the same device list)."""
  groups: dict[tuple[int, ...], list[int]] = {}
  for i, sh in enumerate(shardings):
    devices: set[Any] = sh.device_set  # of jax.Device: jaxlib ships no types for it
    groups.setdefault(tuple(sorted(d.id for d in devices)), []).append(i)
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


def plan_for(sharding: jax.sharding.Sharding, leaf: values.SaveLeaf,
             settings: values.PlanSettings) -> save_plan.ArrayWritePlan:
  """The save plan of one leaf over the CPU devices: the controller and every worker call this
  with the same arguments and get the same plan (``share.plan`` is pure and cached)."""
  return share.plan(sharding, leaf, worker_key, settings)


@dataclasses.dataclass(frozen=True)
class WorkerSaveTask:
  """What every worker of one device group receives (pickled into the call): the same for every
  worker and independent of the fleet's size. ``leaves`` carry no shardings (the controller
  records those); ``crc_width`` is the most chunks one CPU device of the group writes."""

  group: int
  item: values.Item
  leaves: tuple[values.SaveLeaf, ...]
  plan: values.PlanSettings
  max_inflight_bytes: int
  crc_width: int
  tier: Any = None  # tier.config.TierConfig: each worker host copies its chunks to its node's tier
  save_id: str = ''  # this save's id (every worker's; the controller's index records it)
  call_id: str = ''  # the call's progress, where the controller waits in this process


def _creates(host: str, plan: save_plan.ArrayWritePlan, local_hosts: Sequence[str]) -> bool:
  """The host of an array's first piece writes its zarr metadata (exactly one per array)."""
  if plan.writes:
    return plan.writes[0].host == host
  return host == local_hosts[0]  # zero-size array: no pieces at all


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


def _crc_row(host: str, plans: Sequence[save_plan.ArrayWritePlan], leaves: Sequence[values.SaveLeaf],
             chunks: dict[str, list[records_lib.ChunkRecord]]) -> np.ndarray:
  """This host's chunk checksums in plan order (``share.host_chunks``), which the controller
  pairs with the origins of its own plan."""
  row = []
  for leaf, plan in zip(leaves, plans):
    by_origin = {c.origin: c.crc32c for c in chunks.get(leaf.name, ())}
    row += [by_origin[b.start] for b in share.host_chunks(plan, host)]
  return np.asarray(row, np.uint32)


def make_worker_save(task: WorkerSaveTask) -> Callable[..., tuple[jax.Array, jax.Array]]:
  """The function shipped to the workers of one device group; its closure is ``task`` only."""

  def worker_save(*cpu_arrays):
    devices = _sorted_devices(a.sharding for a in cpu_arrays)
    plans = [plan_for(a.sharding, leaf, task.plan) for a, leaf in zip(cpu_arrays, task.leaves)]
    local_hosts = sorted({worker_key(s.device) for a in cpu_arrays for s in a.addressable_shards})
    watch = colocated_calls.progress(task.call_id)  # None on a remote worker

    async def one(host: str):
      if watch is not None:
        watch.start(host)
      pieces = _host_pieces(host, cpu_arrays, plans)
      creates = [_creates(host, p, local_hosts) for p in plans]
      if format_names.is_local_only(task.item.directory):  # the bytes to this node's tier only
        outcome, chunks = await share.tier_only_pieces(
            host, task.item, task.leaves, plans, pieces, creates=creates, process_id=host,
            tier=task.tier, save_id=task.save_id)
        if watch is not None:
          watch.finish(host)
        return int(host[1:]), outcome, _crc_row(host, plans, task.leaves, chunks)
      outcome, chunks = await share.write_pieces(
          host, task.item, task.leaves, plans, pieces, creates=creates, process_id=host,
          max_inflight_bytes=task.max_inflight_bytes,
          on_progress=None if watch is None else functools.partial(watch.beat, host))
      if task.tier is not None and task.save_id:  # this worker's node, from the same buffers
        await asyncio.to_thread(share.write_tier, task.tier, task.item, host, task.save_id,
                                task.leaves, plans, pieces, chunks)
      if watch is not None:
        watch.finish(host)
      return int(host[1:]), outcome, _crc_row(host, plans, task.leaves, chunks)

    async def run():
      return await _bounded([one(h) for h in local_hosts], MAX_CONCURRENT_HOSTS)

    done = compat.run_sync(run())
    counts = {dev: np.asarray([o.bytes_written, o.chunks_written], np.int64) for dev, o, _ in done}
    crcs = {dev: row for dev, _, row in done}
    return (_rows_result(devices, counts, 2, np.int64),
            _rows_result(devices, crcs, task.crc_width, np.uint32))

  return worker_save


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


@dataclasses.dataclass(frozen=True)
class WorkerReadTask:
  """What every worker of one device group receives in the call: the item and the targets
  (shardings over the colocated CPU devices, which colocated Python ships as the output specs
  anyway) without their chunk index; each device's checksums come in its row of the payload
  argument. ``per_device_hosts``: the CPU simulation (every device a host)."""

  item: values.Item
  targets: tuple[values.ReadTarget, ...]
  verify: bool
  per_device_hosts: bool
  tier: Any = None  # tier.config.TierConfig: read the worker node's tier first
  # The committed save id: a colocated save gives every worker one id, so one string travels
  # (a per-writer map would grow with the fleet); '' when the index records several (no tier).
  save_id: str = ''
  call_id: str = ''  # the call's progress, where the controller waits in this process


def _needed_chunks(target: values.ReadTarget, box: Box) -> list[records_lib.ChunkRecord]:
  """The recorded chunks a device holding ``box`` of ``target`` reads (all that intersect it)."""
  if not target.chunks or target.chunk_shape is None or box.size == 0:
    return []
  out = []
  for cell in boxes_lib.chunk_grid(box, target.chunk_shape):
    rec = target.chunks.get(cell.start)
    if rec is not None:
      out.append(rec)
  return out


def encode_row(targets: Sequence[values.ReadTarget], boxes: Sequence[Box | None]) -> bytes:
  """One device's payload: per target, the origins (flattened), crc32c and sizes of the chunks it
  reads; a 4-byte length first (rows are padded to one width)."""
  body = []
  for t, box in zip(targets, boxes):
    recs = _needed_chunks(t, box) if box is not None else []
    body.append([[i for r in recs for i in r.origin], [r.crc32c for r in recs],
                 [r.nbytes for r in recs]])
  data = msgpack.packb(body, use_bin_type=True)
  return struct.pack('<I', len(data)) + data


def decode_row(row: np.ndarray, targets: Sequence[values.ReadTarget]) -> list[dict]:
  """Per target, origin -> ChunkRecord, from one device's payload row."""
  raw = row.tobytes()
  (n,) = struct.unpack('<I', raw[:4])
  body = msgpack.unpackb(raw[4:4 + n], raw=False)
  out = []
  for t, (origins, crcs, sizes) in zip(targets, body):
    ndim = len(t.shape)
    out.append({tuple(origins[i * ndim:(i + 1) * ndim]): records_lib.ChunkRecord(
        tuple(origins[i * ndim:(i + 1) * ndim]), c, s) for i, (c, s) in enumerate(zip(crcs, sizes))})
  return out


def payload_rows(targets: Sequence[values.ReadTarget], devices: Sequence[Any]) -> np.ndarray:
  """The (len(devices), width) uint8 payload of one restore call: row i is device i's checksums
  (``encode_row``). Computed on the controller from the targets' chunk index."""
  maps = [layout.device_boxes(t.sharding, t.shape, addressable_only=False) for t in targets]
  rows = [encode_row(targets, [m.get(d) for m in maps]) for d in devices]
  width = max(len(r) for r in rows)
  out = np.zeros((len(devices), width), np.uint8)
  for i, r in enumerate(rows):
    out[i, :len(r)] = np.frombuffer(r, np.uint8)
  return out


class _SharedSource:
  """One source of a worker's node-local tier, shared by every reader of one worker call.

  ``tier/chain.for_restore`` runs once per call (one listing of the node's tier, one manifest
  read per entry), not once per reader: in the CPU simulation every simulated host is a reader
  on the same node, so once per reader meant every entry's manifest read and touched once per
  host (256 hosts: 65,536 of each; the restore's growth in issue 26 item 7). What the source
  holds of an array (``held``: the origins of every entry's chunks of it) is likewise worked
  out once per call and array. Each reader keeps its own ``SourceChain`` over these, so its
  counters stay its own. Everything else is the wrapped source's (``counted_as`` where it has
  one). Only local sources reach a colocated worker (no peers): their ``held`` depends on the
  array (path, name) and its chunk grid only."""

  def __init__(self, source: Any):
    self._source = source
    self.name = source.name
    self._held: dict[tuple, Any] = {}
    self._lock = threading.Lock()  # readers plan on the loop, copies run in executor threads

  def held(self, read: Any):
    key = (read.path, read.name, tuple(read.chunk_shape or ()), tuple(read.plan.global_shape))
    with self._lock:
      if key not in self._held:
        self._held[key] = self._source.held(read)
      return self._held[key]

  def read_chunk(self, read: Any, chunk: Box, dtype: np.dtype) -> np.ndarray:
    return self._source.read_chunk(read, chunk, dtype)

  def __getattr__(self, name: str) -> Any:  # only what this class does not define
    if name.startswith('_'):
      raise AttributeError(name)
    return getattr(self._source, name)


def make_worker_restore(task: WorkerReadTask) -> Callable[[jax.Array], tuple[jax.Array, ...]]:
  """The restore function shipped to workers: reads only their devices' boxes and returns the
  arrays plus its read counters."""

  def worker_restore(payload):
    devices = _sorted_devices([payload.sharding])
    rows = {s.device.id: decode_row(np.asarray(s.data)[0], task.targets)
            for s in payload.addressable_shards}
    mine = [layout.device_boxes(t.sharding, t.shape, addressable_only=True) for t in task.targets]
    local = sorted(payload.sharding.addressable_devices, key=lambda d: d.id)
    # Readers: each local device in the simulation, else this worker as one host.
    readers = [[d] for d in local] if task.per_device_hosts else [local]
    watch = colocated_calls.progress(task.call_id)  # None on a remote worker

    async def read(devs, sources) -> tuple[list[dict[Box, np.ndarray]], Any, Any]:
      host = worker_key(devs[0])
      if watch is not None:
        watch.start(host)
      # Each distinct box is read on its own, with the checksums of the devices that need it:
      # a region merged across boxes could hold chunks no local device needs (and whose
      # checksums this worker was not sent).
      entries, targets, boxes = [], [], []
      for i, (t, m) in enumerate(zip(task.targets, mine)):
        by_box: dict[Box, dict] = {}
        for d in devs:
          if d in m:
            by_box.setdefault(m[d], {}).update(rows[d.id][i])
        for box, chunks in by_box.items():
          entries.append(i)
          targets.append(dataclasses.replace(t, chunks=chunks))
          boxes.append([box])
      chain = (tier_chain.SourceChain(sources, task.item.directory)
               if sources or format_names.is_local_only(task.item.directory) else None)
      buffers, stats = await share.read_share(
          targets, boxes, item=task.item, verify=task.verify, chain=chain,
          on_progress=None if watch is None else functools.partial(watch.beat, host))
      per_target: list[dict[Box, np.ndarray]] = [{} for _ in task.targets]
      for i, bufs in zip(entries, buffers):
        per_target[i].update(bufs)
      if watch is not None:
        watch.finish(host)
      return per_target, stats, chain

    async def run():
      # This node's tier, once per call (see _SharedSource).
      node = (await asyncio.to_thread(tier_chain.for_restore, task.tier, task.item.directory,
                                      task.save_id)
              if task.tier is not None and task.save_id else None)
      sources = [_SharedSource(s) for s in node.sources] if node is not None else []
      done = await _bounded([read(devs, sources) for devs in readers], MAX_CONCURRENT_HOSTS)
      if node is not None:  # one log line per call for what the readers could not use
        node.problems.extend(p for _, _, chain in done if chain is not None
                             for p in chain.problems)
        node.report()
      return done

    done = compat.run_sync(run())
    out = []
    for i, (t, m) in enumerate(zip(task.targets, mine)):
      arrays = []
      for devs, (buffers, _, _) in zip(readers, done):
        arrays += [jax.device_put(buffers[i][m[d]], d) for d in devs if d in m]
      out.append(jax.make_array_from_single_device_arrays(t.shape, t.sharding, arrays))
    counts = {devs[0].id: np.asarray(
        [st.bytes_read, st.chunks_verified + (chain.verified if chain else 0), st.storage_bytes],
        np.int64) for devs, (_, st, chain) in zip(readers, done) if devs}
    return tuple(out) + (_rows_result(devices, counts, 3, np.int64),)

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
    assert cfg is not None, 'a transport that saves is created with save=SaveConfig(...)'
    cpus = cpu_map(_sorted_devices(a.sharding for a in arrays))
    cpu_shardings = [to_cpu_sharding(a.sharding, cpus) for a in arrays]
    with trace('plan'):
      # Planned over the CPU devices: the workers find their sources among the CPU arrays'
      # shards by device id, and a CPU device's id is not its accelerator's under Pathways.
      plans = [plan_for(cs, leaf, cfg.plan) for cs, leaf in zip(cpu_shardings, leaves)]
    with trace('snapshot'):
      cpu_arrays = [jax.device_put(a, cs) for a, cs in zip(arrays, cpu_shardings)]
      jax.block_until_ready(cpu_arrays)  # the snapshot: training may now donate its buffers
    calls = []
    save_id = share.new_save_id()  # one per save: every worker's tier copy and the index carry it
    for g, idx in enumerate(_groups(cpu_shardings)):
      width = max(_chunks_per_host([plans[i] for i in idx]).values(), default=0) or 1
      task = WorkerSaveTask(
          g, item, tuple(dataclasses.replace(leaves[i], sharding=None) for i in idx),
          cfg.plan, cfg.max_inflight_bytes, width, tier=cfg.tier, save_id=save_id,
          call_id=colocated_calls.new_call_id())
      fn = _colocated().colocated_python(make_worker_save(task)).specialize(
          out_specs_fn=lambda *xs, w=width: (
              _rows_spec(_sorted_devices(x.sharding for x in xs), 2, np.int64),
              _rows_spec(_sorted_devices(x.sharding for x in xs), w, np.uint32)))
      calls.append((fn, idx, [cpu_arrays[i] for i in idx], task.call_id))
    return base.Snapshot(
        layouts=[values.LeafLayout.of(leaf, plan) for leaf, plan in zip(leaves, plans)],
        controller_tensor_bytes=0, state=(item, tuple(leaves), plans, calls, save_id))

  async def write(self, snap: base.Snapshot) -> list[values.WriterOutcome]:
    item, leaves, plans, calls, save_id = snap.state
    cfg = self._save
    assert cfg is not None, 'a transport that saves is created with save=SaveConfig(...)'
    outcomes: dict[str, list[int]] = {}
    records: list[records_lib.ArrayRecord] = []
    with trace('write'):
      # Sequential: the groups share each worker's OCDBT database.
      for fn, idx, group_arrays, call_id in calls:
        devices = _sorted_devices(x.sharding for x in group_arrays)
        counts, crcs = await colocated_calls.call_with_deadline(
            functools.partial(colocated_calls.call_and_fetch, fn, group_arrays), devices,
            colocated_calls.call_deadline_s(_max_host_bytes([plans[i] for i in idx],
                                                            [leaves[i] for i in idx]),
                                            cfg.peer_timeout_s),
            f'Colocated save to {item.directory}', call_id, peer_timeout_s=cfg.peer_timeout_s)
        rows = {}
        for d, (nbytes, chunks), row in zip(devices, counts.tolist(), crcs):
          if nbytes or chunks:
            acc = outcomes.setdefault(worker_key(d), [0, 0])
            acc[0] += int(nbytes)
            acc[1] += int(chunks)
          rows[worker_key(d)] = (int(chunks), row)
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
        records_lib.WriterRecord(writer=w, transport=NAME, arrays=(), library_version=version.VERSION,
                              stats={'written_bytes': b, 'chunks': c}, save_id=save_id)
        for w, (b, c) in sorted(outcomes.items()))
    with trace('index'):
      await asyncio.to_thread(meta_io.write_index, item.directory,
                              item_lib.ItemMetadata(writers, tuple(records), source='index'))
    return [values.WriterOutcome(w, b, c) for w, (b, c) in outcomes.items()]

  async def read(self, targets: Sequence[values.ReadTarget],
                 item: values.Item) -> tuple[list[jax.Array], list[values.ReadOutcome]]:
    cfg = self._read
    assert cfg is not None, 'a transport that restores is created with read=ReadConfig(...)'
    accel = _sorted_devices(t.sharding for t in targets)
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
      group_devices = _sorted_devices([full[0].sharding])
      with trace('plan_read'):
        rows = payload_rows(full, group_devices)
      payload_row_bytes.append(int(rows.shape[1]))
      cpu_targets = tuple(dataclasses.replace(t, chunks={}) for t in full)
      call_id = colocated_calls.new_call_id()
      fn = _colocated().colocated_python(
          make_worker_restore(WorkerReadTask(item, cpu_targets, cfg.verify, simulated,
                                             tier=cfg.tier if save_id else None,
                                             save_id=save_id, call_id=call_id))).specialize(
              out_specs_fn=lambda p, ct=cpu_targets, gd=group_devices: tuple(
                  jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=t.sharding) for t in ct)
              + (_rows_spec(gd, 3, np.int64),))
      with trace('read'):
        payload = jax.device_put(rows, _row_sharding(group_devices))
        *arrays, counts = await colocated_calls.call_with_deadline(
            functools.partial(colocated_calls.call_ready, fn, payload), group_devices,
            colocated_calls.call_deadline_s(_max_device_bytes(full), cfg.peer_timeout_s),
            f'Colocated restore from {item.directory}', call_id, peer_timeout_s=cfg.peer_timeout_s)
      with trace('device_put'):
        for i, arr in zip(idx, arrays):
          out[i] = jax.device_put(arr, targets[i].sharding)
      for d, (nbytes, chunks, storage) in zip(group_devices, np.asarray(counts).tolist()):
        if nbytes or chunks:
          acc = outcomes.setdefault(worker_key(d), [0, 0, 0])
          acc[0] += int(nbytes)
          acc[1] += int(chunks)
          acc[2] += int(storage)
    return out, [values.ReadOutcome(w, b, c, bytes_by_source={'storage': st, 'local': b - st})
                 for w, (b, c, st) in outcomes.items()]
