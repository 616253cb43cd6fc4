"""Every touch of Orbax's private CheckpointManager internals, in one place.

SUPPORTED = ``supported.ORBAX`` (written against 0.12.8). Nothing else in ``orbax_pathways.manager.retention``
or ``orbax_pathways.preemption`` reaches Orbax's private ``_src`` modules (this file does, only
through ``src.py``) or patches Orbax; if an Orbax upgrade breaks something, this file (and its
tests) is where to look.

Patches, each installed by ``install_manager_hooks()`` and restored exactly (the very same
function objects) by ``uninstall_manager_hooks()``; both are idempotent:

- ``StandardCheckpointDeleter._delete_step_permanently(self, step, delete_target)``: the single
  place where a step directory is destroyed (``max_to_keep`` garbage collection, ``mngr.delete``,
  the background deleter; renames to ``todelete_subdir`` / HNS paths are not touched).
- ``_StandardNameFormat._build_metadata(self, step_path, step=None)``: the single check behind
  ``all_steps()``, ``latest_step()``, ``reload()``, ``find_step`` (restore); returning None hides a
  step.
- ``CheckpointManager.__init__``: runs hooks after the stock constructor (leftover cleanup; the
  SIGTERM notice handler, installed lazily by the first manager of a main process whose save
  decision policy saves for preemption: ``orbax_policies.manager_saves_on_preemption``).
- ``CheckpointManager.delete`` (public): marks the user's explicit deletes, which raise on
  failure, unlike garbage collection, which logs.
- ``CheckpointManager.reached_preemption(self, step)``: feeds both ``should_save`` (through the
  ``PreemptionCheckpointingPolicy`` in the default policy) and ``save``'s own preemption logging;
  the hook gets the manager's participants (``manager_participants``), so an agreement runs
  among the processes that call this manager only.
- ``CheckpointManager.save`` (public): for a step Orbax's policy takes (``force`` or
  ``should_save``), the hooks' ``before_save`` (one that raises refuses the
  save: the writer lease, if another job saves into the directory), ``save_error`` when Orbax's
  save raised (the step's name on a storage error), the start time of each step for the commit
  log line, and ``after_save`` (preemption: the notice is consumed once its save started).
  ``CheckpointManager.close`` (public) calls the hooks' ``close`` once it returned or raised
  (the lease is released). A save Orbax's policy declined calls the hooks' ``save_declined``
  with the save's arguments (a local-only step may be saved); ``wait_until_finished`` (public)
  then calls the hooks' ``wait``. (``orbax_manager_state.local_manager`` builds the hidden
  manager of a manager's local-only steps, ``multitier/local_steps.py``.)
- ``CheckpointManager.reload`` / ``restore`` (public): drop gcsfs's listing cache first; a restore
  of a step the manager listed when it began, which fails because the step was deleted meanwhile
  (another process's retention), says so (``StepDeletedError``); any other failure (a step never
  saved, deleted earlier, an empty directory) is Orbax's own error, untouched.
- ``Checkpointer._restore(self, directory, ...)``: a process whose read fails (a damaged chunk it
  alone reads) still joins the ``Checkpointer:restore`` barrier that ends ``restore()`` before
  raising, so the processes that read fine get their result instead of waiting in the barrier
  until it times out (``preemption.resume`` then has every process agree to fall back).
- ``CheckpointManager._finalize(self, step, steps_to_remove)``: drops gcsfs's listing cache
  first (see ``invalidate_gcs_listings``); returns once ``step`` is committed (raises if it was not: re-raised as ``SaveError`` naming ``step``); traced as
  ``orbax_pathways.commit``, then the ``after_commit`` hook logs save()-to-committed time.

The wrappers only dispatch: to the hook objects registered with ``register(hooks)``
(``manager/hooks.ManagerHooks``: its docstring numbers the calls and names their hosts), in
their ``order``. With none registered they call the original, so leaving the patches in place
with no hooks behaves exactly like stock Orbax. Which error a failed save or commit raises,
what a listing hides, what is refused, is the hooks' (``manager/``, ``preemption/``). Two
restore rules still live here, next to the Orbax protocol they follow: ``StepDeletedError`` for
a step deleted while it was restored, and a failed restore joining its peers' barrier.

Next door: ``orbax_manager_state.py`` (what the package reads of a manager: its options,
participants, step paths and listings; the hidden manager of its local-only steps),
``jax_distributed.py`` (process count and index, jax's key-value client, whether its
preemption service runs) and ``orbax_policies.py`` (whether a manager's save decision policy can
save for preemption).
"""

