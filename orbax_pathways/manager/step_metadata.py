"""Every CheckpointManager save reads its own ``_CHECKPOINT_METADATA`` from memory.

``StepMetadata`` (a ``ManagerHooks``, called by ``_compat/orbax_manager.py`` on every process
that calls the manager) registers the directory of each step a save writes with
``_compat/orbax_step_metadata.begin`` once every hook let the save go ahead (``save_args``), and
ends it when the step's commit ended (``after_commit``, ``commit_error``: Orbax's ``_finalize``
runs for a failed commit too), when Orbax's ``save`` raised (``save_error``) or declined the
step (``after_save``), and at ``close``. In between, Orbax's reads of the file this save just
wrote (three a save, about a dozen round trips one after another on gs://) and its checks that
the step directory is not a file come from memory; see that module for why nothing stale can be
returned. First in ``hooks.ORDER``, so that its ``save_error`` and ``commit_error`` (which pass)
run before a hook that answers them ends the call.
"""

from __future__ import annotations

import threading
from typing import Any
import weakref

from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways._compat import orbax_step_metadata as _osm
from orbax_pathways.manager import hooks

# Manager -> {step: registration key}: kept beside the manager, not on Orbax's object.
_by_manager: 'weakref.WeakKeyDictionary[Any, dict[int, str]]' = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _registrations(mngr: Any) -> dict[int, str]:
  return _by_manager.setdefault(mngr, {})


class StepMetadata(hooks.ManagerHooks):
  """See the module docstring."""

  name = 'step_metadata'

  def save_args(self, mngr: Any, step: int, args: tuple, kwargs: dict) -> None:
    if not _osm.installed():
      return
    key = _osm.begin(_oms.manager_step_path(mngr, step))
    with _lock:
      old = _registrations(mngr).pop(step, None)
      _registrations(mngr)[step] = key
    if old is not None:  # a save of the same step whose end was never seen
      _osm.end(old)

  def _end(self, mngr: Any, step: int) -> None:
    with _lock:
      key = _registrations(mngr).pop(step, None)
    if key is not None:
      _osm.end(key)

  def save_error(self, mngr: Any, step: int, error: BaseException) -> BaseException | None:
    self._end(mngr, step)
    return None

  def after_save(self, mngr: Any, step: int, saved: bool) -> None:
    if saved is False:
      self._end(mngr, step)

  def commit_error(self, mngr: Any, step: int, error: BaseException) -> BaseException | None:
    self._end(mngr, step)
    return None

  def after_commit(self, mngr: Any, step: int, commit_s: float) -> None:
    self._end(mngr, step)

  def close(self, mngr: Any) -> None:
    with _lock:
      keys = list(_registrations(mngr).values())
      _registrations(mngr).clear()
    for key in keys:
      _osm.end(key)
