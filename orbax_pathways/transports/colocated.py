"""Colocated transport: the writes and reads run on the hosts that hold the shards.

Under Pathways the controller sees every device as local, but the bytes live on worker hosts.
``jax.experimental.colocated_python`` runs a Python function on the CPU devices colocated with
the accelerators. Who does what:

- Controller (``serialize``): plans (pure), copies each array to its colocated CPU devices with
  ``jax.device_put`` (a worker-local transfer: the snapshot ``save()`` waits for), and in the
  background calls ``_worker_save`` with only metadata in its closure (paths, boxes, specs). It
  gets back one int64 per CPU device (bytes written) and never touches tensor bytes.
- Worker (``_worker_save``): for the shards on its CPU devices, writes the pieces the plan gives
  its host key ``w<cpu device id>``, checksums them, and writes ``_pathways/w<id>.msgpack``.
- Restore (``deserialize``): the controller plans target shardings; ``_worker_restore`` reads on
  each worker exactly the boxes its devices need and returns CPU arrays, which the controller
  moves to the accelerators with ``device_put`` (again worker-local).

On the CPU backend colocated Python runs in this process, so the same code runs in the tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np

from orbax_pathways import layout
from orbax_pathways import stats as stats_lib
from orbax_pathways._compat import orbax as compat
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.storage import meta_io
from orbax_pathways.storage import reader as reader_lib
from orbax_pathways.storage import writer as writer_lib

NAME = 'colocated'
Box = boxes_lib.Box


def _colocated():
  from jax.experimental import colocated_python  # pylint: disable=g-import-not-at-top
  return colocated_python


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


def _bytes_result(arrays: Sequence[jax.Array], per_device: dict[int, int]) -> jax.Array:
  """One int64 per CPU device holding the bytes that device's host wrote (tiny, returned to
  the controller)."""
  devs = sorted({s.device for a in arrays for s in a.addressable_shards}, key=lambda d: d.id)
  mesh = jax.sharding.Mesh(np.asarray(devs), ('w',))
  shards = [jax.device_put(np.asarray([per_device.get(d.id, 0)], np.int64), d) for d in devs]
  return jax.make_array_from_single_device_arrays(
      (len(devs),), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('w')), shards)


def _result_spec(arrays: Sequence[jax.ShapeDtypeStruct]) -> jax.ShapeDtypeStruct:
  devs = sorted({d for a in arrays for d in a.sharding.device_set}, key=lambda d: d.id)
  mesh = jax.sharding.Mesh(np.asarray(devs), ('w',))
  return jax.ShapeDtypeStruct((len(devs),), np.int64,
                              sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('w')))


def make_worker_save(handler, infos, args, plans, ext, group: int):
  """Builds the function shipped to the workers for one device group (colocated Python needs
  every argument on the same device list). Its closure holds only metadata."""
  parent = infos[0].parent_dir

  def worker_save(*cpu_arrays):
    local_hosts = sorted({worker_key(s.device) for a in cpu_arrays for s in a.addressable_shards})
    written: dict[int, int] = {}

    async def run():
      for host in local_hosts:
        pieces = []
        for arr, plan in zip(cpu_arrays, plans):
          shards = {s.device.id: s for s in arr.addressable_shards}
          mine = []
          for w in plan.for_host(host):
            parts = [(src.shard_box, np.asarray(shards[src.device_id].data)) for src in w.sources]
            mine.append(writer_lib.Piece(w.box, writer_lib.gather(w.box, parts)))
          pieces.append(tuple(mine))
        writes, _ = handler.build_writes(
            cpu_arrays, infos, args, plans, pieces, ext, create=False, process_id=host)
        # The host of each array's first piece writes its zarr metadata (exactly one per array).
        writes = [dataclasses.replace(w, create=_creates(host, plan, local_hosts))
                  for w, plan in zip(writes, plans)]
        use_ocdbt = bool(infos[0].is_ocdbt_checkpoint)
        records = await writer_lib.write_arrays(
            writes, context=compat.ts_context(use_ocdbt, handler.options.ts_context_extra()),
            max_inflight_bytes=handler.options.max_inflight_bytes)
        st = stats_lib.SaveStats(transport=NAME)
        st.written_bytes[host] = sum(w.nbytes for w in writes)
        st.chunks_written[host] = sum(len(r) for r in records.values())
        st.written_bytes[f'{host}.g{group}'] = st.written_bytes[host]
        st.chunks_written[f'{host}.g{group}'] = st.chunks_written[host]
        record = handler.writer_record(f'{host}.g{group}', NAME, cpu_arrays, infos, args, plans,
                                       records, with_sharding=_is_first(host, plans), st=st)
        await asyncio.to_thread(meta_io.write_record, parent, record)
        written[int(host[1:])] = st.written_bytes[host]

    compat.run_sync(run())
    return _bytes_result(cpu_arrays, written)

  return worker_save


def _creates(host: str, plan, local_hosts: Sequence[str]) -> bool:
  if plan.writes:
    return plan.writes[0].host == host
  return host == local_hosts[0]  # zero-size array: no pieces at all


def _is_first(host: str, plans) -> bool:
  """The worker writing the first piece of the first array also records the shardings."""
  for plan in plans:
    if plan.writes:
      return plan.writes[0].host == host
  return True


def _groups(shardings: Sequence[jax.sharding.Sharding]) -> list[list[int]]:
  """Indices of arrays grouped by device set, in first-seen order."""
  groups: dict[tuple[int, ...], list[int]] = {}
  for i, sh in enumerate(shardings):
    groups.setdefault(tuple(sorted(d.id for d in sh.device_set)), []).append(i)
  return list(groups.values())


async def serialize(handler, values, infos, args) -> list[Any]:
  """Controller side of a colocated save (see module docstring)."""
  from orbax_pathways import handler as handler_mod  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  args = list(args)
  arrays, ext = handler_mod._physical(values, infos)  # pylint: disable=protected-access
  all_devices = sorted({d for a in arrays for d in a.sharding.device_set}, key=lambda d: d.id)
  cpus = cpu_map(all_devices)
  cpu_shardings = [to_cpu_sharding(a.sharding, cpus) for a in arrays]
  # Planned over the CPU devices: the workers find their sources among the CPU arrays' shards
  # by device id, and a CPU device's id is not its accelerator's under Pathways.
  plans = [handler._plan(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cs), worker_key)  # pylint: disable=protected-access
           for a, cs in zip(arrays, cpu_shardings)]
  with jax.profiler.TraceAnnotation('orbax_pathways.snapshot'):
    cpu_arrays = [jax.device_put(a, cs) for a, cs in zip(arrays, cpu_shardings)]
    jax.block_until_ready(cpu_arrays)  # the snapshot: training may now donate its buffers
  st = stats_lib.SaveStats(transport=NAME, arrays=len(arrays), controller_tensor_bytes=0)
  st.blocking_s = time.perf_counter() - t0
  stats_lib.record_save(st)
  calls = []
  for g, idx in enumerate(_groups([a.sharding for a in arrays])):
    pick = lambda seq: [seq[i] for i in idx]  # noqa: E731
    fn = _colocated().colocated_python(make_worker_save(
        handler, pick(infos), pick(args), pick(plans), ext, g)).specialize(
            out_specs_fn=lambda *xs: _result_spec(xs))
    calls.append((fn, pick(cpu_arrays)))

  async def background():
    await asyncio.gather(*(info.await_path_creation() for info in infos))
    t1 = time.perf_counter()
    for fn, group_arrays in calls:  # sequential: groups share each worker's OCDBT database
      result = await asyncio.to_thread(
          lambda: np.asarray(jax.block_until_ready(fn(*group_arrays))))  # noqa: B023
      devs = sorted({d for a in group_arrays for d in a.sharding.device_set}, key=lambda d: d.id)
      for d, n in zip(devs, result.tolist()):
        if n:
          key = worker_key(d)
          st.written_bytes[key] = st.written_bytes.get(key, 0) + int(n)
    st.write_s = time.perf_counter() - t1
    if handler._array_metadata_store is not None:  # pylint: disable=protected-access
      _, array_mds = handler.build_writes(arrays, infos, args, plans, [()] * len(arrays), ext,
                                          create=False, process_id=None)
      await compat.write_array_metadatas(handler._array_metadata_store, infos[0].parent_dir,  # pylint: disable=protected-access
                                         array_mds, jax.process_index())

  futures = []
  if handler._enable_write_sharding_file:  # pylint: disable=protected-access
    futures.append(compat.CommitFuture(
        compat.serialize_sharding_file([a.sharding for a in arrays], infos,
                                       primary_host=handler._primary_host),  # pylint: disable=protected-access
        name='orbax_pathways_sharding'))
  futures.append(compat.CommitFuture(background(), name='orbax_pathways_colocated_write'))
  return futures


def _counts_result(devices: Sequence[Any], counts: dict[int, tuple[int, int]]) -> jax.Array:
  """(bytes read, chunks verified) per CPU device, as a tiny array returned to the controller."""
  mesh = jax.sharding.Mesh(np.asarray(devices), ('w',))
  shards = [jax.device_put(np.asarray([counts.get(d.id, (0, 0))], np.int64), d) for d in devices]
  return jax.make_array_from_single_device_arrays(
      (len(devices), 2), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('w')), shards)


def _counts_spec(devices: Sequence[Any]) -> jax.ShapeDtypeStruct:
  mesh = jax.sharding.Mesh(np.asarray(devices), ('w',))
  return jax.ShapeDtypeStruct((len(devices), 2), np.int64,
                              sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('w')))


def make_worker_restore(reads_by_array, cpu_targets, verify: bool, context_extra: dict):
  """The restore function shipped to workers: reads only their devices' boxes and returns the
  arrays plus its read counters (attributed to its first CPU device)."""

  def worker_restore():
    async def run():
      out = []
      stats = reader_lib.ReadStats()
      local = sorted({d for _, _, cs in cpu_targets for d in cs.addressable_devices},
                     key=lambda d: d.id)
      for read, (shape, dtype, cpu_sharding) in zip(reads_by_array, cpu_targets):
        mine = layout.device_boxes(cpu_sharding, shape, addressable_only=True)
        plan = reader_lib.restore_plan.plan_array_reads(shape, read.chunk_shape, list(mine.values()))
        rd = reader_lib.ArrayRead(read.name, read.path, read.tspec, plan, read.chunk_shape,
                                  read.chunks, read.target_dtype)
        bufs = await reader_lib.read_array(rd, context=compat.ts_context(True, context_extra),
                                           verify=verify, stats=stats)
        arrays = [jax.device_put(bufs[b], d) for d, b in mine.items()]
        out.append(jax.make_array_from_single_device_arrays(shape, cpu_sharding, arrays))
      counts = {local[0].id: (stats.bytes_read, stats.chunks_verified)} if local else {}
      return tuple(out) + (_counts_result(local, counts),)

    return compat.run_sync(run())

  return worker_restore


def restore(reads, targets, verify: bool, context_extra: dict | None = None,
            st: stats_lib.RestoreStats | None = None) -> list[jax.Array]:
  """Controller side of a colocated restore: returns arrays on the target shardings. One
  colocated call per device group; the controller only sees the returned handles and counts."""
  all_devices = sorted({d for t in targets for d in t[2].device_set}, key=lambda d: d.id)
  cpus = cpu_map(all_devices)
  out: list[Any] = [None] * len(targets)
  for idx in _groups([t[2] for t in targets]):
    cpu_targets = [(targets[i][0], targets[i][1], to_cpu_sharding(targets[i][2], cpus)) for i in idx]
    group_devices = sorted(cpu_targets[0][2].device_set, key=lambda d: d.id)
    fn = _colocated().colocated_python(
        make_worker_restore([reads[i] for i in idx], cpu_targets, verify, context_extra or {})).specialize(
            devices=group_devices,
            out_specs_fn=lambda ct=cpu_targets, gd=group_devices: tuple(
                jax.ShapeDtypeStruct(s, d, sharding=cs) for s, d, cs in ct) + (_counts_spec(gd),))
    *arrays, counts = fn()
    for i, arr in zip(idx, arrays):
      out[i] = jax.device_put(arr, targets[i][2])
    if st is not None:
      for d, (nbytes, chunks) in zip(group_devices, np.asarray(counts).tolist()):
        if nbytes or chunks:
          key = worker_key(d)
          st.bytes_read[key] = st.bytes_read.get(key, 0) + int(nbytes)
          st.chunks_verified += int(chunks)
  return out
