"""Orbax's front door: ``ProxyArrayHandler``, the TypeHandler registered for ``jax.Array``.

Who calls what, on which host:
1. Orbax's PyTree handler calls ``serialize`` on every controller process (one under Pathways)
   inside ``CheckpointManager.save``. We convert its ``ParamInfo``/``SaveArgs`` into
   ``orbax_pathways.transports.values`` and call the engine, which plans and takes the snapshot (the only
   blocking part). We return Orbax's commit futures: the engine's background write, Orbax's
   ``_sharding`` file and its ``array_metadatas`` entry.
2. Orbax's background commit thread runs those futures; Orbax then merges OCDBT and commits
   (rename, or ``commit_success.txt`` on object stores).
3. ``deserialize`` runs on every controller process at restore: we resolve each target's
   sharding (the target's own, or the saved one remapped onto the current devices), read this
   item's records once, and let the engine read, verify and place the bytes.
4. ``metadata`` (a restore without a target asks it) reports the saved shardings remapped onto
   the current devices, which is what makes ``restore(step)`` work on another slice count.

Everything Orbax-specific (PRNG key data, ``_sharding``, array metadata) stays here or in
``_compat``; the engine sees values only.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import zlib
from typing import Any, Sequence

import jax
import numpy as np

from orbax_pathways.sharding import elastic
from orbax_pathways import engine as engine_lib
from orbax_pathways import errors
from orbax_pathways._util import said
from orbax_pathways import options as options_lib
from orbax_pathways.transports import values
from orbax_pathways._compat import orbax as compat
from orbax_pathways.storage import cast as cast_lib
from orbax_pathways.storage import deadline as deadline_lib
from orbax_pathways.storage import meta_io
from orbax_pathways.storage import reader as reader_lib
from orbax_pathways.transports import base as transports


def _leaf(value: jax.Array, info: Any, arg: Any, options: options_lib.Options,
          num_slices: int | None, split_axes: tuple[int, ...] | None = None,
          ) -> tuple[jax.Array, values.SaveLeaf]:
  """(the array to write, its description): PRNG keys are written as their key data, with the
  key implementation in Orbax's ext_metadata. ``split_axes``: the axes chunks are split along
  where the save's ``SaveArgs.shard_axes`` names none (the handler's ``split_axes``)."""
  ext = None
  if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    ext = {compat.random_key_impl_field(): str(jax.random.key_impl(value))}
    value = jax.random.key_data(value)
  stored = np.dtype(arg.dtype) if arg.dtype is not None else np.dtype(value.dtype)
  if stored != value.dtype:  # a cast tensorstore cannot do fails here, before anything is written
    cast_lib.check(value.dtype, stored, what=f'array {info.name!r}')
  chunk_cap = getattr(arg, 'chunk_byte_size', None)
  shard_axes = getattr(arg, 'shard_axes', None) or split_axes
  return value, values.SaveLeaf(
      name=info.name, shape=tuple(value.shape), dtype=np.dtype(value.dtype), stored_dtype=stored,
      compress=options.compress(stored, bool(info.use_compression)),
      max_chunk_bytes=min(options.max_chunk_bytes, chunk_cap) if chunk_cap else options.max_chunk_bytes,
      sharding=engine_lib.sharding_record(value.sharding, num_slices), ext_metadata=ext,
      split_axes=tuple(int(a) for a in shard_axes) if shard_axes else None)


def _notify(callback: Any, event: str, infos: Sequence[Any]) -> None:
  """Orbax's ``SerializationStatusCallback`` hooks, per parameter keypath (as stock calls them)."""
  if callback is None:
    return
  hook = getattr(callback, event, None)
  for info in infos:
    if hook is not None and getattr(info, 'keypath', None) is not None:
      hook(info.keypath)



async def _nothing() -> None:
  """The coroutine of a commit future that only waits for Orbax's signals."""

