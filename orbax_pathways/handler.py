"""ProxyArrayHandler: Orbax's TypeHandler for ``jax.Array``, with host-local shard I/O.

Who calls what, on which host:
1. Orbax's PyTree handler calls ``serialize`` on every controller process (one under Pathways)
   inside ``CheckpointManager.save``. We plan (pure, identical on every process), snapshot the
   pieces this host writes to host memory (the only blocking part), and return commit futures.
2. Orbax's background commit thread runs those futures: each writer host writes its pieces with
   tensorstore into Orbax's own layout (``ocdbt.process_<id>`` or per-array zarr), checksums
   every chunk, and writes ``_pathways/<writer>.msgpack``. Orbax then merges OCDBT and commits
   (rename, or ``commit_success.txt`` on object stores).
3. ``deserialize`` runs on every controller process at restore: it finds the boxes this host's
   devices need, reads each needed chunk once, verifies it, and assembles ``jax.Array``s.
4. ``metadata`` (used by a restore without a target) reports the saved shardings remapped onto
   the current devices, which is what makes ``restore(step)`` work on another slice count.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import math
import time
from typing import Any, Sequence

import jax
import numpy as np

from orbax_pathways import elastic
from orbax_pathways import errors
from orbax_pathways import layout
from orbax_pathways import metadata
from orbax_pathways import options as options_lib
from orbax_pathways import runtime
from orbax_pathways import stats as stats_lib
from orbax_pathways import version
from orbax_pathways._compat import orbax as compat
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import restore as restore_plan
from orbax_pathways.plan import save as save_plan
from orbax_pathways.storage import meta_io
from orbax_pathways.storage import reader as reader_lib
from orbax_pathways.storage import writer as writer_lib
from orbax_pathways.transports import local

log = logging.getLogger('orbax_pathways')
Box = boxes_lib.Box


def _trace(name: str):
  return jax.profiler.TraceAnnotation(f'orbax_pathways.{name}')


def _physical(values: Sequence[jax.Array], infos) -> tuple[list[jax.Array], dict[str, dict]]:
  """PRNG keys are stored as their key data, with the key implementation in ext_metadata."""
  arrays, ext = [], {}
  for v, info in zip(values, infos):
    if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
      arrays.append(jax.random.key_data(v))
      ext[info.name] = {compat.random_key_impl_field(): str(jax.random.key_impl(v))}
    else:
      arrays.append(v)
  return arrays, ext


def _check_global(values: Sequence[jax.Array], infos) -> None:
  if jax.process_count() <= 1:
    return
  for v, info in zip(values, infos):
    if v.is_fully_addressable:
      raise errors.SaveError(
          f'Array {info.name!r} (shape {v.shape}, sharding {v.sharding}) lives on one process '
          'only, but this is a multi-process run: every process must hold a shard of a global '
          'array. Build it with jax.make_array_from_process_local_data or '
          'multihost_utils.host_local_array_to_global_array before saving.'
      )


@functools.lru_cache(maxsize=4096)
def _cached_read_plan(shape, chunk_shape, needed):
  """Read plans are pure too, and a job restores the same layouts again and again."""
  return restore_plan.plan_array_reads(shape, chunk_shape, list(needed))


def stored_dtype(arr, arg) -> np.dtype:
  """The dtype written to storage: ``SaveArgs.dtype`` when casting, else the array's."""
  return np.dtype(arg.dtype) if arg.dtype is not None else np.dtype(arr.dtype)


