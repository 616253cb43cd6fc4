"""What the package reads of an Orbax ``CheckpointManager`` and its directory (private state,
step paths and listings), and the hidden manager of its local-only steps.

SUPPORTED = ``supported.ORBAX``, as ``orbax_manager.py`` (the patches that run the package's
hooks inside Orbax's ``CheckpointManager``): both reach Orbax's private ``_src`` modules only
through ``src.py``. Callers: ``manager/`` (retention, the writer lease, local-only steps, the
emergency manager), ``preemption/`` and ``orbax_manager.py``'s own wrappers, on every process
that calls the manager; nothing here writes to storage or changes the manager's behaviour,
except ``forget_step`` (the manager's cached listing) and ``local_manager`` (builds the hidden
manager once). Orbax v1's ``training.Checkpointer``: ``orbax_v1_training.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Callable

from etils import epath
import jax
import orbax.checkpoint as ocp

from orbax_pathways._compat import src
from orbax_pathways.coord import participants as participants_lib
from orbax_pathways.format import names as format_lib

_composite = src.orbax('handlers.composite_checkpoint_handler')
_deleter = src.orbax('path.deleter')
_gcs_utils = src.orbax('path.gcs_utils')
_multihost = src.orbax('multihost.multihost')
_step_lib = src.orbax('path.step')
_temporary_paths = src.orbax('path.temporary_paths')

STEP_METADATA_FILE: str = format_lib.CHECKPOINT_METADATA_FILE


def is_gcs_path(path: epath.PathLike) -> bool:
  return _gcs_utils.is_gcs_path(epath.Path(path))


def is_local_path(path: epath.PathLike) -> bool:
  return _deleter._is_local_path(epath.Path(path))  # pylint: disable=protected-access


def manager_read_only(mngr: ocp.CheckpointManager) -> bool:
  """Whether the manager was built with ``CheckpointManagerOptions(read_only=True)``."""
  options = getattr(mngr, '_options', None)  # pylint: disable=protected-access
  return bool(options is not None and options.read_only)


def manager_primary_host(mngr: ocp.CheckpointManager) -> int | None:
  return mngr._multiprocessing_options.primary_host  # pylint: disable=protected-access


_PARTICIPANTS = '_orbax_pathways_participants'


def manager_participants(mngr: ocp.CheckpointManager) -> participants_lib.Participants:
  """The processes that call ``mngr`` (its ``MultiprocessingOptions``: ``active_processes``,
  ``primary_host``, ``barrier_sync_key_prefix``), built once per manager. A manager without
  Orbax's options (a stand-in) counts as every process, primary host 0."""
  found = mngr.__dict__.get(_PARTICIPANTS)
  if found is None:
    options = getattr(mngr, '_multiprocessing_options', None)  # pylint: disable=protected-access
    found = participants_lib.Participants.of(
        getattr(options, 'active_processes', None), getattr(options, 'primary_host', 0),
        getattr(options, 'barrier_sync_key_prefix', None))
    mngr.__dict__[_PARTICIPANTS] = found
  return found


def process_index() -> int:
  """This process's index as Orbax numbers processes in ``active_processes`` and
  ``primary_host`` (jax.distributed's process id under
  ``experimental_orbax_use_distributed_process_id``, else ``jax.process_index()``)."""
  return _multihost.process_index()


def is_primary_host(primary_host: int | None) -> bool:
  return _multihost.is_primary_host(primary_host)


def manager_step_path(mngr: ocp.CheckpointManager, step: int) -> epath.Path:
  """The final (committed) directory of ``step`` for this manager's name format."""
  return _step_lib.build_step_path(mngr.directory, mngr._step_name_format, step)  # pylint: disable=protected-access


def manager_steps_on_disk(mngr: ocp.CheckpointManager) -> list[tuple[int, epath.Path]]:
  """(step, path) for every step the manager's name format lists right now, read from storage."""
  return sorted(
      (m.step, epath.Path(m.path))
      for m in mngr._step_name_format.find_all(mngr.directory))  # pylint: disable=protected-access


def read_commit_timestamp_nsecs(step_path: epath.Path) -> int | None:
  """``commit_timestamp_nsecs`` from ``<step>/_CHECKPOINT_METADATA``, or None if absent/unreadable."""
  try:
    data = json.loads((step_path / STEP_METADATA_FILE).read_text())
  except (OSError, ValueError):
    return None
  value = data.get('commit_timestamp_nsecs') if isinstance(data, dict) else None
  return value if isinstance(value, int) else None


