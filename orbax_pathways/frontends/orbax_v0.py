"""Orbax's front door: ``ProxyArrayHandler``, the TypeHandler registered for ``jax.Array``.

Who calls what, on which host:
1. Orbax's PyTree handler calls ``serialize`` on every controller process (one under Pathways)
   inside ``CheckpointManager.save``. We convert its ``ParamInfo``/``SaveArgs`` into
   ``orbax_pathways.values`` and call the engine, which plans and takes the snapshot (the only
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
from typing import Any, Sequence

import jax
import numpy as np

from orbax_pathways import elastic
from orbax_pathways import engine as engine_lib
from orbax_pathways import errors
from orbax_pathways import _said
from orbax_pathways import options as options_lib
from orbax_pathways import values
from orbax_pathways._compat import orbax as compat
from orbax_pathways.storage import meta_io
from orbax_pathways.storage import reader as reader_lib
from orbax_pathways.transports import base as transports


def _leaf(value: jax.Array, info: Any, arg: Any, options: options_lib.Options,
          num_slices: int | None) -> tuple[jax.Array, values.SaveLeaf]:
  """(the array to write, its description): PRNG keys are written as their key data, with the
  key implementation in Orbax's ext_metadata."""
  ext = None
  if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    ext = {compat.random_key_impl_field(): str(jax.random.key_impl(value))}
    value = jax.random.key_data(value)
  stored = np.dtype(arg.dtype) if arg.dtype is not None else np.dtype(value.dtype)
  chunk_cap = getattr(arg, 'chunk_byte_size', None)
  shard_axes = getattr(arg, 'shard_axes', None)
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