class ProxyArrayHandler(compat.ArrayHandler):
  """Drop-in replacement of Orbax's ArrayHandler (same typestr, same on-disk format)."""

  def __init__(self, *, options: options_lib.Options | None = None, **kwargs):
    kwargs.setdefault('array_metadata_store', compat.array_metadata_store())
    super().__init__(**kwargs)
    self.options = options or options_lib.Options.from_env()

  # ---- save --------------------------------------------------------------------------------

  def _plan(self, arr: jax.Array, host_of, *, coalesce: bool = True) -> save_plan.ArrayWritePlan:
    """``coalesce=False`` for transports that write whole shards themselves (persistence)."""
    return layout.plan_writes(arr.sharding, tuple(arr.shape), np.dtype(arr.dtype).itemsize, host_of,
                              max_chunk_bytes=self.options.max_chunk_bytes,
                              replica_parallel=self.options.replica_parallel and self._use_replica_parallel,
                              coalesce_bytes=self.options.coalesce_bytes if coalesce else 0)

  async def serialize(self, values: Sequence[jax.Array], infos: Sequence[Any],
                      args: Sequence[Any] | None = None) -> list[Any]:
    t0 = time.perf_counter()
    args = list(args or [compat.SaveArgs()] * len(values))
    _check_global(values, infos)
    transport = runtime.choose_transport(requested=self.options.transport)
    if transport is not runtime.Transport.LOCAL:
      from orbax_pathways.transports import dispatch  # pylint: disable=g-import-not-at-top
      return await dispatch.serialize(self, transport, values, infos, args)
    arrays, ext = _physical(values, infos)
    host = local.this_host()
    with _trace('plan'):
      plans = [self._plan(a, local.host_of) for a in arrays]
    pinned = local.use_pinned(arrays, self.options.snapshot)
    with _trace('snapshot'):
      pieces = local.snapshot(arrays, plans, host, pinned=pinned)
    st = stats_lib.SaveStats(transport=local.NAME, arrays=len(arrays),
                             snapshot='pinned' if pinned else 'host')
    st.d2h_bytes[host] = sum(p.data.nbytes for ps in pieces for p in ps)
    # Under Pathways the controller is a process too; with the local transport every byte it
    # snapshots passes through it. Process 0 of a multi-controller run only moves its own share.
    st.controller_tensor_bytes = st.d2h_bytes[host] if jax.process_index() == 0 else 0
    st.blocking_s = time.perf_counter() - t0
    stats_lib.record_save(st)

    futures = []
    if self._enable_write_sharding_file:
      sharding_infos = infos
      if self.options.ts_context_extra():  # storage_retries must bound Orbax's _sharding write too
        ctx = self.ts_context(infos[0], bool(infos[0].is_ocdbt_checkpoint))
        sharding_infos = [copy.copy(i) for i in infos]  # ParamInfo is a plain class
        for i in sharding_infos:
          i.ts_context = ctx
      futures.append(compat.CommitFuture(
          compat.serialize_sharding_file([a.sharding for a in arrays], sharding_infos,
                                         primary_host=self._primary_host),
          name='orbax_pathways_sharding'))
    futures.append(compat.CommitFuture(
        self._write_background(arrays, infos, args, plans, pieces, ext, host, st),
        name='orbax_pathways_write'))
    return futures

  def ts_context(self, info, use_ocdbt: bool):
    """Orbax's context for this item, unless our options add resources (retries)."""
    extra = self.options.ts_context_extra()
    if extra:
      return compat.ts_context(use_ocdbt, extra)
    return info.ts_context or compat.ts_context(use_ocdbt)

  def _is_primary(self) -> bool:
    return self._primary_host is None or jax.process_index() == self._primary_host

  def build_writes(self, arrays, infos, args, plans, pieces, ext, *, create: bool,
                   process_id: int | str | None) -> tuple[list[writer_lib.ArrayWrite], list[Any]]:
    """Tensorstore specs for this host's pieces (pure apart from Orbax's spec builder)."""
    writes, array_mds = [], []
    for arr, info, arg, plan, ps in zip(arrays, infos, args, plans, pieces):
      write_shape = plan.writes[0].box.shape if plan.writes else arr.shape
      stored = stored_dtype(arr, arg)
      tspec, array_md = compat.build_write_spec(
          info, global_shape=arr.shape, write_shape=write_shape, chunk_shape=plan.chunk_shape,
          dtype=arr.dtype, target_dtype=arg.dtype, process_id=process_id,
          ext_metadata=ext.get(info.name),
          use_compression=self.options.compress(stored, bool(info.use_compression)),
          gcs_grpc=self.options.gcs_grpc)
      writes.append(writer_lib.ArrayWrite(
          name=info.name, path=str(info.parent_dir / info.name), tspec=tspec, create=create,
          global_shape=tuple(arr.shape), chunk_shape=plan.chunk_shape, stored_dtype=stored,
          pieces=ps))
      array_mds.append(array_md)
    return writes, array_mds

  def writer_record(self, writer: str, transport: str, arrays, infos, args, plans,
                    records: dict[str, list[metadata.ChunkRecord]], *, with_sharding: bool,
                    st: stats_lib.SaveStats) -> metadata.WriterRecord:
    out = []
    for arr, info, arg, plan in zip(arrays, infos, args, plans):
      dtype = stored_dtype(arr, arg)
      out.append(metadata.ArrayRecord(
          name=info.name, dtype=dtype.name, shape=tuple(arr.shape), chunk_shape=plan.chunk_shape,
          chunks=tuple(records.get(info.name, ())),
          sharding=layout.sharding_record(arr.sharding, num_slices=self.options.num_slices)
          if with_sharding else None))
    return metadata.WriterRecord(
        writer=writer, transport=transport, arrays=tuple(out), library_version=version.VERSION,
        stats={'written_bytes': st.written_bytes.get(writer, 0),
               'chunks': st.chunks_written.get(writer, 0)})

  async def _write_background(self, arrays, infos, args, plans, pieces, ext, host: str,
                              st: stats_lib.SaveStats) -> None:
    await asyncio.gather(*(info.await_path_creation() for info in infos))
    t0 = time.perf_counter()
    with _trace('write'):
      use_ocdbt = bool(infos[0].is_ocdbt_checkpoint)
      writes, array_mds = self.build_writes(
          arrays, infos, args, plans, pieces, ext, create=self._is_primary(),
          process_id=compat.ocdbt_subdir_process_id(use_ocdbt))
      parent = infos[0].parent_dir
      coros = [writer_lib.write_arrays(writes, context=self.ts_context(infos[0], use_ocdbt),
                                       max_inflight_bytes=self.options.max_inflight_bytes)]
      if self._array_metadata_store is not None:  # independent of the data: written alongside
        coros.append(compat.write_array_metadatas(self._array_metadata_store, parent, array_mds,
                                                  jax.process_index()))
      done = await asyncio.gather(*coros, return_exceptions=True)  # all settle, then raise
      for r in done:
        if isinstance(r, BaseException):
          raise r
      records = done[0]
      st.written_bytes[host] = sum(w.nbytes for w in writes)
      st.chunks_written[host] = sum(len(r) for r in records.values())
      record = self.writer_record(host, local.NAME, arrays, infos, args, plans, records,
                                  with_sharding=self._is_primary(), st=st)
      await asyncio.to_thread(meta_io.write_record, parent, record)
      st.storage_requests += len(coros)  # our record, plus Orbax's array metadata file if any
    st.write_s = time.perf_counter() - t0
    total = st.total_written
    log.info('orbax_pathways: saved %d arrays, %.1f MiB from %s (%s, %s snapshot), save() '
             'blocked %.0f ms, write %.2f s (%.2f GB/s) to %s', st.arrays, total / 2**20, host,
             st.transport, st.snapshot, st.blocking_s * 1e3, st.write_s,
             total / max(st.write_s, 1e-9) / 1e9, parent)

  # ---- restore -----------------------------------------------------------------------------

  async def metadata(self, infos: Sequence[Any]) -> Sequence[Any]:
    """Orbax's metadata, with shardings remapped onto the current devices where needed."""
    metas = list(await super().metadata(infos))
    return await elastic.remap_value_metadata(self, infos, metas)

  def _delegate(self, args) -> bool:
    return self._dispatcher is not None or any(
        not isinstance(a, compat.ArrayRestoreArgs) or not getattr(a, 'strict', True) for a in args)

  async def deserialize(self, infos: Sequence[Any], args: Sequence[Any] | None = None) -> Sequence[jax.Array]:
    if args is None:
      raise ValueError('Must provide ArrayRestoreArgs to restore as jax.Array.')
    await asyncio.gather(*(info.await_path_creation() for info in infos))
    if self._delegate(args):
      return await super().deserialize(infos, args)
    t0 = time.perf_counter()
    args = list(args)
    shardings = await elastic.restore_shardings(self, infos, args)
    parent = infos[0].parent_dir
    item_md = await asyncio.to_thread(meta_io.read_item, parent)
    records = item_md.arrays() if item_md else {}
    use_ocdbt = bool(infos[0].is_ocdbt_checkpoint)
    context = self.ts_context(infos[0], use_ocdbt)
    host = local.this_host()
    st = stats_lib.RestoreStats(transport=local.NAME, arrays=len(infos))
    reads, targets = [], []
    with _trace('plan_read'):
      for info, arg, sharding in zip(infos, args, shardings):
        read, target = await self._plan_read(info, arg, sharding, records.get(info.name),
                                             use_ocdbt, context)
        reads.append(read)
        targets.append(target)
    rstats = reader_lib.ReadStats()
    transport = runtime.choose_transport(requested=self.options.transport)
    if transport in (runtime.Transport.COLOCATED, runtime.Transport.PERSISTENCE):
      # Persistence restores read on the workers too (transports/persistence.py).
      from orbax_pathways.transports import colocated  # pylint: disable=g-import-not-at-top
      st.transport = colocated.NAME
      with _trace('read'):
        out = await asyncio.to_thread(colocated.restore, reads, targets,
                                      self.options.verify_checksums,
                                      self.options.ts_context_extra(), st)
    else:
      with _trace('read'):
        buffers = await asyncio.gather(*(
            reader_lib.read_array(r, context=context, verify=self.options.verify_checksums,
                                  stats=rstats) for r in reads))
      with _trace('device_put'):
        out = self._assemble(targets, buffers)
      st.bytes_read[host] = rstats.bytes_read
      st.bytes_needed[host] = sum(
          b.size * np.dtype(t[1]).itemsize for t in targets for b in set(t[3].values()))
      st.chunks_verified = rstats.chunks_verified
    if self._array_metadata_store is not None:
      mds = await compat.read_array_metadatas(self._array_metadata_store, parent)
      if mds:
        out = list(compat.wrap_random_keys(mds, infos, out))
    st.read_s = time.perf_counter() - t0
    stats_lib.record_restore(st)
    log.info('orbax_pathways: restored %d arrays, read %.1f MiB (%s, %s) in %.2f s, %d chunks '
             'verified, from %s', len(out), sum(st.bytes_read.values()) / 2**20, st.transport,
             ', '.join(sorted(st.bytes_read)), st.read_s, st.chunks_verified, parent)
    return out

  async def _plan_read(self, info, arg, sharding, record: metadata.ArrayRecord | None,
                       use_ocdbt: bool, context):
    shape, dtype, sharding = compat.physical_read_spec(arg, sharding)
    tspec = compat.build_read_spec(info, use_ocdbt=use_ocdbt, gcs_grpc=self.options.gcs_grpc)
    if record is not None:
      stored_shape, chunk_shape = record.shape, record.chunk_shape
      chunks = metadata.chunk_index([record])
    else:  # A checkpoint without our metadata (stock Orbax): ask tensorstore for the layout.
      import tensorstore as ts  # pylint: disable=g-import-not-at-top
      try:
        t = await ts.open(ts.Spec(tspec), open=True, context=context)
      except Exception as e:
        raise errors.RestoreError(
            f'Cannot open array {info.name!r} at {info.parent_dir / info.name}: '
            f'{type(e).__name__}: {e}. Check the step is complete (`orbax-pathways ls`).') from e
      stored_shape = tuple(t.shape)
      chunk_shape = tuple(t.chunk_layout.read_chunk.shape or ()) or None
      chunks = {}
      dtype = dtype if dtype is not None else t.dtype.numpy_dtype
    shape = tuple(shape) if shape is not None else tuple(stored_shape)
    if shape != tuple(stored_shape):
      raise errors.RestoreError(
          f'Array {info.name!r} at {info.parent_dir / info.name} was saved with shape '
          f'{tuple(stored_shape)} but the restore target asks for {shape}. Restore with the '
          'saved shape, or pass ArrayRestoreArgs(strict=False) to pad or truncate.')
    if dtype is None:
      dtype = np.dtype(record.dtype)
    boxes = layout.device_boxes(sharding, shape, addressable_only=True)
    needed = list(boxes.values())
    if _whole_put(shape, dtype, sharding, boxes):
      needed.append(Box.full(shape))  # read as one region; _assemble puts it in one call
    plan = _cached_read_plan(shape, tuple(chunk_shape) if chunk_shape else None, tuple(needed))
    read = reader_lib.ArrayRead(
        name=info.name, path=str(info.parent_dir / info.name), tspec=tspec, plan=plan,
        chunk_shape=chunk_shape, chunks=chunks, target_dtype=np.dtype(dtype))
    return read, (shape, np.dtype(dtype), sharding, boxes)

  @staticmethod
  def _assemble(targets, buffers: Sequence[dict[Box, np.ndarray]]) -> list[jax.Array]:
    """All arrays onto their devices with one batched ``jax.device_put``: small arrays whole
    (``jax.device_put`` slices them per device itself), others shard by shard (aligned
    buffers, which the CPU backend aliases instead of copying)."""
    values, dests, layout_of = [], [], []
    for (shape, dtype, sharding, boxes), bufs in zip(targets, buffers):
      whole = bufs.get(Box.full(shape)) if _whole_put(shape, dtype, sharding, boxes) else None
      if whole is not None:
        values.append(whole)
        dests.append(sharding)
      else:
        values += [bufs[box] for box in boxes.values()]
        dests += list(boxes)
      layout_of.append(whole is not None)
    placed = iter(jax.device_put(values, dests) if values else [])
    out = []
    for (shape, dtype, sharding, boxes), whole in zip(targets, layout_of):
      if whole:
        out.append(next(placed))
        continue
      device_arrays = [next(placed) for _ in boxes]
      # dtype= lets a process that holds none of the target's devices build its (empty) view.
      out.append(jax.make_array_from_single_device_arrays(shape, sharding, device_arrays,
                                                          dtype=dtype))
    return out


WHOLE_PUT_BYTES = 1 << 20


def _whole_put(shape, dtype, sharding, boxes) -> bool:
  """A small array this process holds entirely, on several devices: read and put it whole."""
  return (len(boxes) > 1 and sharding.is_fully_addressable
          and math.prod(shape) * np.dtype(dtype).itemsize <= WHOLE_PUT_BYTES)
