"""Every use of Orbax *serialization* internals (Orbax's private ``_src`` package, reached
through ``src.py``) goes through here.

Supported: orbax-checkpoint ``supported.ORBAX`` (see pyproject.toml). Each function is a small named
translation so that a moved symbol breaks in one place, and ``tests/compat/test_compat.py`` exercises
every one against the installed Orbax. Called on any host, from the handler and the storage layer.
"""

from __future__ import annotations

from orbax_pathways._compat import src
from orbax_pathways._compat import supported

import copy
import dataclasses
from typing import Any, Mapping, Sequence

from etils import epath
import numpy as np

import orbax.checkpoint as ocp
from orbax.checkpoint import future as _future
from orbax.checkpoint import type_handlers as _th
_array_metadata = src.orbax('metadata.array_metadata')
_ams = src.orbax('metadata.array_metadata_store')
_sharding_md = src.orbax('metadata.sharding')
_multihost = src.orbax('multihost.multihost')
_jah = src.orbax('serialization.jax_array_handlers')
_ocdbt_utils = src.orbax('serialization.ocdbt_utils')
_ts_utils = src.orbax('serialization.tensorstore_utils')
_thr = src.orbax('serialization.type_handler_registry')
_tree_utils = src.orbax('tree.utils')
run_sync = src.orbax('asyncio_utils.run_sync')  # re-exported

from orbax_pathways.format import names as format_lib

SUPPORTED_ORBAX = supported.ORBAX
ORBAX_VERSION = ocp.__version__

# Public Orbax API, re-exported so the rest of the package imports Orbax from one place.
ArrayHandler = _th.ArrayHandler
ArrayRestoreArgs = _th.ArrayRestoreArgs
NumpyHandler = _th.NumpyHandler
ScalarHandler = _th.ScalarHandler
RestoreArgs = _th.RestoreArgs
SaveArgs = _th.SaveArgs
ParamInfo = _th.ParamInfo
CommitFuture = _future.CommitFutureAwaitingContractedSignals
JAX_ARRAY_TYPESTR = _jah.JAX_ARRAY_TYPE_STR
SHARDING_FILE_NAME = format_lib.SHARDING_FILE
ShardingMetadata = _sharding_md.ShardingMetadata


def array_metadata_store() -> Any:
  """The per-process ``array_metadatas/process_<i>`` store stock Orbax writes and validates."""
  return _ams.Store()


@dataclasses.dataclass(frozen=True)
class HandlerSettings:
  """The constructor settings of an Orbax ``ArrayHandler`` (kept in private attributes)."""

  primary_host: int | None
  replica_id: int | None
  use_replica_parallel: bool
  enable_write_sharding_file: bool
  array_metadata_store: Any
  dispatcher: Any
  callback: Any  # Orbax's SerializationStatusCallback
  metadata_key: str | None
  min_slice_bytes_for_replica_parallel: int | None
  max_replicas_for_replica_parallel: int | None
  replica_separate_folder: bool  # enable_replica_parallel_separate_folder (not honoured by us)


def handler_settings(handler: Any) -> HandlerSettings:
  # pylint: disable=protected-access
  return HandlerSettings(
      primary_host=handler._primary_host, replica_id=handler._replica_id,
      use_replica_parallel=bool(handler._use_replica_parallel),
      enable_write_sharding_file=bool(handler._enable_write_sharding_file),
      array_metadata_store=handler._array_metadata_store, dispatcher=handler._dispatcher,
      callback=handler._callback, metadata_key=handler._metadata_key,
      min_slice_bytes_for_replica_parallel=handler._min_slice_bytes_for_replica_parallel,
      max_replicas_for_replica_parallel=handler._max_replicas_for_replica_parallel,
      replica_separate_folder=bool(
          getattr(handler, '_enable_replica_parallel_separate_folder', False)))