def temporary_step_paths(directory: epath.PathLike) -> list[epath.Path]:
  """Orbax's uncommitted steps in ``directory``: ``*.orbax-checkpoint-tmp`` locally, step
  directories without ``commit_success.txt`` on gs:// (Orbax's own rule)."""
  asyncio_utils = src.orbax('asyncio_utils')
  paths = asyncio_utils.run_sync(_temporary_paths.all_temporary_paths(directory))
  return sorted(epath.Path(p.get()) for p in paths)


def discard_unfinished_local_steps(inner: ocp.CheckpointManager) -> None:
  """Removes the uncommitted step directories of the hidden manager ``inner`` (a failed
  local-only save's ``<step>.orbax-checkpoint-tmp``, or on gs:// a step directory without
  ``commit_success.txt``), with Orbax's own clean-up, on its primary host only (the one that
  creates them). Called by ``multitier/local_steps.py`` once a local-only save failed, while no
  other save of ``inner`` runs (one at a time per process): without it every failed local
  save (a tier refused on every node, say) left one in storage until the job's end. Best
  effort: a failure to list or remove is logged at debug level and left to the next call."""
  options = inner._options  # pylint: disable=protected-access
  asyncio_utils = src.orbax('asyncio_utils')
  try:
    asyncio_utils.run_sync(_temporary_paths.cleanup_temporary_paths(
        inner.directory, multiprocessing_options=options.multiprocessing_options,
        temporary_path_cls=options.temporary_path_class,
        atomicity_options=getattr(options, 'atomicity_options', None)))
  except Exception as e:  # pylint: disable=broad-except  (best effort)
    logging.getLogger('orbax_pathways').debug(
        'orbax_pathways: removing unfinished local-only steps in %s failed: %s', inner.directory, e)


def forget_step(mngr: ocp.CheckpointManager, step: int) -> None:
  """Drops ``step`` from ``mngr``'s cached listing (nothing on storage changes): ``should_save``
  and ``save`` then treat it as absent, and saving that step again replaces it."""
  mngr._checkpoints.delete_if(lambda info: info.step == step)  # pylint: disable=protected-access


# ---- the hidden manager of a manager's local-only steps (multitier/local_steps.py) ---------------

_LOCAL = '_orbax_pathways_local_manager'  # on a manager: the hidden manager of its local steps
_LOCAL_OF = '_orbax_pathways_local_of'  # on a hidden manager: the manager it serves


def local_manager(mngr: ocp.CheckpointManager, directory: epath.PathLike, keep: int,
                  wrap_deleter: Callable[[Any, epath.Path, bool, float], Any] | None = None
                  ) -> ocp.CheckpointManager:
  """The hidden manager of ``mngr``'s local-only steps (built at its first local save, then
  kept): ``directory``, one step per save it is asked for, the newest ``keep`` kept, the same
  processes (``MultiprocessingOptions``, with barrier names of its own, the processes named so
  that its barriers are key-value ones: ``multitier/local_steps.py`` runs its saves on a
  background thread), async mode, step names, read-only mode and handlers (``handlers_of``)
  as ``mngr``. Its saves go through Orbax's own save and commit; only the array handler knows
  the directory is a local-only one (``format.names.is_local_only``). ``wrap_deleter(orbax's
  deleter, directory, this process deletes, timeout_s)``: the deleter it uses instead
  (``multitier/trailing_deleter.TrailingDeleter``)."""
  found = mngr.__dict__.get(_LOCAL)
  if found is not None:
    return found
  options = mngr._options  # pylint: disable=protected-access
  mp = options.multiprocessing_options
  active = mp.active_processes
  if active is None and jax.process_count() > 1:
    # Every process, named: Orbax's barriers are then the key-value store's (not a collective
    # over the devices, which only the training loop's thread may launch), so its saves can
    # run on a background thread. Orbax creates no root directory for named processes.
    active = set(range(jax.process_count()))
  if active is not None and not options.read_only:
    epath.Path(directory).mkdir(parents=True, exist_ok=True)
  inner_options = ocp.CheckpointManagerOptions(
      save_interval_steps=1, max_to_keep=keep,
      create=not options.read_only and active is None,
      read_only=options.read_only,
      enable_async_checkpointing=options.enable_async_checkpointing,
      # Its own barrier names: its barriers never meet the manager's.
      multiprocessing_options=dataclasses.replace(
          mp, active_processes=active,
          barrier_sync_key_prefix=(mp.barrier_sync_key_prefix or '') + 'orbax_pathways_local'),
      step_name_format=options.step_name_format,
      async_options=options.async_options,
      file_options=_local_file_options(options.file_options))
  # The manager's own handlers (its settings, its custom handlers); the rest, as for a manager
  # built without item handlers, from the save's arguments.
  inner = ocp.CheckpointManager(directory, options=inner_options,
                                handler_registry=handlers_of(mngr))
  if wrap_deleter is not None:  # the hidden manager's retention (``multitier/trailing_deleter``)
    timeout = getattr(options.async_options, 'timeout_secs', None) or _DEFAULT_TIMEOUT_S
    inner._checkpoint_deleter = wrap_deleter(  # pylint: disable=protected-access
        inner._checkpoint_deleter, epath.Path(directory),  # pylint: disable=protected-access
        mp.primary_host is None or is_primary_host(mp.primary_host), float(timeout))
  inner.__dict__[_LOCAL_OF] = mngr
  mngr.__dict__[_LOCAL] = inner
  return inner