from __future__ import annotations

from orbax_pathways._compat import seam
from orbax_pathways._compat import src
from orbax_pathways._compat import storage_clients
from orbax_pathways._compat import supported

import dataclasses
import functools
import threading
import time
from typing import Any, Callable

from absl import logging
from etils import epath
import jax

import orbax.checkpoint as ocp
_checkpointer = src.orbax('checkpointers.checkpointer')
_multihost = src.orbax('multihost.multihost')
_deleter = src.orbax('path.deleter')
_step_lib = src.orbax('path.step')

from orbax_pathways.format import names as format_lib
from orbax_pathways._compat import orbax_manager_state as _state

SUPPORTED = supported.ORBAX

# One definition of the names (orbax_pathways.format.names; tests/format/test_format.py checks them against
# Orbax's own constants).
TMP_DIR_SUFFIX: str = format_lib.TMP_SUFFIX
COMMIT_SUCCESS_FILE: str = format_lib.COMMIT_SUCCESS_FILE
STEP_METADATA_FILE: str = format_lib.CHECKPOINT_METADATA_FILE


def orbax_version_supported() -> bool:
  """True if the installed orbax-checkpoint is inside ``SUPPORTED``."""
  try:
    parts = tuple(int(p) for p in ocp.__version__.split('.')[:3])
  except ValueError:
    return False
  return (0, 12, 4) <= parts < (0, 13)


# ---------------------------------------------------------------------------------------------
# Hook registry and reversible patches.

_lock = threading.RLock()


class _State:
  """This module's process-wide state (one object: no `global` statement)."""

  hooks: tuple[Any, ...] = ()  # the registered ManagerHooks objects, in their ``order``


_registry = _State()


def register(hooks: Any) -> None:
  """Adds one ``ManagerHooks`` object (idempotent: an object of the same ``name`` is replaced),
  installs the patches (idempotent)."""
  with _lock:
    kept = [h for h in _registry.hooks if h.name != hooks.name]
    _registry.hooks = tuple(sorted(kept + [hooks], key=lambda h: h.order))
  install_manager_hooks()


def unregister(hooks: Any) -> None:
  """Removes the hook object of ``hooks.name``; the patches go once none is left."""
  with _lock:
    _registry.hooks = tuple(h for h in _registry.hooks if h.name != hooks.name)
    if not _registry.hooks:
      uninstall_manager_hooks()


def registered() -> tuple[Any, ...]:
  """The hook objects the patches call, in order."""
  return _registry.hooks


def any_hook_set() -> bool:
  return bool(_registry.hooks)


def _each(method: str, *args: Any) -> None:
  for h in _registry.hooks:
    getattr(h, method)(*args)


def _first(method: str, *args: Any) -> Any:
  """The first answer that is not None (None if every hook passes)."""
  for h in _registry.hooks:
    answer = getattr(h, method)(*args)
    if answer is not None:
      return answer
  return None


def _wrap_delete_step_permanently(original):
  @functools.wraps(original)
  def _delete_step_permanently(self, step, delete_target):
    # The stock PathDeleter (parallel on local disk, gcs_utils on gs://) does the actual removal
    # of whatever path a hook hands it.
    remove = _path_remover(self)
    for h in _registry.hooks:
      if h.delete_step(step, epath.Path(delete_target), remove):
        return None
    return original(self, step, delete_target)
  return _delete_step_permanently


def _path_remover(deleter) -> Callable[[epath.Path], None]:
  """The stock deleter's removal of one directory: ``PathDeleter.delete`` in Orbax >= 0.12.8;
  before, its parallel local deleter, else ``_rmtree`` (``gcs_utils.rmtree`` on gs://)."""
  path_deleter = getattr(deleter, '_path_deleter', None)
  if path_deleter is not None:
    return path_deleter.delete

  def remove(path: epath.Path) -> None:
    parallel = getattr(deleter, '_parallel_deleter', None)
    if parallel is not None and _deleter._is_local_path(path):  # pylint: disable=protected-access
      parallel.delete(path)
    else:
      deleter._rmtree(path)  # pylint: disable=protected-access
  return remove