def limiter_bytes(limiter: Any) -> int | None:
  """The byte budget of one of Orbax's byte limiters (``save_concurrent_gb``,
  ``restore_concurrent_gb``), or None when it is unlimited or absent."""
  limits = src.orbax('serialization.limits')
  if isinstance(limiter, limits.LimitInFlightBytes):
    return int(limiter.max_bytes)
  return None


def handler_constructor_kwargs(handler: Any) -> dict[str, Any]:
  """The keyword arguments that build an ``ArrayHandler`` like ``handler`` (same settings)."""
  # pylint: disable=protected-access
  return dict(
      metadata_key=handler._metadata_key, primary_host=handler._primary_host,
      replica_id=handler._replica_id, use_replica_parallel=handler._use_replica_parallel,
      min_slice_bytes_for_replica_parallel=handler._min_slice_bytes_for_replica_parallel,
      max_replicas_for_replica_parallel=handler._max_replicas_for_replica_parallel,
      enable_write_sharding_file=handler._enable_write_sharding_file,
      array_metadata_store=handler._array_metadata_store,
      enable_replica_parallel_separate_folder=handler._enable_replica_parallel_separate_folder,
      callback=handler._callback)


def numpy_handler_constructor_kwargs(handler: Any) -> dict[str, Any]:
  """The keyword arguments that build a ``NumpyHandler`` like ``handler`` (same settings); for a
  ``ScalarHandler`` (scalars are never copied; it takes no ``deepcopy_host_arrays``) its own."""
  # pylint: disable=protected-access
  kwargs: dict[str, Any] = dict(metadata_key=handler._metadata_key,
                                ocdbt_process_id=handler._override_ocdbt_process_id)
  if not isinstance(handler, ScalarHandler) and hasattr(handler, '_deepcopy_host_arrays'):
    kwargs['deepcopy_host_arrays'] = bool(handler._deepcopy_host_arrays)
  return kwargs


def numpy_handler_deepcopies(handler: Any) -> bool:
  """Whether a ``NumpyHandler`` copies the host arrays it saves (``deepcopy_host_arrays``)."""
  return bool(getattr(handler, '_deepcopy_host_arrays', True))


def numpy_handler_ocdbt_process_id(handler: Any) -> str | None:
  """The ``ocdbt_process_id`` override a ``NumpyHandler`` was built with (None: Orbax's)."""
  return handler._override_ocdbt_process_id  # pylint: disable=protected-access


def check_numpy_save_inputs(values: Sequence[Any], infos: Sequence[Any],
                            args: Sequence[Any]) -> None:
  """Orbax's ``NumpyHandler.serialize`` argument checks (lengths; zero-size arrays refused)."""
  _types = src.orbax('serialization.types')
  _types.check_input_arguments(values, infos, args)
  _jah.check_array_values(values, infos)


def numpy_write_spec(info: Any, arg: Any, value: Any, *, metadata_key: str | None,
                     ocdbt_process_id: str | None) -> dict:
  """Orbax's exact tensorstore write spec of an ``np.ndarray`` leaf (what ``NumpyHandler``
  writes: one array, Orbax's chunk grid and codecs)."""
  use_ocdbt = bool(info.is_ocdbt_checkpoint)
  return _ts_utils.build_array_write_spec(
      info=info, arg=arg, global_shape=value.shape, local_shape=value.shape, dtype=value.dtype,
      use_ocdbt=use_ocdbt,
      process_index=_ocdbt_utils.get_process_index_for_subdir(
          use_ocdbt=use_ocdbt, override_ocdbt_process_id=ocdbt_process_id),
      metadata_key=metadata_key).json


def numpy_handler_metadata_key(handler: Any) -> str | None:
  """The zarr metadata file name a ``NumpyHandler`` reads and writes (None: Orbax's default)."""
  return handler._metadata_key  # pylint: disable=protected-access


def is_plain_array_handler(handler: Any) -> bool:
  """Orbax's own ``ArrayHandler`` or its Pathways persistence handler, which ours replaces; not
  a ``SingleReplicaArrayHandler`` (load-and-broadcast) or a user's subclass."""
  _cp = src.orbax('serialization.cloud_pathways_array_handler')
  return type(handler) in (_jah.ArrayHandler, _cp.CloudPathwaysArrayHandler)