_METRICS_ITEM = 'metrics'  # Orbax's CheckpointManager's own item (its metrics handler)


def handlers_of(mngr: ocp.CheckpointManager) -> Any:
  """A handler registry holding the very handler objects ``mngr`` holds, per item and argument
  type: those of its ``item_handlers`` or ``handler_registry``, and any Orbax registered for it
  lazily before this call. So a local-only step is saved and restored by the handlers its
  storage steps are: their settings (``StandardCheckpointHandler(use_ocdbt=False)``,
  ``use_zarr3``) hold for it, and a custom handler whose arguments have no global registration
  is found. Left out: Orbax's metrics item (the hidden manager makes its own) and legacy
  wrappers of handlers without registered arguments. An item or argument type not in it is
  resolved from the save's arguments, as for a manager built without item handlers.

  The objects are shared, never used at once: a process runs one save at a time across the
  manager and its hidden manager (``multitier/local_steps.py``); Orbax's PyTree handlers hold no
  barrier of their own (of their process options they read only the primary host); and
  arguments of a handler that ``multitier/local_detach.py`` cannot copy (a custom one) are saved
  in the training loop's thread, not the background. Node steps (``multitier/node_loop_items``)
  take from it the synchronous handler of an item saved in the loop's thread."""
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  checkpointer = getattr(mngr, '_checkpointer', None)  # pylint: disable=protected-access
  composite = getattr(checkpointer, 'handler', None)
  own = getattr(composite, '_handler_registry', None)  # pylint: disable=protected-access
  if own is None:
    return registry
  legacy = tuple(t for t in (getattr(_composite, '_WrapperArgs', None),
                             getattr(_composite, '_AsyncWrapperArgs', None)) if t is not None)
  for (item, args_type), handler in own.get_all_entries().items():
    if item == _METRICS_ITEM or (legacy and args_type in legacy) or handler is None:
      continue
    registry.add(item, args_type, handler)
  return registry


def _local_file_options(user: Any) -> Any:
  """The hidden manager's ``FileOptions``: the user's ``path_permission_mode``, and
  ``skip_sync_file_validations`` where this Orbax has it. With it, Orbax's save does not ask
  storage whether the step directory exists before it creates it (``force`` removing it if so);
  its directory creation asks the same question a moment later and removes an unfinished
  directory it finds (a rolled-back run's, a failed save's), and the hidden manager refuses a
  step it lists, as any manager does. So the check is a repeat: on gs:// two round trips one
  after another in every local-only save's commit, for nothing."""
  fields = {f.name for f in dataclasses.fields(ocp.options.FileOptions)}
  kwargs: dict[str, Any] = {}
  if user is not None and getattr(user, 'path_permission_mode', None) is not None:
    kwargs['path_permission_mode'] = user.path_permission_mode
  if 'skip_sync_file_validations' in fields:
    kwargs['skip_sync_file_validations'] = True
  return ocp.options.FileOptions(**kwargs)


_DEFAULT_TIMEOUT_S = 600.0  # Orbax's AsyncOptions.timeout_secs default


def deleter_of(inner: Any) -> Any:
  """The step deleter of the manager ``inner`` (Orbax's, or what ``local_manager`` put there)."""
  return getattr(inner, '_checkpoint_deleter', None)


def existing_local_manager(mngr: ocp.CheckpointManager) -> ocp.CheckpointManager | None:
  """``mngr``'s hidden manager if a local save built one, else None."""
  return mngr.__dict__.get(_LOCAL)


def mark_node_manager(node: ocp.CheckpointManager, served: ocp.CheckpointManager) -> None:
  """``node`` keeps ``served``'s node steps on this process (``multitier/node_steps.py``): the
  package's hooks treat it as they treat a hidden manager (it saves no local-only steps of its
  own and never consumes a preemption notice)."""
  node.__dict__[_LOCAL_OF] = served


def is_local_manager(mngr: Any) -> bool:
  """Whether ``mngr`` is a hidden manager of local-only steps."""
  return _LOCAL_OF in getattr(mngr, '__dict__', {})
