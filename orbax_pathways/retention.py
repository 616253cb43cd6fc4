"""Safe deletion of old steps, and listing that never counts an incomplete step.

Why: stock Orbax deletes an old step (``max_to_keep``, ``mngr.delete``) with an in-place ``rmtree``
of the final-named directory ``N``. A kill during that delete leaves a half-deleted ``N`` that
``all_steps()`` still lists and that fails to restore (see docs / research ``torn_checkpoint.md``).

What ``install()`` changes (through ``orbax_pathways._compat.orbax_manager``):

1. **Deletion takes the step out of the listed namespace first, atomically.**

   - Local / POSIX storage: rename ``<dir>/N`` -> ``<dir>/N.orbax-pathways-deleting-<hex>`` (one
     ``rename(2)`` in the same directory), then remove the renamed tree with Orbax's own deleter.
     Orbax never lists that name: the step regex is anchored (``^prefix_?(0|[1-9]\\d*)$``), the
     name has no ``.orbax-checkpoint-tmp`` so it is not a temporary of step N (nor removed by
     ``cleanup_tmp_directories``), and it has no ``_`` so legacy ``checkpoint_steps`` ignores it.
     If the rename fails we fall back to "markers first" (below) and log why.
   - gs:// (no atomic directory rename): delete ``N/commit_success.txt`` first, which on gs:// is
     what makes a step committed, then ``N/_CHECKPOINT_METADATA``, then the rest.
   - Leftover ``*.orbax-pathways-deleting-*`` directories (a kill mid-rmtree) are removed when a
     CheckpointManager is constructed, on its primary host, and by ``preemption.resume``.

2. **A listed step must be complete** (``is_step_complete``). Besides Orbax's own rule (final
   name locally; ``commit_success.txt`` on gs://), a local step directory counts only if it holds

       ``commit_success.txt``  OR  ``_CHECKPOINT_METADATA`` with an integer ``commit_timestamp_nsecs``.

   Stock Orbax >= 0.12.2 writes both (commit marker last, just before the rename). Orbax 0.11.x to
   0.12.1 wrote only ``_CHECKPOINT_METADATA`` with a commit timestamp, so those steps stay listed.
   Steps written by much older Orbax (no step metadata at all) are *not* listed: we log a warning
   naming the directory and saying to create ``commit_success.txt`` in it if it is known complete
   (or call ``install(accept_unmarked_steps=True)``). This rule is defense in depth (it hides a
   step torn by a stock delete once both markers are gone); the rename in (1) is the real fix,
   because a stock rmtree removes files in directory-hash order, not markers first.
"""

from __future__ import annotations

import threading
import uuid

from absl import logging
from etils import epath

from orbax_pathways._compat import orbax_manager as _om

DELETING_MARKER = '.orbax-pathways-deleting-'

_state_lock = threading.Lock()
_installed = False
_accept_unmarked = False
_warned_unmarked: set[str] = set()


# ---------------------------------------------------------------------------------------------
# The completeness rule.


def is_step_complete(step_path: epath.PathLike) -> bool:
  """True if ``step_path`` (a final-named step directory) is a complete, committed step.

  See the module docstring for the rule. Does not check the directory name; Orbax does that.
  """
  step_path = epath.Path(step_path)
  if DELETING_MARKER in step_path.name:
    return False
  if (step_path / _om.COMMIT_SUCCESS_FILE).exists():
    return True
  if _om.is_gcs_path(step_path):
    return False  # On gs:// the commit marker is the only proof of a commit.
  if _om.read_commit_timestamp_nsecs(step_path) is not None:
    return True
  if _accept_unmarked and not (step_path / _om.STEP_METADATA_FILE).exists():
    return True
  key = str(step_path)
  if key not in _warned_unmarked:
    _warned_unmarked.add(key)
    logging.warning(
        'orbax_pathways: ignoring step directory %s: it has neither %s nor a commit timestamp in '
        '%s, so it is an incomplete or half-deleted step. If it is a complete checkpoint written '
        'by an old Orbax version, create %s/%s to list it again; otherwise delete the directory.',
        step_path, _om.COMMIT_SUCCESS_FILE, _om.STEP_METADATA_FILE, step_path,
        _om.COMMIT_SUCCESS_FILE)
  return False


# ---------------------------------------------------------------------------------------------
# Safe deletion.