def logical_parent_dir(info: Any) -> str:
  """``ParamInfo.parent_dir`` as a string, also while Orbax is still creating it (a
  ``PathAwaitingCreation`` names its path before it exists)."""
  parent = info._parent_dir  # pylint: disable=protected-access
  path = getattr(parent, 'path', parent) if not isinstance(parent, epath.Path) else parent
  return epath.Path(path).as_posix()


def device_assignment_ids(sharding: Any) -> tuple[int, ...]:
  """Device ids in the sharding's device-assignment order (what the persistence plugin groups by)."""
  return tuple(d.id for d in sharding._device_assignment)  # pylint: disable=protected-access


def primary_process_index() -> int:
  return _multihost.process_index()


def ocdbt_subdir_process_id(use_ocdbt: bool, override: str | None = None) -> int | str | None:
  """The ``ocdbt.process_<id>`` suffix for this writer (None without OCDBT)."""
  return _ocdbt_utils.get_process_index_for_subdir(use_ocdbt, override)


def _array_write_spec(item: Any, name: str, *, global_shape: Sequence[int],
                      write_shape: Sequence[int], dtype: Any, stored_dtype: Any,
                      process_id: int | str | None, ext_metadata: Mapping[str, Any] | None,
                      use_compression: bool) -> Any:
  return _ts_utils.ArrayWriteSpec(
      item.directory,
      relative_array_filename=name,
      global_shape=tuple(global_shape),
      write_shape=tuple(write_shape),
      dtype=dtype,
      target_dtype=None if np.dtype(stored_dtype) == np.dtype(dtype) else stored_dtype,
      use_compression=use_compression,
      use_zarr3=item.use_zarr3,
      use_ocdbt=item.use_ocdbt,
      process_id=process_id,
      ocdbt_target_data_file_size=item.ocdbt_target_data_file_size,
      ext_metadata=dict(ext_metadata) if ext_metadata else None,
      metadata_key=item.metadata_key,
  )


def build_write_spec(item: Any, name: str, *, global_shape: Sequence[int],
                     write_shape: Sequence[int], chunk_shape: Sequence[int], dtype: Any,
                     stored_dtype: Any, process_id: int | str | None,
                     ext_metadata: Mapping[str, Any] | None, use_compression: bool) -> dict:
  """Orbax's exact tensorstore write spec for array ``name`` of ``item`` (an
  ``orbax_pathways.transports.values.Item``), with our chunk grid.

  We build Orbax's spec (kvstore layout, OCDBT options, zarr/zarr3 codecs) and replace only the
  chunk grid, so stock Orbax reads the result as it reads its own.
  """
  spec = _array_write_spec(item, name, global_shape=global_shape, write_shape=write_shape,
                           dtype=dtype, stored_dtype=stored_dtype, process_id=process_id,
                           ext_metadata=ext_metadata, use_compression=use_compression)
  tspec = copy.deepcopy(spec.json)
  meta = tspec['base']['metadata'] if tspec.get('driver') == 'cast' else tspec['metadata']
  chunks = [max(1, int(c)) for c in chunk_shape]
  if 'chunks' in meta:  # zarr v2
    meta['chunks'] = chunks
  else:  # zarr3: outer grid and the sharding codec's inner chunks both become our chunk.
    meta['chunk_grid']['configuration']['chunk_shape'] = chunks
    for codec in meta.get('codecs', []):
      if codec.get('name') == 'sharding_indexed':
        codec['configuration']['chunk_shape'] = chunks
  return with_gcs_grpc(tspec) if item.gcs_grpc else tspec