_StepMetadata: Any = _step_lib.Metadata


@dataclasses.dataclass(frozen=True)
class _PinnedStepMetadata(_StepMetadata):
  """Orbax's step metadata with the commit time read once (see ``_wrap_build_metadata``)."""

  pinned_commit_timestamp: Any = None

  @property
  def commit_timestamp(self):
    return self.pinned_commit_timestamp


def _pinned(metadata: Any, commit_timestamp: Any) -> Any:
  if type(metadata) is not _step_lib.Metadata:  # pylint: disable=unidiomatic-typecheck
    return metadata  # a subclass of Orbax's we do not know how to rebuild: leave it
  fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
  return _PinnedStepMetadata(**fields, pinned_commit_timestamp=commit_timestamp)


def _wrap_build_metadata(original):
  @functools.wraps(original)
  def _build_metadata(self, step_path, step=None):
    if not _registry.hooks:
      return original(self, step_path, step=step)
    try:
      metadata = original(self, step_path, step=step)
      if metadata is None or _first('step_complete', epath.Path(metadata.path)) is False:
        return None
      # Read the commit time now and keep it: a step that retention deletes while a reader lists
      # the directory then drops out of the listing, instead of failing the reader's
      # CheckpointManager construction with FileNotFoundError from a later stat() (Orbax reads
      # the property again, and without a commit timestamp in _CHECKPOINT_METADATA it stats).
      return _pinned(metadata, metadata.commit_timestamp)
    except (FileNotFoundError, NotADirectoryError):
      # Renamed away between two of Orbax's checks (exists() then is_dir()): another process's
      # retention deleted it while we listed.
      return None
  return _build_metadata


def invalidate_gcs_listings() -> None:
  """Drops gcsfs's cached directory listings in this process.

  etils.epath reaches gs:// through gcsfs, which caches listings with no expiry. A process that
  listed a step directory while another process was still writing it (an evaluator polling for
  new steps, a restarted job's reader) would otherwise keep seeing the old listing: new steps stay
  invisible, and ``manifest.ocdbt`` of a since-completed step looks absent, so Orbax takes an
  OCDBT checkpoint for a per-array one and fails ("Individual parameter subdirectory not found").
  Called before every CheckpointManager listing (init, reload) and restore; costs a re-list.
  """
  # None unless gs:// was used in this process. The filesystem etils.epath (hence Orbax) uses is
  # among them: etils keeps its own reference, which may have left fsspec's instance cache.
  for fs in storage_clients.gcs_filesystems():
    fs.invalidate_cache()


def _wrap_fresh_listing(original):
  @functools.wraps(original)
  def fresh(self, *args, **kwargs):
    invalidate_gcs_listings()
    return original(self, *args, **kwargs)
  return fresh


def _wrap_manager_init(original):
  @functools.wraps(original)
  def __init__(self, *args, **kwargs):
    invalidate_gcs_listings()
    original(self, *args, **kwargs)
    _each('manager_init', self)
  return __init__


def _wrap_delete(original):
  @functools.wraps(original)
  def delete(self, step):
    _each('delete_started', self, step)
    try:
      return original(self, step)
    finally:
      _each('delete_ended', self, step)
  return delete


def _wrap_reached_preemption(original):
  @functools.wraps(original)
  def reached_preemption(self, step):
    if not _registry.hooks:
      return original(self, step)
    stock = lambda: original(self, step)  # pylint: disable=unnecessary-lambda-assignment
    answer = _first('reached_preemption', self, step, stock, _state.manager_participants(self))
    return stock() if answer is None else answer
  return reached_preemption


_SAVE_STARTS = '_orbax_pathways_save_starts'  # {step: perf_counter at save()} on the manager


