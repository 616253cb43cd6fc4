"""Every touch of Orbax's private CheckpointManager internals, in one place.

SUPPORTED = '>=0.12.4,<0.13' (written against 0.12.8). Nothing else in ``orbax_pathways.retention``
or ``orbax_pathways.preemption`` imports ``orbax.checkpoint._src`` or patches Orbax; if an Orbax
upgrade breaks something, this file (and its tests) is where to look.

Patches, each installed by ``install_manager_hooks()`` and restored exactly (the very same
function objects) by ``uninstall_manager_hooks()``; both are idempotent:

- ``StandardCheckpointDeleter._delete_step_permanently(self, step, delete_target)``: the single
  place where a step directory is destroyed (``max_to_keep`` garbage collection, ``mngr.delete``,
  the background deleter; renames to ``todelete_subdir`` / HNS paths are not touched).
- ``_StandardNameFormat._build_metadata(self, step_path, step=None)``: the single check behind
  ``all_steps()``, ``latest_step()``, ``reload()``, ``find_step`` (restore); returning None hides a
  step.
- ``CheckpointManager.__init__``: runs a hook after the stock constructor (leftover cleanup).
- ``CheckpointManager.reached_preemption(self, step)``: feeds both ``should_save`` (through the
  ``PreemptionCheckpointingPolicy`` in the default policy) and ``save``'s own preemption logging.
- ``CheckpointManager.save`` (public): the re-registration check before, storage errors named
  after, and the start time of each step for the commit log line.
- ``CheckpointManager.reload`` / ``restore`` (public): drop gcsfs's listing cache first.
- ``CheckpointManager._finalize(self, step, steps_to_remove)``: returns once ``step`` is
  committed (raises if it was not); traced as ``orbax_pathways.commit``, then the
  ``after_commit`` hook logs save()-to-committed time.

The wrappers dispatch to hooks set with ``set_hook(name, fn)``; with no hook set they call the
original, so leaving the patches in place with no hooks behaves exactly like stock Orbax.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import threading
import time
from typing import Any, Callable

from absl import logging
from etils import epath
import jax

import orbax.checkpoint as ocp
from orbax.checkpoint._src.multihost import multihost as _multihost
from orbax.checkpoint._src.path import atomicity_types as _atomicity_types
from orbax.checkpoint._src.path import deleter as _deleter
from orbax.checkpoint._src.path import gcs_utils as _gcs_utils
from orbax.checkpoint._src.path import step as _step_lib
from orbax.checkpoint._src.path import temporary_paths as _temporary_paths

SUPPORTED = '>=0.12.4,<0.13'

TMP_DIR_SUFFIX: str = _atomicity_types.TMP_DIR_SUFFIX  # '.orbax-checkpoint-tmp'
COMMIT_SUCCESS_FILE: str = _atomicity_types.COMMIT_SUCCESS_FILE  # 'commit_success.txt'
STEP_METADATA_FILE = '_CHECKPOINT_METADATA'

HOOK_NAMES = ('delete_step', 'step_complete', 'manager_init', 'reached_preemption', 'before_save',
              'after_commit')


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
_hooks: dict[str, Callable[..., Any] | None] = {name: None for name in HOOK_NAMES}


@dataclasses.dataclass
class _Patch:
  owner: Any
  attr: str
  original: Any  # exactly what was in owner.__dict__[attr]
  replacement: Any


_installed: list[_Patch] = []


def set_hook(name: str, fn: Callable[..., Any] | None) -> None:
  """Sets (or with None clears) one hook; the patches call it while installed."""
  if name not in _hooks:
    raise ValueError(f'Unknown hook {name!r}; known hooks: {HOOK_NAMES}.')
  with _lock:
    _hooks[name] = fn


def get_hook(name: str) -> Callable[..., Any] | None:
  return _hooks[name]


def any_hook_set() -> bool:
  return any(fn is not None for fn in _hooks.values())


def _wrap_delete_step_permanently(original):
  @functools.wraps(original)
  def _delete_step_permanently(self, step, delete_target):
    hook = _hooks['delete_step']
    if hook is None:
      return original(self, step, delete_target)
    # The stock PathDeleter (parallel on local disk, gcs_utils on gs://) does the actual removal
    # of whatever path the hook hands it.
    return hook(step, epath.Path(delete_target), _path_remover(self))
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


def _wrap_build_metadata(original):
  @functools.wraps(original)
  def _build_metadata(self, step_path, step=None):
    metadata = original(self, step_path, step=step)
    hook = _hooks['step_complete']
    if metadata is None or hook is None:
      return metadata
    if not hook(epath.Path(metadata.path)):
      return None
    try:
      # Read (and cache) the commit time now: a step that retention renames away while a reader
      # lists the directory then drops out of the listing, instead of failing the reader's
      # CheckpointManager construction with FileNotFoundError from a later stat().
      metadata.commit_timestamp  # pylint: disable=pointless-statement
    except FileNotFoundError:
      return None
    return metadata
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
  gcsfs = sys.modules.get('gcsfs')
  if gcsfs is None:
    return  # gs:// never used in this process
  # The filesystem etils.epath (hence Orbax) uses; etils keeps its own reference, which may have
  # left fsspec's instance cache.
  instances = [epath.backend.fsspec_backend.fs('gs://bucket/')]
  pending = [gcsfs.GCSFileSystem]
  while pending:
    cls = pending.pop()
    pending.extend(cls.__subclasses__())
    instances.extend(getattr(cls, '_cache', {}).values())
  for fs in {id(fs): fs for fs in instances}.values():
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
    hook = _hooks['manager_init']
    if hook is not None:
      hook(self)
  return __init__


def _wrap_reached_preemption(original):
  @functools.wraps(original)
  def reached_preemption(self, step):
    hook = _hooks['reached_preemption']
    if hook is None:
      return original(self, step)
    return hook(step, lambda: original(self, step))
  return reached_preemption


_SAVE_STARTS = '_orbax_pathways_save_starts'  # {step: perf_counter at save()} on the manager


def _wrap_save(original):
  @functools.wraps(original)
  def save(self, step, *args, **kwargs):
    hook = _hooks['before_save']
    if hook is None:
      return original(self, step, *args, **kwargs)
    hook(self, step)
    self.__dict__.setdefault(_SAVE_STARTS, {})[step] = time.perf_counter()
    try:
      return original(self, step, *args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      if not _is_storage_error(e):
        raise
      from orbax_pathways import errors  # pylint: disable=g-import-not-at-top
      raise errors.SaveError(
          f'Saving step {step} to {manager_step_path(self, step)} failed in storage: '
          f'{type(e).__module__}.{type(e).__name__}: {e}. Earlier steps are untouched; the step '
          'is not committed.') from e
  return save


def _wrap_finalize(original):
  """``CheckpointManager._finalize(step, steps_to_remove)`` runs once the step is committed
  (in Orbax's finalize thread, or inline for synchronous saves); it raises if the commit failed."""
  @functools.wraps(original)
  def _finalize(self, step, *args, **kwargs):
    hook = _hooks['after_commit']
    if hook is None:
      return original(self, step, *args, **kwargs)
    with jax.profiler.TraceAnnotation('orbax_pathways.commit', step=step):
      out = original(self, step, *args, **kwargs)
    t0 = self.__dict__.get(_SAVE_STARTS, {}).pop(step, None)
    if t0 is not None:
      hook(self, step, time.perf_counter() - t0)
    return out
  return _finalize


_STORAGE_ERROR_MODULES = ('gcsfs', 'aiohttp', 'google', 'requests', 'fsspec')


def _is_storage_error(e: BaseException) -> bool:
  return isinstance(e, OSError) or type(e).__module__.split('.')[0] in _STORAGE_ERROR_MODULES


def _patch_targets():
  return (
      (_deleter.StandardCheckpointDeleter, '_delete_step_permanently',
       _wrap_delete_step_permanently),
      (_step_lib._StandardNameFormat, '_build_metadata', _wrap_build_metadata),  # pylint: disable=protected-access
      (ocp.CheckpointManager, '__init__', _wrap_manager_init),
      (ocp.CheckpointManager, 'reached_preemption', _wrap_reached_preemption),
      (ocp.CheckpointManager, 'save', _wrap_save),
      (ocp.CheckpointManager, '_finalize', _wrap_finalize),
      (ocp.CheckpointManager, 'reload', _wrap_fresh_listing),
      (ocp.CheckpointManager, 'restore', _wrap_fresh_listing),
  )


def hooks_installed() -> bool:
  return bool(_installed)


def install_manager_hooks() -> None:
  """Installs the wrappers (idempotent). Hooks decide what they do; see ``set_hook``."""
  with _lock:
    if _installed:
      return
    if not orbax_version_supported():
      logging.warning(
          'orbax_pathways: orbax-checkpoint %s is outside the tested range %s; the '
          'CheckpointManager hooks in orbax_pathways/_compat/orbax_manager.py may not apply. '
          'Pin orbax-checkpoint%s or run tests/test_retention.py against this version.',
          ocp.__version__, SUPPORTED, SUPPORTED)
    for owner, attr, wrap in _patch_targets():
      if attr not in owner.__dict__:
        raise RuntimeError(
            f'orbax_pathways: {owner.__module__}.{owner.__qualname__}.{attr} not found in '
            f'orbax-checkpoint {ocp.__version__} (supported {SUPPORTED}). Install a supported '
            'orbax-checkpoint version.')
    for owner, attr, wrap in _patch_targets():
      original = owner.__dict__[attr]
      replacement = wrap(original)
      setattr(owner, attr, replacement)
      _installed.append(_Patch(owner, attr, original, replacement))


def uninstall_manager_hooks() -> None:
  """Restores the original attributes (idempotent). Hooks stay registered but are unused."""
  with _lock:
    while _installed:
      patch = _installed.pop()
      if patch.owner.__dict__.get(patch.attr) is not patch.replacement:
        logging.warning(
            'orbax_pathways: %s.%s was re-patched by someone else after us; restoring the '
            'Orbax original anyway.', patch.owner.__qualname__, patch.attr)
      setattr(patch.owner, patch.attr, patch.original)


# ---------------------------------------------------------------------------------------------
# Small accessors for private state / helpers.


def is_gcs_path(path: epath.PathLike) -> bool:
  return _gcs_utils.is_gcs_path(epath.Path(path))


def is_local_path(path: epath.PathLike) -> bool:
  return _deleter._is_local_path(epath.Path(path))  # pylint: disable=protected-access


def manager_primary_host(mngr: ocp.CheckpointManager) -> int | None:
  return mngr._multiprocessing_options.primary_host  # pylint: disable=protected-access


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


def cleanup_temporary_paths(directory: epath.Path, primary_host: int | None) -> None:
  """Orbax's own cleanup of uncommitted ``*.orbax-checkpoint-tmp`` (or unmarked gs://) steps."""
  from orbax.checkpoint._src import asyncio_utils  # pylint: disable=g-import-not-at-top
  asyncio_utils.run_sync(_temporary_paths.cleanup_temporary_paths(
      directory,
      multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=primary_host)))


# --- JAX multi-controller plumbing used by preemption agreement. ---


def process_count() -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_count()


def process_index() -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index()


def distributed_client():
  """JAX's coordination-service client (None outside ``jax.distributed``)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


def jax_preemption_service_active() -> bool:
  """True if JAX's preemption sync manager runs (jax.distributed with the service enabled)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return (distributed.global_state.client is not None
          and distributed.global_state.preemption_sync_manager is not None)


def is_proxy_pathways_backend() -> bool:
  return _multihost.is_proxy_pathways_backend()