def array_metadata(item: Any, name: str, *, global_shape: Sequence[int],
                   write_shape: Sequence[int], chunk_shape: Sequence[int], dtype: Any,
                   stored_dtype: Any, ext_metadata: Mapping[str, Any] | None,
                   use_compression: bool) -> Any:
  """Orbax's per-array ``ArrayMetadata`` (the ``array_metadatas/process_<i>`` entry), with our
  chunk shape."""
  spec = _array_write_spec(item, name, global_shape=global_shape, write_shape=write_shape,
                           dtype=dtype, stored_dtype=stored_dtype, process_id=None,
                           ext_metadata=ext_metadata, use_compression=use_compression)
  md = spec.metadata
  return type(md)(**{**md.__dict__, 'chunk_shape': tuple(max(1, int(c)) for c in chunk_shape)})


def build_read_spec(item: Any, name: str, *, raise_array_data_missing_error: bool = True,
                    target_dtype: Any = None) -> dict:
  """Orbax's tensorstore read spec for array ``name`` of ``item``."""
  spec = _ts_utils.ArrayReadSpec(
      item.directory,
      name,
      item.use_zarr3,
      use_ocdbt=item.use_ocdbt,
      metadata_key=item.metadata_key,
      raise_array_data_missing_error=raise_array_data_missing_error,
      target_dtype=target_dtype,
  ).json
  return with_gcs_grpc(spec) if item.gcs_grpc else spec


def with_gcs_grpc(spec: Any) -> Any:
  """The same spec with every tensorstore ``gcs`` kvstore switched to ``gcs_grpc`` (the gRPC
  driver, about 2x the HTTP one on real GCS; the objects written are the same)."""
  if isinstance(spec, dict):
    out = {k: with_gcs_grpc(v) for k, v in spec.items()}
    if out.get('driver') == 'gcs':
      out['driver'] = 'gcs_grpc'
    return out
  if isinstance(spec, list):
    return [with_gcs_grpc(v) for v in spec]
  return spec


def ts_context(use_ocdbt: bool = True, extra: dict | None = None) -> Any:
  """Orbax's tensorstore context, plus ``extra`` resources (e.g. ``gcs_request_retries``)."""
  if not extra:
    return _ts_utils.get_ts_context(use_ocdbt=use_ocdbt)
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  base = _ts_utils._DEFAULT_OCDBT_TS_CONTEXT if use_ocdbt else _ts_utils._BASE_TS_CONTEXT  # pylint: disable=protected-access
  try:
    return ts.Context({**copy.deepcopy(base), **extra})
  except ValueError:
    retries = extra.get('gcs_request_retries', {})
    if retries.get('max_retries') != 0:
      raise
    # tensorstore < 0.1.86 wants at least one retry: the closest it can do to none.
    extra = {**extra, 'gcs_request_retries': {**retries, 'max_retries': 1}}
    return ts.Context({**copy.deepcopy(base), **extra})


def param_names(tree: Any) -> Any:
  """``tree`` with each leaf replaced by the name Orbax saves it under (its key path)."""
  return _tree_utils.get_param_names(tree)


def merge_ocdbt(item_dir: Any) -> None:
  """Merges the per-process OCDBT trees (``ocdbt.process_*``) under ``item_dir`` into its own
  tree, as Orbax's finalize of a multi-process save does (no validation: the restore checks
  every chunk it reads)."""
  run_sync(_ocdbt_utils.merge_ocdbt_per_process_files(
      epath.Path(item_dir), ts_context=_ts_utils.get_ts_context(use_ocdbt=True),
      use_zarr3=True, enable_validation=False))


def serialize_sharding_file(shardings: Sequence[Any], infos: Sequence[Any], *, primary_host: int | None):
  """Coroutine writing Orbax's ``_sharding`` file entries (primary host only)."""
  return _jah._async_serialize_shardings(shardings, infos, primary_host=primary_host)  # pylint: disable=protected-access


def write_array_metadatas(store: Any, parent_dir: Any, array_metadatas: Sequence[Any], process_index: int):
  return store.write(checkpoint_dir=parent_dir, array_metadatas=list(array_metadatas), process_index=process_index)