class ProxyArrayHandler(compat.ArrayHandler):
  """Drop-in replacement of Orbax's ArrayHandler (same typestr, same on-disk format).

  Takes Orbax's constructor arguments with Orbax's defaults: built directly it has no
  array-metadata store, like ``ArrayHandler()``; the handler ``install()`` registers takes the
  settings of the one it replaces (Orbax's default has a store)."""

  # Chunks are split along these axes only where a save's SaveArgs name none (None: any axis,
  # roughly square chunks). Node steps (``multitier/node_steps.py``) set (0,): each chunk is then
  # one run of its shard's buffer, which a restore maps from the node's file in place of a copy.
  split_axes: tuple[int, ...] | None = None

  def __init__(self, *, options: options_lib.Options | None = None, **kwargs):
    super().__init__(**kwargs)
    self.options = options or options_lib.Options.from_env()
    self.engine = engine_lib.Engine(self.options)

  @property
  def bounds(self) -> deadline_lib.Bounds:
    """This handler's storage deadline bounds (its options'): its calls run inside them."""
    return self.engine.bounds

  # ---- conversions at the boundary -------------------------------------------------------------

  def _item(self, info: Any) -> values.Item:
    return values.Item(
        directory=compat.logical_parent_dir(info), use_ocdbt=bool(info.is_ocdbt_checkpoint),
        use_zarr3=bool(info.use_zarr3),
        ocdbt_target_data_file_size=info.ocdbt_target_data_file_size,
        gcs_grpc=self.options.gcs_grpc, context_extra=self.options.ts_context_extra(),
        raise_array_data_missing_error=bool(getattr(info, 'raise_array_data_missing_error', True)),
        metadata_key=compat.handler_settings(self).metadata_key)

  def _context(self, info: Any) -> Any:
    """Orbax's tensorstore context for this item (shared with Orbax's other handlers)."""
    return info.ts_context or compat.ts_context(bool(info.is_ocdbt_checkpoint))

  def _snapshot_mode(self, info: Any) -> str:
    """``Options.snapshot``, where 'auto' follows Orbax's ``enable_pinned_host_transfer``: True
    means pinned; False set explicitly on a GPU (whose default is True) means host; Orbax's own
    default False elsewhere leaves our choice (pinned where the devices offer pinned_host)."""
    requested = getattr(info, 'enable_pinned_host_transfer', None)
    if self.options.snapshot != 'auto' or requested is None:
      return self.options.snapshot
    if requested:
      return 'pinned'
    return 'host' if jax.default_backend() == 'gpu' else 'auto'

  def _save_config(self, info: Any) -> transports.SaveConfig:
    settings = compat.handler_settings(self)
    orbax_limit = compat.limiter_bytes(getattr(info, 'byte_limiter', None))
    # Orbax's "all hosts work with local storage" (``replica_id=None``, ``primary_host=None``):
    # each host's save is complete for what it holds, so no chunk may span hosts (no small
    # arrays coalesced, no replica split among hosts).
    every_held = settings.replica_id is None and settings.primary_host is None
    return transports.SaveConfig(
        max_inflight_bytes=min(self.options.max_inflight_bytes, orbax_limit or self.options.max_inflight_bytes),
        plan=values.PlanSettings(
            replica_parallel=(self.options.replica_parallel and settings.use_replica_parallel
                              and not every_held),
            coalesce_bytes=0 if every_held else self.options.coalesce_bytes,
            min_split_bytes=settings.min_slice_bytes_for_replica_parallel,
            max_replicas=settings.max_replicas_for_replica_parallel),
        snapshot_mode=self._snapshot_mode(info),
        is_primary=settings.primary_host is None or jax.process_index() == settings.primary_host,
        every_held=every_held,
        ocdbt_process_id=compat.ocdbt_subdir_process_id(bool(info.is_ocdbt_checkpoint)),
        context=self._context(info))

  # ---- save ------------------------------------------------------------------------------------

  @deadline_lib.with_bounds
  async def serialize(self, values_: Sequence[jax.Array], infos: Sequence[Any],
                      args: Sequence[Any] | None = None) -> list[Any]:
    args = list(args or [compat.SaveArgs()] * len(values_))
    converted = [_leaf(v, i, a, self.options, self.options.num_slices, self.split_axes)
                 for v, i, a in zip(values_, infos, args)]
    arrays = [a for a, _ in converted]
    leaves = [leaf for _, leaf in converted]
    item = self._item(infos[0])
    settings = compat.handler_settings(self)
    if settings.replica_separate_folder and settings.use_replica_parallel and item.use_ocdbt:
      said.once(logging.WARNING, 'replica_separate_folder',
                'orbax_pathways: enable_replica_parallel_separate_folder is not honoured: '
                'replicated arrays are written into ocdbt.process_<i>/ with the others, not into '
                'ocdbt.process_replica_<i>/ (the merged checkpoint reads the same).')

    # Orbax may create the step's directories in the background and say so by signals (its
    # AWAITABLE_SIGNALS_CONTRACT); a transport that writes before the background commit (the
    # persistence plugin, at snapshot) waits for them as Orbax's own Pathways handler does. Taken
    # here, under this save's operation id; answered at once when nothing is pending.
    created = compat.CommitFuture(_nothing(), name='orbax_pathways_directories')

    async def ready():
      await asyncio.gather(*(info.await_path_creation() for info in infos))
      await asyncio.to_thread(created.result)

    pending = await self.engine.save(arrays, leaves, item, config=self._save_config(infos[0]),
                                     ready=ready)
    _notify(settings.callback, 'on_transfer_end', infos)  # as stock: once the snapshot is taken
    futures = []
    if settings.enable_write_sharding_file:
      futures.append(compat.CommitFuture(
          compat.serialize_sharding_file([a.sharding for a in arrays],
                                         self._with_context(infos, item),
                                         primary_host=settings.primary_host),
          name='orbax_pathways_sharding'))
    futures.append(compat.CommitFuture(self._background(pending, infos, leaves, settings),
                                       name='orbax_pathways_write'))
    return futures

  def _with_context(self, infos: Sequence[Any], item: values.Item) -> Sequence[Any]:
    """``infos`` whose tensorstore context carries our resources too (GCS retries must bound
    Orbax's own ``_sharding`` write as well)."""
    if not item.context_extra:
      return infos
    ctx = compat.ts_context(item.use_ocdbt, dict(item.context_extra))
    out = [copy.copy(i) for i in infos]  # ParamInfo is a plain class
    for i in out:
      i.ts_context = ctx
    return out

  @deadline_lib.with_bounds
  async def _background(self, pending: engine_lib.PendingSave, infos: Sequence[Any],
                        leaves: Sequence[values.SaveLeaf], settings: Any) -> None:
    store = settings.array_metadata_store
    write_mds = store is not None  # Orbax's commit needs one per process when it has a store
    coros = [pending.write(extra_requests=1 if write_mds else 0)]
    if write_mds:  # independent of the data: written alongside it
      exact = pending.snapshot.layouts_exact
      # A transport whose layout is not ours to say (the persistence plugin picks its chunks)
      # records the global shape, as Orbax's own Pathways handler does.
      mds = [compat.array_metadata(
          pending.item, leaf.name, global_shape=leaf.shape,
          write_shape=lay.write_shape if exact else leaf.shape,
          chunk_shape=lay.chunk_shape if exact else leaf.shape, dtype=leaf.dtype,
          stored_dtype=leaf.stored_dtype, ext_metadata=leaf.ext_metadata,
          use_compression=leaf.compress)
             for leaf, lay in zip(leaves, pending.layouts)]

      async def write_mds_after_ready():
        await pending.ready()
        await compat.write_array_metadatas(store, infos[0].parent_dir, mds, jax.process_index())

      coros.append(write_mds_after_ready())
    done = await asyncio.gather(*coros, return_exceptions=True)  # all settle, then raise
    for r in done:
      if isinstance(r, BaseException):
        raise r
    _notify(settings.callback, 'on_write_end', infos)

  # ---- restore ---------------------------------------------------------------------------------

  @deadline_lib.with_bounds
  async def metadata(self, infos: Sequence[Any]) -> Sequence[Any]:
    """Orbax's metadata, with shardings remapped onto the current devices where needed."""
    metas = await self._orbax_metadata(infos)
    if not metas:
      return metas
    records = await self._records(infos[0])
    return elastic.remap_value_metadata(infos, metas, records, num_slices=self.options.num_slices,
                                        divisibility=self.options.divisibility)

  async def _orbax_metadata(self, infos: Sequence[Any]) -> list[Any]:
    """Orbax's metadata of ``infos``. An array tensorstore cannot open (a lost
    ``manifest.ocdbt``) raises what a restore with a target raises, ``ArrayNotFoundError``
    naming the array, instead of tensorstore's bare ``ValueError``."""
    try:
      return list(await super().metadata(infos))
    except ValueError as e:
      if isinstance(e, errors.OrbaxPathwaysError) or 'NOT_FOUND' not in str(e):
        raise
      failed = e
    for info in infos:  # Which array: ask again one at a time (error path only).
      try:
        await super().metadata([info])
      except ValueError as e:
        raise reader_lib.open_error(info.name, self._item(info).path_of(info.name), e) from e
    raise failed

  async def _records(self, info: Any) -> dict:
    return await read_records(info)

  def _delegate(self, args) -> bool:
    """Orbax's own handler serves restores we cannot: a dispatcher the user built this handler
    with, or args that are not ``ArrayRestoreArgs`` (Orbax's error message then applies)."""
    return compat.handler_settings(self).dispatcher is not None or any(
        not isinstance(a, compat.ArrayRestoreArgs) for a in args)

  @deadline_lib.with_bounds
  async def deserialize(self, infos: Sequence[Any],
                        args: Sequence[Any] | None = None) -> Sequence[jax.Array]:
    if args is None:
      raise ValueError('Must provide ArrayRestoreArgs to restore as jax.Array.')
    await asyncio.gather(*(info.await_path_creation() for info in infos))
    args = [as_array_restore_args(a) for a in args]
    if self._delegate(args):
      return await super().deserialize(infos, args)
    records, written_by_us, _ = await read_item_records(infos[0])
    shardings = await self._shardings(infos, args, records)
    leaves = []
    for info, arg, sharding in zip(infos, args, shardings):
      shape, dtype, sharding = compat.physical_read_spec(arg, sharding)
      leaves.append(engine_lib.RestoreLeaf.of(info.name, shape, dtype, sharding,
                                              strict=bool(getattr(arg, 'strict', True))))
    out = await self.engine.restore(
        leaves, self._item(infos[0]), records=records, written_by_us=written_by_us,
        context=self._context(infos[0]),
        config=transports.ReadConfig(
            verify=self.options.verify_checksums, context=self._context(infos[0]),
            max_inflight_bytes=compat.limiter_bytes(getattr(infos[0], 'byte_limiter', None))))
    store = compat.handler_settings(self).array_metadata_store
    if store is not None:
      mds = await compat.read_array_metadatas(store, infos[0].parent_dir)
      if mds:
        out = list(compat.wrap_random_keys(mds, infos, out))
    return out

  async def _shardings(self, infos: Sequence[Any], args: list[Any], records: dict) -> list[Any]:
    """The args' own shardings; for args naming none, the saved ones remapped onto this
    topology (elastic restore), from the same records."""
    missing = [i for i, a in enumerate(args) if not elastic.has_sharding(a)]
    if missing:
      metas = await self._orbax_metadata([infos[i] for i in missing])
      metas = elastic.remap_value_metadata([infos[i] for i in missing], metas, records,
                                           num_slices=self.options.num_slices,
                                           divisibility=self.options.divisibility)
      args = elastic.fill_shardings(args, missing, infos, metas)
    return await compat.shardings_from_args_or_file(infos, args)


