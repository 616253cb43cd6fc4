"""Safe deletion of old steps, and listing that never counts an incomplete step.

Why: stock Orbax deletes an old step (``max_to_keep``, ``mngr.delete``) with an in-place ``rmtree``
of the final-named directory ``N``. A kill during that delete leaves a half-deleted ``N`` that
``all_steps()`` still lists and that fails to restore (see docs / research ``torn_checkpoint.md``).

What ``install()`` changes (through ``orbax_pathways._compat.orbax_manager``):

1. **Deletion takes the step out of the listed namespace first, atomically.**

   - Local / POSIX storage: rename ``<dir>/N`` -> ``<dir>/N.orbax-pathways-deleting-<owner>``
     (one ``rename(2)`` in the same directory; ``<owner>`` below), then remove the renamed tree
     with Orbax's own deleter.
     Orbax never lists that name: the step regex is anchored (``^prefix_?(0|[1-9]\\d*)$``), the
     name has no ``.orbax-checkpoint-tmp`` so it is not a temporary of step N (nor removed by
     ``cleanup_tmp_directories``), and it has no ``_`` so legacy ``checkpoint_steps`` ignores it.
     If the rename fails we fall back to "markers first" (below) and log why.
   - gs:// (no atomic directory rename): delete ``N/commit_success.txt`` first, which on gs:// is
     what makes a step committed, then ``N/_CHECKPOINT_METADATA``, then the rest.
   - The deleter tolerates files that vanish under it (another process removing the same
     leftover), and a deletion that fails anyway is logged with the step and its path instead of
     failing the next ``save()``: the step whose commit triggered the deletion is committed, and
     raising would make Orbax forget it (listed on disk, never garbage-collected again).
     ``mngr.delete(step)`` called by the user still raises.

   Called by the primary host's garbage collection and ``mngr.delete`` (in Orbax's finalize or
   background-delete thread, or the user's thread).

   Leftovers of interrupted deletes are removed only when **provably abandoned**, because readers
   (an evaluator constructing its own CheckpointManager, ``preemption.resume`` in a second job)
   must never delete a trainer's work in progress. The deleting name records its owner:
   ``N.orbax-pathways-deleting-<host>-<pid>-<start>-<created>-<rand>`` (``host``: a hash of the
   host name, boot id and PID namespace; ``start``: the owner's start time in clock ticks since
   boot, 0 where unknown; ``created``: Unix seconds). A leftover is abandoned when its owner is
   on this host and that process is gone (or the PID now belongs to a younger process), when this
   process owns it but no delete of it is running here, or when it is older than
   ``abandoned_after_s`` (default 1 hour: owners on other hosts, names of unknown format by
   their mtime). Orbax temporary steps (``N.orbax-checkpoint-tmp``; on gs:// a step directory
   without ``commit_success.txt``) are removed by ``preemption.resume`` only when nothing inside
   them changed for ``abandoned_after_s`` (Orbax fails a save after 20 minutes anyway). Both run
   on the primary host of a CheckpointManager that is not read-only: at construction (leftovers)
   and in ``resume`` (both).

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

import dataclasses
import errno
import os
import re
import shutil
import sys
import threading
import time
import uuid
from typing import Any, ClassVar

from absl import logging
from etils import epath

from orbax_pathways.manager import hooks as hooks_lib
from orbax_pathways.manager import processes as proc_lib
from orbax_pathways._compat import orbax_manager as _om
from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways.tier import store as tier_store

DELETING_MARKER = '.orbax-pathways-deleting-'
ABANDONED_AFTER_S = 3600.0
_OWNER_RE = re.compile(
    r'^(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)-(?P<created>\d+)-[0-9a-f]+$')

_state_lock = threading.Lock()
_warned_unmarked: set[str] = set()
_active_lock = threading.Lock()
_active: set[str] = set()  # deleting paths this process is removing right now
_explicit = threading.local()  # set while the user's CheckpointManager.delete runs


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
  if _oms.is_gcs_path(step_path):
    return False  # On gs:// the commit marker is the only proof of a commit.
  if _oms.read_commit_timestamp_nsecs(step_path) is not None:
    return True
  if _state.current.accept_unmarked and not (step_path / _om.STEP_METADATA_FILE).exists():
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
# Who owns a deleting directory.


def deleting_name(step_dir_name: str) -> str:
  """``<step>.orbax-pathways-deleting-<host>-<pid>-<start>-<created>-<rand>``: no ``_`` and no
  ``.orbax-checkpoint-tmp``, so no Orbax listing or cleanup ever takes it for a step."""
  pid = os.getpid()
  return (f'{step_dir_name}{DELETING_MARKER}{proc_lib.host_id()}-{pid}-{proc_lib.process_start(pid)}-'
          f'{int(time.time())}-{uuid.uuid4().hex[:8]}')


def abandoned(path: epath.PathLike, *, now: float | None = None,
              abandoned_after_s: float | None = None) -> tuple[bool, str]:
  """Whether the leftover ``path`` (a deleting name) is provably abandoned, and why (or why not).
  """
  path = epath.Path(path)
  now = time.time() if now is None else now
  lease = _state.current.abandoned_after_s if abandoned_after_s is None else abandoned_after_s
  owner = path.name.split(DELETING_MARKER, 1)[1] if DELETING_MARKER in path.name else ''
  m = _OWNER_RE.match(owner)
  if m is None:
    try:
      age = now - path.stat().mtime
    except OSError:
      return False, 'vanished'
    if age > lease:
      return True, f'owner unknown, unchanged for {age:.0f} s'
    return False, f'owner unknown, changed {age:.0f} s ago (< {lease:.0f} s)'
  pid, start, age = int(m['pid']), int(m['start']), now - int(m['created'])
  if m['host'] == proc_lib.host_id():
    if pid == os.getpid() and start == proc_lib.process_start(pid):
      with _active_lock:
        if str(path) in _active:
          return False, 'this process is deleting it'
      return True, 'this process gave up deleting it'
    if not proc_lib.process_alive(pid, start):
      return True, f'its owner, process {pid} on this host, is gone'
    if age > lease:
      return True, f'its owner, process {pid} on this host, started it {age:.0f} s ago'
    return False, f'process {pid} on this host is deleting it'
  if age > lease:
    return True, f'created {age:.0f} s ago on another host'
  return False, f'created {age:.0f} s ago on another host (< {lease:.0f} s)'


# ---------------------------------------------------------------------------------------------
# Safe deletion.


def _remove_markers_first(step_path: epath.Path) -> None:
  # commit_success.txt first: on gs:// it alone makes the step committed; locally the step is
  # unlisted once both markers are gone (see is_step_complete).
  for name in (_om.COMMIT_SUCCESS_FILE, _om.STEP_METADATA_FILE):
    marker = step_path / name
    try:
      marker.unlink()
    except FileNotFoundError:
      pass


def _ignore_missing(func, path, exc):
  del func, path
  err = exc if isinstance(exc, BaseException) else exc[1]
  if not isinstance(err, FileNotFoundError):
    raise err


def _rmtree_missing_ok(path: epath.Path) -> None:
  """rmtree that skips entries removed meanwhile by someone else."""
  if _oms.is_local_path(path):
    if sys.version_info >= (3, 12):
      shutil.rmtree(os.fspath(path), onexc=_ignore_missing)  # pylint: disable=unexpected-keyword-arg,line-too-long
    else:
      shutil.rmtree(os.fspath(path), onerror=_ignore_missing)
  else:
    path.rmtree(missing_ok=True)


def remove_tree(path: epath.PathLike, remove=None, *, attempts: int = 5) -> None:
  """Removes the tree at ``path`` with ``remove`` (default: rmtree), tolerating files and
  directories that vanish under it (another process removing the same leftover). Raises only if
  the tree is still there after ``attempts`` tries, or on errors other than "not found"."""
  path = epath.Path(path)
  remove = remove or _rmtree_missing_ok
  last: OSError | None = None
  for attempt in range(attempts):
    try:
      (remove if attempt == 0 else _rmtree_missing_ok)(path)
    except FileNotFoundError as e:
      last = e
    except OSError as e:
      if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
        raise
      last = e  # a concurrent remover, or a writer: look again
    try:
      if not path.exists():
        return
    except FileNotFoundError:
      return
    time.sleep(0.05 * (attempt + 1))
  raise OSError(errno.ENOTEMPTY, f'{path} is still there after {attempts} removal attempts '
                f'(last error: {last})')


def safe_delete_step(step_path: epath.PathLike, remove_tree_fn=None) -> None:
  """Deletes one step directory so that no reader ever sees it half-deleted.

  Args:
    step_path: the step directory (final name).
    remove_tree_fn: callable removing a directory tree; default rmtree. Inside the
      CheckpointManager hook this is Orbax's PathDeleter (parallel locally, batched on gs://);
      either way files that vanish meanwhile are tolerated.
  """
  step_path = epath.Path(step_path)
  if _om.TMP_DIR_SUFFIX in step_path.name or DELETING_MARKER in step_path.name:
    remove_tree(step_path, remove_tree_fn)  # never listed anyway
    return
  if _oms.is_local_path(step_path):
    target = step_path.parent / deleting_name(step_path.name)
    with _active_lock:
      _active.add(str(target))  # before the rename: this process's own cleanup leaves it alone
    try:
      try:
        step_path.rename(target)
      except OSError as e:
        if isinstance(e, FileNotFoundError) and not step_path.exists():
          logging.info('orbax_pathways: %s is already gone.', step_path)
          return
        logging.warning(
            'orbax_pathways: could not rename %s to %s before deleting it (%s); deleting its '
            'commit markers first instead.', step_path, target, e)
        _remove_markers_first(step_path)
        remove_tree(step_path, remove_tree_fn)
        return
      logging.info('orbax_pathways: renamed %s to %s; removing it.', step_path, target.name)
      remove_tree(target, remove_tree_fn)
    finally:
      with _active_lock:
        _active.discard(str(target))
  else:
    _remove_markers_first(step_path)
    remove_tree(step_path, remove_tree_fn)


def _delete_step_hook(step: int, delete_target: epath.Path, remove_tree_fn) -> None:
  """Orbax's deletion of one step. Garbage collection (``max_to_keep``, in the finalize or
  background-delete thread) logs a failure instead of raising: the save that triggered it is
  committed, and an exception here would fail the *next* save and make the manager forget the
  committed step. ``mngr.delete(step)`` raises, naming the step."""
  try:
    safe_delete_step(delete_target, remove_tree_fn)
    tier_store.forget_step(delete_target)  # and its node-local tier copy (never raises)
  except Exception as e:  # pylint: disable=broad-except
    if getattr(_explicit, 'active', False):
      raise OSError(f'orbax_pathways: deleting step {step} ({delete_target}) failed: '
                    f'{type(e).__name__}: {e}') from e
    logging.error(
        'orbax_pathways: garbage collection of old step %d (%s) failed: %s: %s. The step is no '
        'longer listed unless its commit marker could not be removed; its files stay until a '
        'later CheckpointManager in a new process removes the leftover (or remove it by hand). '
        'Saves are not affected.', step, delete_target, type(e).__name__, e)


def leftover_deleting_dirs(directory: epath.PathLike) -> list[epath.Path]:
  directory = epath.Path(directory)
  try:
    return sorted(p for p in directory.iterdir() if DELETING_MARKER in p.name)
  except FileNotFoundError:
    return []


def cleanup_leftovers(directory: epath.PathLike, *,
                      abandoned_after_s: float | None = None) -> list[epath.Path]:
  """Removes the ``*.orbax-pathways-deleting-*`` directories of ``directory`` that are provably
  abandoned (see the module docstring); returns them. Leftovers still being deleted by a live
  process are left to it.

  Call on one host only (the CheckpointManager hook and ``resume`` use the primary host).
  """
  removed, kept = [], []
  for path in leftover_deleting_dirs(directory):
    gone, why = abandoned(path, abandoned_after_s=abandoned_after_s)
    if not gone:
      kept.append(f'{path.name} ({why})')
      continue
    try:
      remove_tree(path)
      removed.append(path)
      logging.info('orbax_pathways: removed leftover %s: %s.', path, why)
    except OSError as e:
      logging.warning('orbax_pathways: could not remove leftover %s (%s); remove it by hand.',
                      path, e)
  if kept:
    logging.info('orbax_pathways: left %d leftover(s) in %s alone: %s', len(kept), directory,
                 '; '.join(kept))
  return removed


def _newest_mtime(path: epath.Path) -> float | None:
  """Newest modification time (Unix seconds) of ``path`` and everything under it; None if it
  is gone."""
  if _oms.is_local_path(path):
    newest = None
    for root, dirs, files in os.walk(os.fspath(path)):
      for name in [''] + dirs + files:
        try:
          t = os.lstat(os.path.join(root, name) if name else root).st_mtime
        except FileNotFoundError:
          continue
        newest = t if newest is None else max(newest, t)
    return newest
  fs = epath.backend.fsspec_backend.fs(str(path))
  try:
    infos = fs.find(str(path), detail=True).values()
  except FileNotFoundError:
    return None
  times = [i['mtime'].timestamp() for i in infos if hasattr(i.get('mtime'), 'timestamp')]
  return max(times) if times else None


def cleanup_abandoned_temporary_steps(directory: epath.PathLike, *,
                                      abandoned_after_s: float | None = None) -> list[epath.Path]:
  """Removes Orbax temporary steps of ``directory`` (uncommitted saves) in which nothing changed
  for ``abandoned_after_s`` seconds; returns them. A save in progress in another process keeps
  writing into its temporary step, so it is left alone. Call on the primary host only."""
  lease = _state.current.abandoned_after_s if abandoned_after_s is None else abandoned_after_s
  removed = []
  now = time.time()
  for path in _oms.temporary_step_paths(directory):
    newest = _newest_mtime(path)
    if newest is None:
      continue
    if now - newest <= lease:
      logging.info('orbax_pathways: leaving temporary step %s alone: written %.0f s ago '
                   '(a save in progress?).', path, now - newest)
      continue
    try:
      remove_tree(path)
      removed.append(path)
      logging.info('orbax_pathways: removed abandoned temporary step %s (unchanged for %.0f s).',
                   path, now - newest)
    except OSError as e:
      logging.warning('orbax_pathways: could not remove temporary step %s (%s).', path, e)
  return removed


# ---------------------------------------------------------------------------------------------
# Activation.


@dataclasses.dataclass(frozen=True)
class RetentionHooks(hooks_lib.ManagerHooks):
  """Retention's calls around a CheckpointManager (``manager/hooks.py``), with its settings:
  ``accept_unmarked`` lists a step with neither commit marker nor step metadata (written by an
  old Orbax); ``abandoned_after_s``: the age after which a leftover whose owner cannot be
  checked, or an unchanged temporary step, counts as abandoned (see the module docstring)."""

  name: ClassVar[str] = 'retention'
  accept_unmarked: bool = False
  abandoned_after_s: float = ABANDONED_AFTER_S

  def manager_init(self, mngr: Any) -> None:
    """Leftovers of earlier processes go, on the manager's primary host (never fails the
    construction)."""
    try:
      if _oms.manager_read_only(mngr):
        return
      if _oms.is_primary_host(_oms.manager_primary_host(mngr)):
        cleanup_leftovers(mngr.directory)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('orbax_pathways: leftover cleanup in %s failed: %s', mngr.directory, e)

  def step_complete(self, step_path: Any) -> bool:
    return is_step_complete(step_path)

  def delete_step(self, step: int, path: Any, remove: Any) -> bool:
    _delete_step_hook(step, path, remove)
    return True

  def delete_started(self, mngr: Any, step: int) -> None:
    _explicit.active = True  # the user's delete raises on failure; garbage collection logs

  def delete_ended(self, mngr: Any, step: int) -> None:
    _explicit.active = False


class _State:
  """This module's process-wide state (one object: no `global` statement)."""

  current = RetentionHooks()  # the registered one (its settings apply), else the defaults