async def read_array_metadatas(store: Any, parent_dir: Any) -> Any:
  return await store.read(checkpoint_dir=parent_dir)


def random_key_impl_field() -> str:
  return _array_metadata.RANDOM_KEY_IMPL


def wrap_random_keys(array_metadatas: Any, infos: Sequence[Any], arrays: list) -> Sequence[Any]:
  return _jah._wrap_random_key_data(array_metadatas, infos, arrays)  # pylint: disable=protected-access


def sharding_metadata_from_jax(sharding: Any) -> Any:
  return _sharding_md.from_jax_sharding(sharding)


def array_value_metadata(**kwargs) -> Any:
  """``orbax.checkpoint.metadata.ArrayMetadata`` (the value metadata restore targets come from)."""
  return ocp.metadata.ArrayMetadata(**kwargs)


# ---- type-handler registry -------------------------------------------------------------------

def registered_array_handler() -> Any:
  return _thr.GLOBAL_TYPE_HANDLER_REGISTRY.get(__import__('jax').Array)


def register_array_handler(handler: Any) -> None:
  """Replaces the jax.Array entry in place, without Orbax's 'overriding jax.Array' warning (ours
  is intended and logged by _install). ``ignore_warnings`` is part of Orbax's
  ``TypeHandlerRegistry.add`` protocol; no logger level or absl verbosity is touched, so every
  record Orbax logs afterwards reaches the user's handlers as it would without us."""
  import jax  # pylint: disable=g-import-not-at-top
  _thr.GLOBAL_TYPE_HANDLER_REGISTRY.add(jax.Array, handler, override=True, ignore_warnings=True)


def registered_handler(ty: type) -> Any:
  return _thr.GLOBAL_TYPE_HANDLER_REGISTRY.get(ty)


def register_handler(ty: type, handler: Any) -> None:
  """Like ``register_array_handler``, for another type (``np.ndarray``)."""
  _thr.GLOBAL_TYPE_HANDLER_REGISTRY.add(ty, handler, override=True, ignore_warnings=True)


# ---- restore helpers -------------------------------------------------------------------------

def physical_read_spec(arg: Any, sharding: Any) -> tuple[Any, Any, Any]:
  """(global_shape, dtype, sharding) the stored array is read with (PRNG keys -> key data)."""
  if hasattr(_jah, '_physical_read_spec'):  # Orbax >= 0.12.7
    return _jah._physical_read_spec(arg, sharding)  # pylint: disable=protected-access
  return _physical_read_spec_before_0_12_7(arg, sharding)


def _physical_read_spec_before_0_12_7(arg: Any, sharding: Any) -> tuple[Any, Any, Any]:
  """Orbax 0.12.4-0.12.6 inline the same rule in ArrayHandler.deserialize: a PRNG key array is
  stored as its key data (unsigned ints with trailing dimensions, replicated along them)."""
  import jax  # pylint: disable=g-import-not-at-top
  shape = getattr(arg, 'global_shape', None)
  if not has_prng_key_dtype(arg):
    return shape, arg.dtype, sharding
  data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape or (), arg.dtype))
  if shape is None:
    return None, data.dtype, sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    trailing = (None,) * (len(data.shape) - len(shape))
    sharding = jax.sharding.NamedSharding(sharding.mesh,
                                          jax.sharding.PartitionSpec(*sharding.spec, *trailing))
  return data.shape, data.dtype, sharding


def has_prng_key_dtype(arg: Any) -> bool:
  return _jah._has_prng_key_dtype(arg)  # pylint: disable=protected-access