def as_array_restore_args(arg: Any) -> Any:
  """Orbax's plain ``RestoreArgs`` (what a ``PyTreeCheckpointHandler`` restore without a target
  passes for a ``jax.Array`` leaf) as ``ArrayRestoreArgs`` without a sharding, so that the leaf
  is read and verified by us (the saved sharding, laid over the current devices) instead of
  unchecked by Orbax's handler. Other args are returned as they are."""
  if type(arg) is compat.RestoreArgs:  # pylint: disable=unidiomatic-typecheck  (not subclasses)
    return compat.ArrayRestoreArgs(restore_type=arg.restore_type, dtype=arg.dtype)
  return arg


# Reads of an item's metadata in flight, by (event loop, item path): Orbax restores an item's
# jax.Array, np.ndarray and scalar leaves through three handlers at once, which share one read.
_reading: dict[tuple[int, str], asyncio.Future] = {}


HOST_WRITER_KINDS = ('numpy', 'scalar')  # ProxyNumpyHandler / ProxyScalarHandler records


async def read_item_records(info: Any) -> tuple[dict, bool, bool]:
  """(this item's ``_pathways`` records by array name, whether the item has ``_pathways``
  metadata at all, i.e. orbax-pathways wrote it, whether its host leaves were recorded, i.e. it
  has a ``numpy.<id>`` or ``scalar.<id>`` record). (``{}``, False, False) for a stock checkpoint.
  Concurrent calls for one item (the handlers of one restore) share one read."""
  key = (id(asyncio.get_running_loop()), str(info.parent_dir))
  fut = _reading.get(key)
  if fut is None:
    fut = asyncio.ensure_future(asyncio.to_thread(meta_io.read_item, info.parent_dir))
    _reading[key] = fut
    fut.add_done_callback(lambda _: _reading.pop(key, None))
  item_md = await asyncio.shield(fut)
  if not item_md:
    return {}, False, False
  host = any(w.writer.split('.', 1)[0] in HOST_WRITER_KINDS for w in item_md.writers)
  return item_md.arrays(), True, host