_state = _State()


def install(*, accept_unmarked_steps: bool = False,
            abandoned_after_s: float = ABANDONED_AFTER_S) -> None:
  """Activates safe deletion and strict listing for every CheckpointManager (idempotent), and
  the writer lease (``orbax_pathways.manager.lease.install``: one saving job per directory).

  ``abandoned_after_s``: age after which a leftover whose owner cannot be checked (another host)
  or an unchanged temporary step counts as abandoned (see the module docstring)."""
  if not abandoned_after_s > 0:
    raise ValueError(f'abandoned_after_s={abandoned_after_s!r} must be > 0 seconds.')
  with _state_lock:
    _state.current = RetentionHooks(accept_unmarked=accept_unmarked_steps,
                                    abandoned_after_s=float(abandoned_after_s))
    _om.register(_state.current)
  from orbax_pathways.manager import lease  # pylint: disable=g-import-not-at-top  # it imports us
  lease.install()


def uninstall() -> None:
  """Back to stock Orbax behaviour for deletion, listing and saving (no lease; idempotent)."""
  from orbax_pathways.manager import lease  # pylint: disable=g-import-not-at-top  # it imports us
  lease.uninstall()
  with _state_lock:
    _om.unregister(_state.current)
    _state.current = RetentionHooks()


def installed() -> bool:
  return any(h is _state.current for h in _om.registered())