class ProxyArrayHandler(compat.ArrayHandler):
  """Drop-in replacement of Orbax's ArrayHandler (same typestr, same on-disk format).

  Takes Orbax's constructor arguments with Orbax's defaults: built directly it has no
  array-metadata store, like ``ArrayHandler()``; the handler ``install()`` registers takes the
  settings of the one it replaces (Orbax's default has a store)."""

  def __init__(self, *, options: options_lib.Options | None = None, **kwargs):
    super().__init__(**kwargs)
    self.options = options or options_lib.Options.from_env()
    self.engine = engine_lib.Engine(self.options)

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
    return transports.SaveConfig(
        max_inflight_bytes=min(self.options.max_inflight_bytes, orbax_limit or self.options.max_inflight_bytes),
        plan=values.PlanSettings(
            replica_parallel=self.options.replica_parallel and settings.use_replica_parallel,
            coalesce_bytes=self.options.coalesce_bytes,
            min_split_bytes=settings.min_slice_bytes_for_replica_parallel,
            max_replicas=settings.max_replicas_for_replica_parallel),
        snapshot_mode=self._snapshot_mode(info),
        is_primary=settings.primary_host is None or jax.process_index() == settings.primary_host,
        ocdbt_process_id=compat.ocdbt_subdir_process_id(bool(info.is_ocdbt_checkpoint)),
        context=self._context(info))

  # ---- save ------------------------------------------------------------------------------------

  async def serialize(self, values_: Sequence[jax.Array], infos: Sequence[Any],
                      args: Sequence[Any] | None = None) -> list[Any]:
    args = list(args or [compat.SaveArgs()] * len(values_))
    converted = [_leaf(v, i, a, self.options, self.options.num_slices)
                 for v, i, a in zip(values_, infos, args)]
    arrays = [a for a, _ in converted]
    leaves = [leaf for _, leaf in converted]
    item = self._item(infos[0])
    settings = compat.handler_settings(self)
    if settings.replica_separate_folder and settings.use_replica_parallel and item.use_ocdbt:
      _said.once(logging.WARNING, 'replica_separate_folder',
                'orbax_pathways: enable_replica_parallel_separate_folder is not honoured: '
                'replicated arrays are written into ocdbt.process_<i>/ with the others, not into '
                'ocdbt.process_replica_<i>/ (the merged checkpoint reads the same).')

    async def ready():
      await asyncio.gather(*(info.await_path_creation() for info in infos))

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

  async def _background(self, pending: engine_lib.PendingSave, infos: Sequence[Any],
                        leaves: Sequence[values.SaveLeaf], settings: Any) -> None:
    store = settings.array_metadata_store
    write_mds = store is not None and pending.snapshot.layouts_exact
    coros = [pending.write(extra_requests=1 if write_mds else 0)]
    if write_mds:  # independent of the data: written alongside it
      mds = [compat.array_metadata(
          pending.item, leaf.name, global_shape=leaf.shape, write_shape=lay.write_shape,
          chunk_shape=lay.chunk_shape, dtype=leaf.dtype, stored_dtype=leaf.stored_dtype,
          ext_metadata=leaf.ext_metadata, use_compression=leaf.compress)
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

  async def deserialize(self, infos: Sequence[Any],
                        args: Sequence[Any] | None = None) -> Sequence[jax.Array]:
    if args is None:
      raise ValueError('Must provide ArrayRestoreArgs to restore as jax.Array.')
    await asyncio.gather(*(info.await_path_creation() for info in infos))
    if self._delegate(args):
      return await super().deserialize(infos, args)
    args = list(args)
    records = await self._records(infos[0])
    shardings = await self._shardings(infos, args, records)
    leaves = []
    for info, arg, sharding in zip(infos, args, shardings):
      shape, dtype, sharding = compat.physical_read_spec(arg, sharding)
      leaves.append(engine_lib.RestoreLeaf.of(info.name, shape, dtype, sharding,
                                              strict=bool(getattr(arg, 'strict', True))))
    out = await self.engine.restore(
        leaves, self._item(infos[0]), records=records, context=self._context(infos[0]),
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


async def read_records(info: Any) -> dict:
  """This item's ``_pathways`` records by array name (empty for a stock checkpoint)."""
  item_md = await asyncio.to_thread(meta_io.read_item, info.parent_dir)
  return item_md.arrays() if item_md else {}


class ProxyNumpyHandler(compat.NumpyHandler):
  """Orbax's ``np.ndarray`` handler, except that arrays we wrote are read back verified.

  Orbax routes a restore whose target (or ``RestoreArgs.restore_type``) is ``np.ndarray`` here,
  also for arrays saved as ``jax.Array``. Saving numpy leaves and reading arrays without our
  records (stock checkpoints, numpy leaves) stay Orbax's own code.
  """

  def __init__(self, *, options: options_lib.Options | None = None, **kwargs):
    super().__init__(**kwargs)
    self.options = options or options_lib.Options.from_env()
    self.engine = engine_lib.Engine(self.options)

  async def deserialize(self, infos: Sequence[Any], args: Sequence[Any] | None = None) -> list[Any]:
    args = list(args or [compat.RestoreArgs()] * len(infos))
    await asyncio.gather(*(info.await_path_creation() for info in infos))
    records = await read_records(infos[0])
    ours = [i for i, info in enumerate(infos) if info.name in records]
    out: list[Any] = [None] * len(infos)
    rest = [i for i in range(len(infos)) if i not in set(ours)]
    if rest:
      for i, value in zip(rest, await super().deserialize([infos[i] for i in rest],
                                                           [args[i] for i in rest])):
        out[i] = value
    if ours:
      info0 = infos[ours[0]]
      item = values.Item(
          directory=compat.logical_parent_dir(info0), use_ocdbt=bool(info0.is_ocdbt_checkpoint),
          use_zarr3=bool(info0.use_zarr3), gcs_grpc=self.options.gcs_grpc,
          context_extra=self.options.ts_context_extra(),
          raise_array_data_missing_error=bool(getattr(info0, 'raise_array_data_missing_error', True)),
          metadata_key=compat.numpy_handler_metadata_key(self))
      arrays = await self.engine.read_to_host(
          [infos[i].name for i in ours], [getattr(args[i], 'dtype', None) for i in ours], item,
          records=records, verify=self.options.verify_checksums,
          context=info0.ts_context or compat.ts_context(item.use_ocdbt))
      for i, value in zip(ours, arrays):
        out[i] = value
    return out
