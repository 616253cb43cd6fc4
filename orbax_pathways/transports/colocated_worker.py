"""What runs on the worker hosts of a colocated save or restore (``transports/colocated``).

The controller (``ColocatedTransport``, in ``transports/colocated.py``) builds one task per
device group (``WorkerSaveTask``, ``WorkerReadTask``: what every worker receives, independent of
the fleet's size) and ships ``make_worker_save(task)`` / ``make_worker_restore(task)`` to the
workers with colocated Python. On each worker host, those functions plan their own writes with
the same pure planner as the controller (``plan_for``), write or read their own pieces (at most
``MAX_CONCURRENT_HOSTS`` hosts at once: in the CPU simulation every simulated host of this
process) and return one row per CPU device: counters, chunk checksums, restored arrays. The
restore's payload row (``encode_row`` on the controller, ``decode_row`` here) carries each
device's chunk checksums.

On the CPU backend colocated Python runs in this process, so the tests run this same code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import struct
import threading
from typing import Any, Awaitable, Callable, Sequence

import jax
import msgpack
import numpy as np

from orbax_pathways._compat import orbax as compat
from orbax_pathways.format import names as format_names
from orbax_pathways.format import records as records_lib
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import save as save_plan
from orbax_pathways.sharding import layout
from orbax_pathways.storage import writer as writer_lib
from orbax_pathways.fleet import chain as tier_chain
from orbax_pathways.transports import colocated_calls
from orbax_pathways.transports import share
from orbax_pathways.transports import values

worker_key = colocated_calls.worker_key  # 'w<cpu device id>': a worker host's name
Box = boxes_lib.Box
# Writer (or, in the CPU simulation, reader) hosts one worker call serves at once: on a real
# worker its own CPU devices; in the CPU simulation every simulated host, so this bounds the
# in-process fan-out.
MAX_CONCURRENT_HOSTS = 16


def sorted_devices(shardings) -> list[Any]:
  return sorted({d for s in shardings for d in s.device_set}, key=lambda d: d.id)


def row_sharding(devices: Sequence[Any]) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(jax.sharding.Mesh(np.asarray(devices), ('w',)),
                                    jax.sharding.PartitionSpec('w'))


def _rows_result(devices: Sequence[Any], rows: dict[int, np.ndarray], width: int,
                 dtype) -> jax.Array:
  """A (len(devices), width) array returned to the controller; each worker supplies the rows of
  its own (addressable) devices (zeros for devices it has nothing for)."""
  sharding = row_sharding(devices)
  shards = []
  mine: set[Any] = sharding.addressable_devices  # of jax.Device: jaxlib ships no types for it
  for d in mine:
    row = np.zeros((1, width), dtype)
    got = rows.get(d.id)
    if got is not None:
      row[0, :len(got)] = got
    shards.append(jax.device_put(row, d))
  return jax.make_array_from_single_device_arrays((len(devices), width), sharding, shards)


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


# ---- save ---------------------------------------------------------------------------------------


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
    devices = sorted_devices(a.sharding for a in cpu_arrays)
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


# ---- restore ------------------------------------------------------------------------------------


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


class _SharedSource:
  """One source of a worker's node-local tier, shared by every reader of one worker call.

  ``fleet/chain.for_restore`` runs once per call (one listing of the node's tier, one manifest
  read per entry), not once per reader: in the CPU simulation every simulated host is a reader
  on the same node, so once per reader meant every entry's manifest read and touched once per
  host (256 hosts: 65,536 of each: a restore that grew with the fleet). What the source
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
    devices = sorted_devices([payload.sharding])
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
