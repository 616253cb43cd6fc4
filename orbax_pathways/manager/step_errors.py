"""Errors of a CheckpointManager save that name their step and its path (``SaveError``).

Orbax raises a failed background commit from the *next* ``save()`` (its
``wait_until_finished``), with nothing that says which step failed, and a storage error of
``save()`` itself as the storage client's exception. ``StepErrors`` (a ``ManagerHooks``, called
by ``_compat/orbax_manager.py`` on the process whose save or commit failed) turns both into a
``SaveError`` of the same type (``errors.keeping_type``: ``except OSError`` still catches it)
that names the step, its directory and what to expect; the commit's error keeps the step it
belongs to, so the next save does not rename it after itself.
"""

from __future__ import annotations

from typing import Any

from orbax_pathways import errors
from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways.manager import hooks

STEP_ATTR = 'orbax_pathways_step'  # on a SaveError: the step it belongs to

_STORAGE_ERROR_MODULES = ('gcsfs', 'aiohttp', 'google', 'requests', 'fsspec')


def is_storage_error(e: BaseException) -> bool:
  """An error of the storage client (or the OS) rather than of the code around it."""
  return isinstance(e, OSError) or type(e).__module__.split('.')[0] in _STORAGE_ERROR_MODULES


class StepErrors(hooks.ManagerHooks):
  """``save_error`` and ``commit_error``: see the module docstring."""

  name = 'step_errors'

  def save_error(self, mngr: Any, step: int, error: BaseException) -> BaseException | None:
    if getattr(error, STEP_ATTR, None) is not None or not is_storage_error(error):
      return None  # an earlier step's commit error (named already), or not a storage error
    return errors.keeping_type(
        errors.SaveError, error,
        f'Saving step {step} to {_oms.manager_step_path(mngr, step)} failed in storage: '
        f'{type(error).__module__}.{type(error).__name__}: {error}. Earlier steps are '
        'untouched; the step is not committed.')

  def commit_error(self, mngr: Any, step: int, error: BaseException) -> BaseException | None:
    e = error
    if isinstance(e, errors.PeerLostError) and isinstance(e.__context__, errors.PeerLostError):
      e = e.__context__  # the liveness round's error, not the barrier Orbax then tried in a finally
    where = 'in storage' if is_storage_error(e) else 'in the background'
    err = errors.keeping_type(
        errors.SaveError, e,
        f'Step {step} ({_oms.manager_step_path(mngr, step)}) was not committed: its background '
        f'commit failed {where}: {type(e).__module__}.{type(e).__name__}: '
        f'{str(e).rstrip(".")}. Orbax reports this from the next save() or '
        f'wait_until_finished(); earlier steps are untouched, and step {step} is not listed.')
    setattr(err, STEP_ATTR, step)
    return err