async def read_records(info: Any) -> dict:
  """This item's ``_pathways`` records by array name (empty for a stock checkpoint)."""
  return (await read_item_records(info))[0]


def host_writer_name(kind: str, names: Sequence[str]) -> str:
  """The writer name of one host-leaf handler call: ``<kind>.<crc32 of the leaf names>``, so two
  calls that save different leaves into one item (Orbax v1 partial saves) never share a file."""
  assert kind in HOST_WRITER_KINDS, kind
  return f'{kind}.{zlib.crc32(chr(0).join(sorted(names)).encode()):08x}'


class ProxyNumpyHandler(compat.NumpyHandler):
  """Orbax's ``np.ndarray`` handler with checksums: saves write exactly what Orbax writes (its
  spec, chunk grid and codecs, on process 0) plus a record ``_pathways/numpy.<id>.msgpack`` with
  the crc32c of every chunk; restores of arrays with records are read back verified.

  Who calls what: Orbax's PyTree handler calls ``serialize`` on every process (only process 0
  writes, as stock) and ``deserialize`` on every process. Orbax routes a restore whose target
  (or ``RestoreArgs.restore_type``) is ``np.ndarray`` here, also for arrays saved as
  ``jax.Array``. Arrays of items without ``_pathways`` (stock checkpoints) are read by Orbax's
  own code, unchecked; in an item with ``_pathways`` an array without a record raises
  ``MissingChecksumError`` (unless verification is off), except a numpy or scalar leaf of an
  item whose host leaves were never recorded (saved by Orbax v1's own handlers, or by an older
  orbax-pathways), which is read unchecked as stock reads it.

  ``saved_type_in_infos=False`` is for callers whose restore ``ParamInfo`` does not carry the
  leaf's saved type (Orbax v1's leaf handlers): a leaf without a record in an item whose host
  leaves were never recorded is then read unchecked (it may be a numpy leaf Orbax's handler
  saved), where with the saved type known a ``jax.Array`` leaf's lost record raises.
  """

  WRITER_KIND = 'numpy'
  # Every process writes (not process 0 only): set on the handlers of a manager of one process
  # (multitier/node_steps.py), whose directory no other process writes to.
  every_process = False

  def __init__(self, *, options: options_lib.Options | None = None,
               saved_type_in_infos: bool = True, **kwargs):
    super().__init__(**kwargs)
    self._init_proxy(options, saved_type_in_infos)

  def _init_proxy(self, options: options_lib.Options | None, saved_type_in_infos: bool) -> None:
    self.options = options or options_lib.Options.from_env()
    self.engine = engine_lib.Engine(self.options)
    self.saved_type_in_infos = saved_type_in_infos

  @property
  def bounds(self) -> deadline_lib.Bounds:
    """This handler's storage deadline bounds (its options'): its calls run inside them."""
    return self.engine.bounds

  def _host_item(self, info: Any) -> values.Item:
    return values.Item(
        directory=compat.logical_parent_dir(info), use_ocdbt=bool(info.is_ocdbt_checkpoint),
        use_zarr3=bool(info.use_zarr3), gcs_grpc=self.options.gcs_grpc,
        context_extra=self.options.ts_context_extra(),
        raise_array_data_missing_error=bool(getattr(info, 'raise_array_data_missing_error', True)),
        metadata_key=compat.numpy_handler_metadata_key(self))

  @deadline_lib.with_bounds
  async def serialize(self, values_: Sequence[Any], infos: Sequence[Any],
                      args: Sequence[Any] | None = None) -> list[Any]:
    args = list(args or [compat.SaveArgs()] * len(values_))
    compat.check_numpy_save_inputs(values_, infos, args)
    for value, info, arg in zip(values_, infos, args):
      if getattr(arg, 'dtype', None) is not None:  # as for arrays (_leaf): before any write
        cast_lib.check(np.asarray(value).dtype, arg.dtype, what=f'host leaf {info.name!r}')
    if compat.numpy_handler_deepcopies(self):
      values_ = [copy.deepcopy(v) for v in values_]
    return [compat.CommitFuture(self._write(list(values_), infos, args), name='np_type_handler')]

  @deadline_lib.with_bounds
  async def _write(self, values_: Sequence[Any], infos: Sequence[Any], args: Sequence[Any]) -> None:
    """Orbax's background commit: process 0 writes every leaf and the record."""
    arrays = []
    for value, info, arg in zip(values_, infos, args):
      await info.await_path_creation()
      tspec = compat.numpy_write_spec(
          info, arg, value, metadata_key=compat.numpy_handler_metadata_key(self),
          ocdbt_process_id=compat.numpy_handler_ocdbt_process_id(self))
      arrays.append(engine_lib.HostArray(info.name, value, tspec))
    if (compat.primary_process_index() != 0 and not self.every_process) or not arrays:
      return
    item = self._host_item(infos[0])
    await self.engine.save_host(
        host_writer_name(self.WRITER_KIND, [a.name for a in arrays]), item, arrays,
        context=infos[0].ts_context or compat.ts_context(item.use_ocdbt))

  @deadline_lib.with_bounds
  async def deserialize(self, infos: Sequence[Any], args: Sequence[Any] | None = None) -> list[Any]:
    args = list(args or [compat.RestoreArgs()] * len(infos))
    await asyncio.gather(*(info.await_path_creation() for info in infos))
    records, written_by_us, host_recorded = await read_item_records(infos[0])
    verify = self.options.verify_checksums

    def must_have_record(info: Any) -> bool:
      """In an item we wrote: a leaf saved as jax.Array, or any leaf once host leaves were
      recorded (not by Orbax v1's own numpy and scalar handlers, nor by older versions)."""
      if not written_by_us or host_recorded:
        return written_by_us
      saved_as = getattr(info, 'value_typestr', None)
      if saved_as is None and not self.saved_type_in_infos:
        return False  # unknown (Orbax v1): maybe a host leaf saved by Orbax's own handler
      return saved_as in (None, compat.JAX_ARRAY_TYPESTR)

    ours = [i for i, info in enumerate(infos)
            if info.name in records or (verify and must_have_record(info))]
    out: list[Any] = [None] * len(infos)
    rest = [i for i in range(len(infos)) if i not in set(ours)]
    if rest:
      for i, value in zip(rest, await super().deserialize([infos[i] for i in rest],
                                                           [args[i] for i in rest])):
        out[i] = value
    if ours:
      info0 = infos[ours[0]]
      item = self._host_item(info0)
      names = [infos[i].name for i in ours]
      # Stats for numpy targets of device arrays (records with a sharding) only: host leaves are
      # read beside the item's device arrays, whose restore is the one ``last_restore()`` tells.
      device_saved = any(getattr(records.get(n), 'sharding', None) is not None for n in names)
      arrays = await self.engine.read_to_host(
          names, [getattr(args[i], 'dtype', None) for i in ours], item,
          records=records, verify=self.options.verify_checksums, written_by_us=written_by_us,
          record_stats=device_saved, context=info0.ts_context or compat.ts_context(item.use_ocdbt))
      for i, value in zip(ours, arrays):
        out[i] = value
    return out


class ProxyScalarHandler(compat.ScalarHandler, ProxyNumpyHandler):
  """Orbax's scalar handler (Python ``int``/``float``, ``np.number`` leaves: step counters) on top
  of ``ProxyNumpyHandler``: Orbax's ``ScalarHandler`` turns scalars into 0-d arrays and back, and
  the arrays are written and read with checksums as above (record ``scalar.<id>.msgpack``)."""

  WRITER_KIND = 'scalar'

  def __init__(self, *, options: options_lib.Options | None = None,
               saved_type_in_infos: bool = True, **kwargs):
    # Orbax's ScalarHandler.__init__ reaches ProxyNumpyHandler.__init__ through the MRO.
    compat.ScalarHandler.__init__(self, **kwargs)
    self._init_proxy(options, saved_type_in_infos)