async def shardings_from_args_or_file(infos: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  """Orbax's own rule: mesh+mesh_axes, else ``sharding``, else the ``_sharding`` file."""
  async_path = src.orbax('path.async_path')
  exists = await async_path.exists(infos[0].parent_dir / SHARDING_FILE_NAME)
  return list(await _jah._deserialize_shardings(infos, args, exists))  # pylint: disable=protected-access


# ---- Pathways persistence plugin (server-side writes over the IFRT proxy) -------------------

def persistence_dtype_supported(dtype: Any) -> bool:
  """Whether the persistence plugin can store ``dtype`` (Orbax's own dtype table)."""
  cloud_pathways_helper = src.orbax('serialization.cloud_pathways_helper')
  try:
    cloud_pathways_helper.dtype_to_xla_primitive_type_str(np.dtype(dtype))
    return True
  except ValueError:
    return False


def persistence_bulk_write_request(location: str, names: Sequence[str], arrays: Sequence[Any],
                                   timeout: Any) -> str:
  """The JSON request Orbax's CloudPathwaysArrayHandler sends for one group of arrays."""
  cloud_pathways_helper = src.orbax('serialization.cloud_pathways_helper')
  return cloud_pathways_helper.get_bulk_write_request(location, names, arrays, timeout)


def persistence_write_arrays(location: str, names: Sequence[str], arrays: Sequence[Any],
                             timeout: Any) -> Any:
  """Compiles and runs the plugin program on the Pathways workers; returns a future. Only works
  on the IFRT proxy backend (Pathways)."""
  cloud_pathways_helper = src.orbax('serialization.cloud_pathways_helper')
  return cloud_pathways_helper.write_arrays(location, names, arrays, timeout)


# ---- Orbax's I/O telemetry (jax.monitoring metrics and their INFO lines) ---------------------

def _telemetry_kind() -> str:
  """How the installed Orbax's ``_log_io_metrics`` takes its starting point: 'raw' (a raw byte
  counter, 0.12.8), 'ts_metrics' (tensorstore's metric snapshot, older), or 'none'."""
  import inspect  # pylint: disable=g-import-not-at-top
  log_io = getattr(_jah, '_log_io_metrics', None)
  if log_io is None:
    return 'none'
  params = inspect.signature(log_io).parameters
  if 'initial_raw_bytes' in params and hasattr(_ts_utils, 'get_tensorstore_raw_bytes'):
    return 'raw'
  if 'initial_ts_metrics' in params:
    return 'ts_metrics'
  return 'none'


def io_metrics_start(direction: str) -> tuple[float, Any]:
  """(start time, the starting point Orbax's telemetry needs) for ``io_metrics_end``;
  ``direction`` is 'write' or 'read'. Never raises: telemetry must not fail a save."""
  import time  # pylint: disable=g-import-not-at-top
  start: Any = None
  try:
    kind = _telemetry_kind()
    if kind == 'raw':
      _types = src.orbax('serialization.types')
      start = _ts_utils.get_tensorstore_raw_bytes(_types.IoDirection(direction))
    elif kind == 'ts_metrics':
      import tensorstore as ts  # pylint: disable=g-import-not-at-top
      start = ts.experimental_collect_matching_metrics('/tensorstore/')
  except Exception:  # pylint: disable=broad-except
    start = None
  return time.time(), start


def io_metrics_end(direction: str, start: tuple[float, Any], logical_bytes: int,
                   directory: str) -> None:
  """Records what stock's ArrayHandler records per save and restore on each host:
  ``/jax/orbax/{write,read}/worker/{total_duration_secs,io/requested/...,io/raw/...,
  io/compression_ratio}`` and their INFO log lines (Orbax's own function, so names, labels and
  wording stay Orbax's). A no-op on an Orbax without it; never raises."""
  import logging  # pylint: disable=g-import-not-at-top
  kind = _telemetry_kind()
  if kind == 'none':
    return
  try:
    _types = src.orbax('serialization.types')
    keyword = 'initial_raw_bytes' if kind == 'raw' else 'initial_ts_metrics'
    _jah._log_io_metrics(_types.IoDirection(direction), logical_bytes, start[0],  # pylint: disable=protected-access
                         epath.Path(directory), **{keyword: start[1]})
  except Exception as e:  # pylint: disable=broad-except
    logging.getLogger('orbax_pathways').debug('Orbax telemetry not recorded: %s', e)