def _wrap_save(original):
  @functools.wraps(original)
  def save(self, step, *args, **kwargs):
    if not _registry.hooks:
      return original(self, step, *args, **kwargs)
    # Orbax's own decision first (it asks it again inside: the preemption answer is latched
    # per step): a step it declines writes nothing, so the hooks that guard a write (the
    # writer lease's round, the wait for a local-only save) do not run for it.
    force = kwargs.get('force', args[3] if len(args) > 3 else False)
    if force or (not _state.manager_read_only(self) and self.should_save(step)):
      _each('before_save', self, step)  # a hook that refuses the save raises: nothing written
      _each('save_args', self, step, args, kwargs)
    self.__dict__.setdefault(_SAVE_STARTS, {})[step] = time.perf_counter()
    try:
      saved = original(self, step, *args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      replacement = _first('save_error', self, step, e)
      if replacement is None:
        raise
      raise replacement from e
    _each('after_save', self, step, saved)
    if saved is False:  # Orbax's own policy declined the step: a hook may save it elsewhere
      _each('save_declined', self, step, args, kwargs)
    return saved
  return save


def _wrap_wait_until_finished(original):
  """``CheckpointManager.wait_until_finished()``, then the hooks' ``wait`` (saves a hook runs
  beside Orbax's: the local-only steps)."""
  @functools.wraps(original)
  def wait_until_finished(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    if _registry.hooks:
      _each('wait', self)
    return out
  return wait_until_finished


def _wrap_close(original):
  """``CheckpointManager.close()`` (also its ``__exit__``), then the ``after_close`` hook (the
  writer lease is released once the manager's commits are done), even if closing raised."""
  @functools.wraps(original)
  def close(self, *args, **kwargs):
    try:
      return original(self, *args, **kwargs)
    finally:
      _each('close', self)
  return close


def _wrap_finalize(original):
  """``CheckpointManager._finalize(step, steps_to_remove)`` runs once the step is committed
  (in Orbax's finalize thread, or inline for synchronous saves); it raises if the commit failed.

  Orbax re-raises a background failure from the *next* ``save()`` (its ``wait_until_finished``),
  so the hooks' ``commit_error`` sees it here, where the step is known."""
  @functools.wraps(original)
  def _finalize(self, step, *args, **kwargs):
    if not any_hook_set():
      return original(self, step, *args, **kwargs)
    # A process that listed the new step's directory on gs:// before tensorstore wrote into it
    # (gcsfs caches listings, and tensorstore's writes do not update them) otherwise fails
    # Orbax's commit with "Checkpoint directory does not exist: <step>/<item>": seen in about
    # half of the first saves of a new step by a fresh process into an existing directory on
    # fake-gcs-server, stock Orbax too (a restarted job).
    invalidate_gcs_listings()
    try:
      with jax.profiler.TraceAnnotation('orbax_pathways.commit', step=step):
        out = original(self, step, *args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      self.__dict__.get(_SAVE_STARTS, {}).pop(step, None)
      replacement = _first('commit_error', self, step, e)
      if replacement is None:
        raise
      raise replacement from e
    t0 = self.__dict__.get(_SAVE_STARTS, {}).pop(step, None)
    if t0 is not None:
      _each('after_commit', self, step, time.perf_counter() - t0)
    return out
  return _finalize


def _wrap_restore(original):
  @functools.wraps(original)
  def restore(self, step, *args, **kwargs):
    invalidate_gcs_listings()
    item_mode: Any = getattr(self, '_default_item', None)  # pylint: disable=protected-access
    undecided = item_mode is not None and item_mode.get() is None
    # Only a step this manager listed when the restore began can have been "deleted while it
    # was being restored"; any other (never saved, deleted earlier by mngr.delete, an empty
    # directory) gets Orbax's own error, untouched.
    listed = step is not None and step in _listed_steps(self)
    try:
      return original(self, step, *args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      if undecided:
        # Orbax decides "single default item or several" from the first restored step's
        # directory and keeps that answer; a step deleted under the restore (another process's
        # retention) makes it answer "several", and every later restore of this manager then
        # fails ("Must provide args of type Composite"). Let the next restore decide again.
        item_mode.set(None)
      if not listed or not _registry.hooks or not _step_vanished(self, step):
        raise
      from orbax_pathways import errors  # pylint: disable=g-import-not-at-top
      raise errors.keeping_type(
          errors.StepDeletedError, e,
          f'Step {step} ({_state.manager_step_path(self, step)}) was deleted while it was being '
          'restored (by the retention of a process saving into this directory, e.g. '
          f'max_to_keep) and is no longer listed: {type(e).__name__}: {str(e)[:500]}. Restore a '
          'step that is still listed (mngr.reload(); mngr.latest_step()).') from e
  return restore


def _listed_steps(mngr) -> set[int]:
  """The steps the manager lists now, from its cached listing (no storage request)."""
  try:
    return set(mngr.all_steps())
  except Exception:  # pylint: disable=broad-except  (a subclass that cannot list: none listed)
    return set()


def _step_vanished(mngr, step: int) -> bool:
  """True if no complete step ``step`` is in ``mngr.directory`` now (read from storage)."""
  try:
    invalidate_gcs_listings()
    return step not in [s for s, _ in _state.manager_steps_on_disk(mngr)]
  except Exception:  # pylint: disable=broad-except
    return False


def _wrap_checkpointer_restore(original):
  @functools.wraps(original)
  def _restore(self, directory, *args, **kwargs):
    try:
      return original(self, directory, *args, **kwargs)
    except Exception:  # pylint: disable=broad-except
      if any_hook_set() and jax.process_count() > 1:
        try:
          _multihost.sync_global_processes(
              _multihost.unique_barrier_key('Checkpointer:restore',
                                            prefix=self._barrier_sync_key_prefix),  # pylint: disable=protected-access
              processes=self._active_processes)  # pylint: disable=protected-access
        except Exception as barrier_error:  # pylint: disable=broad-except
          logging.warning('orbax_pathways: after a failed restore of %s, joining the peers\' '
                          'restore barrier failed too: %s', directory, barrier_error)
      raise
  return _restore


def _patch_targets():
  return (
      (lambda: _deleter.StandardCheckpointDeleter, '_delete_step_permanently',
       _wrap_delete_step_permanently),
      (lambda: _step_lib._StandardNameFormat, '_build_metadata', _wrap_build_metadata),  # pylint: disable=protected-access
      (lambda: ocp.CheckpointManager, '__init__', _wrap_manager_init),
      (lambda: ocp.CheckpointManager, 'reached_preemption', _wrap_reached_preemption),
      (lambda: ocp.CheckpointManager, 'save', _wrap_save),
      (lambda: ocp.CheckpointManager, '_finalize', _wrap_finalize),
      (lambda: ocp.CheckpointManager, 'close', _wrap_close),
      (lambda: ocp.CheckpointManager, 'wait_until_finished', _wrap_wait_until_finished),
      (lambda: ocp.CheckpointManager, 'delete', _wrap_delete),
      (lambda: ocp.CheckpointManager, 'reload', _wrap_fresh_listing),
      (lambda: ocp.CheckpointManager, 'restore', _wrap_restore),
      (lambda: _checkpointer.Checkpointer, '_restore', _wrap_checkpointer_restore),
  )


FEATURE = seam.Feature(
    'the CheckpointManager hooks (the writer lease, safe retention, preemption, local-only '
    'steps, the tier\'s commit)',
    'Orbax has no hook around a manager\'s save, finalize, restore, listing and deletion',
    lambda: [seam.Target(owner, attr, wrap) for owner, attr, wrap in _patch_targets()])


def hooks_installed() -> bool:
  return seam.installed(FEATURE)


def install_manager_hooks() -> None:
  """Installs the wrappers (idempotent; all or none: a missing target leaves Orbax's manager
  stock, with one warning). Hooks decide what they do; see ``register``."""
  with _lock:
    if seam.installed(FEATURE):
      return
    if not orbax_version_supported():
      logging.warning(
          'orbax_pathways: orbax-checkpoint %s is outside the tested range %s; the '
          'CheckpointManager hooks in orbax_pathways/_compat/orbax_manager.py may not apply. '
          'Pin orbax-checkpoint%s or run tests/manager/test_retention.py against this version.',
          ocp.__version__, SUPPORTED, SUPPORTED)
    seam.install(FEATURE)


def uninstall_manager_hooks() -> None:
  """Restores the original attributes (idempotent). Hooks stay registered but are unused."""
  with _lock:
    seam.uninstall(FEATURE)