def deleting_name(step_dir_name: str) -> str:
  return f'{step_dir_name}{DELETING_MARKER}{uuid.uuid4().hex}'


def _remove_markers_first(step_path: epath.Path) -> None:
  # commit_success.txt first: on gs:// it alone makes the step committed; locally the step is
  # unlisted once both markers are gone (see is_step_complete).
  for name in (_om.COMMIT_SUCCESS_FILE, _om.STEP_METADATA_FILE):
    marker = step_path / name
    try:
      marker.unlink()
    except FileNotFoundError:
      pass


def safe_delete_step(step_path: epath.PathLike, remove_tree=None) -> None:
  """Deletes one step directory so that no reader ever sees it half-deleted.

  Args:
    step_path: the step directory (final name).
    remove_tree: callable removing a directory tree; default ``epath.Path.rmtree``. Inside the
      CheckpointManager hook this is Orbax's PathDeleter (parallel locally, batched on gs://).
  """
  step_path = epath.Path(step_path)
  remove_tree = remove_tree or (lambda p: epath.Path(p).rmtree())
  if _om.TMP_DIR_SUFFIX in step_path.name or DELETING_MARKER in step_path.name:
    remove_tree(step_path)  # never listed anyway
    return
  if _om.is_local_path(step_path):
    target = step_path.parent / deleting_name(step_path.name)
    try:
      step_path.rename(target)
    except OSError as e:
      logging.warning(
          'orbax_pathways: could not rename %s to %s before deleting it (%s); deleting its commit '
          'markers first instead.', step_path, target, e)
      _remove_markers_first(step_path)
      remove_tree(step_path)
      return
    logging.info('orbax_pathways: renamed %s to %s; removing it.', step_path, target.name)
    remove_tree(target)
  else:
    _remove_markers_first(step_path)
    remove_tree(step_path)


def _delete_step_hook(step: int, delete_target: epath.Path, remove_tree) -> None:
  del step
  safe_delete_step(delete_target, remove_tree)


def leftover_deleting_dirs(directory: epath.PathLike) -> list[epath.Path]:
  directory = epath.Path(directory)
  if not directory.exists():
    return []
  return sorted(p for p in directory.iterdir() if DELETING_MARKER in p.name)


def cleanup_leftovers(directory: epath.PathLike) -> list[epath.Path]:
  """Removes ``*.orbax-pathways-deleting-*`` directories left by a kill; returns them.

  Call on one host only (the CheckpointManager hook and ``resume`` use the primary host).
  """
  removed = []
  for path in leftover_deleting_dirs(directory):
    try:
      path.rmtree() if path.is_dir() else path.unlink()
      removed.append(path)
    except FileNotFoundError:
      pass
    except OSError as e:
      logging.warning('orbax_pathways: could not remove leftover %s (%s); remove it by hand.',
                      path, e)
  if removed:
    logging.info('orbax_pathways: removed leftover deleted steps: %s', removed)
  return removed


def _manager_init_hook(mngr) -> None:
  try:
    if getattr(mngr, '_options', None) is not None and mngr._options.read_only:  # pylint: disable=protected-access
      return
    if _om.is_primary_host(_om.manager_primary_host(mngr)):
      cleanup_leftovers(mngr.directory)
  except Exception as e:  # pylint: disable=broad-except
    # Never fail a manager construction over garbage collection.
    logging.warning('orbax_pathways: leftover cleanup in %s failed: %s', mngr.directory, e)


# ---------------------------------------------------------------------------------------------
# Activation.


def install(*, accept_unmarked_steps: bool = False) -> None:
  """Activates safe deletion and strict listing for every CheckpointManager (idempotent)."""
  global _installed, _accept_unmarked
  with _state_lock:
    _accept_unmarked = accept_unmarked_steps
    _om.set_hook('delete_step', _delete_step_hook)
    _om.set_hook('step_complete', is_step_complete)
    _om.set_hook('manager_init', _manager_init_hook)
    _om.install_manager_hooks()
    _installed = True


def uninstall() -> None:
  """Back to stock Orbax behaviour for deletion and listing (idempotent)."""
  global _installed, _accept_unmarked
  with _state_lock:
    _om.set_hook('delete_step', None)
    _om.set_hook('step_complete', None)
    _om.set_hook('manager_init', None)
    _accept_unmarked = False
    if not _om.any_hook_set():
      _om.uninstall_manager_hooks()
    _installed = False


def installed() -> bool:
  return _installed
