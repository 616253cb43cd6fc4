"""Local-only steps (``docs/multi_tier.md``): a step the ``CheckpointManager``'s own policy
declines, whose number is a multiple of ``Options.local_save_interval_steps``, is saved into a
hidden step directory beside the manager's (``<directory>/.orbax-pathways-local``) by a hidden
manager with the same processes and options; there the array handler writes the bytes to the
writer hosts' node-local tiers only, and storage gets Orbax's files and our records.

Who calls what, on which host (every process that calls the manager):

- ``LocalStepHooks.save_args`` (call 3, before Orbax's save of a preemption step): the step's
  local-only copy first, committed before the storage save begins (a node step, saved in the
  loop's thread, where node steps take the manager's local-only steps).
- ``LocalStepHooks.save_declined`` (``manager/hooks.py`` call 5, in the training loop's thread,
  right after Orbax declined the step): the hidden manager's ``save`` of the same arguments.
  With the in-process transport (multi-controller JAX) and arguments ``local_detach`` can copy, the
  loop's thread takes only the snapshot (``transports/snapshots.take``: this process's shards
  to host; numpy leaves and JSON copied) and a background thread per manager runs the hidden
  manager's whole save: Orbax's barriers (key-value ones: the hidden manager names its
  processes), the writes into the tiers, the commit (Orbax v1's ``training.Checkpointer``: the
  checkpointer v1 made for the step, ``_compat/orbax_v1_training``, and the loop's context
  variables, v1's ``Context``, go with it). One such save runs per manager at a time: the
  next local save's ``save()`` waits until the previous one's writes on this process finished
  (its host copies consumed), not for its commit, and its thread starts the hidden manager's
  save once that commit is done (every process saves every local step, in order, so the
  barriers always meet). Otherwise (a data iterator, a custom handler, Pathways' colocated
  transport) Orbax's own save runs in the loop's thread and commits in the background. With
  ``Options.local_save_when_busy='skip'``, a background local save due while the previous one
  still runs is skipped instead, on every process alike (``multitier/local_busy.py``). A
  local save that fails is logged (one warning) and never fails training: the previous
  local-only or storage step stays the newest to resume from.
- ``LocalStepHooks.wait`` / ``close`` (calls 11): the user's ``wait_until_finished`` and
  ``close`` also wait for (and close) the hidden manager, its retention deletions included
  (they run after each local-only commit on a thread of their own,
  ``multitier/trailing_deleter.py``, and the next local-only save does not wait for
  them); ``before_save`` (call 3) waits for a local-only save still committing, and a
  local-only save first waits for the storage save before it: one save commits in the
  background per process at a time.
- ``newer_steps(mngr, than)`` and ``drop_newer(mngr, step, listed)`` (``preemption.resume``
  and the emergency manager's restart, every process): the committed local-only steps newer than the newest storage step, newest first,
  restored through the hidden manager; after the resume, those newer than the step it chose
  are deleted (a rolled-back run's).

With ``Options.local_steps_in='nodes'``, a background local-only save of a tree or JSON
(``node_steps.applies``) goes to this process's node instead (``node_steps.save``, on the same
background thread, one at a time): no hidden manager, no storage request, no barrier, and a
storage save does not wait for it (``before_save``); ``resume_on_nodes`` is its resume. Its
``Composite`` items only their handler can save (a data iterator's) are saved by that handler
in the loop's thread first (``node_steps.stage``), the rest from the snapshot as above.

The hidden manager is a ``CheckpointManager`` like any other, so the package's other hooks run
on it too (the writer lease, retention, the tier's commit); this module's hooks skip it.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import Any, Callable, Iterable, NamedTuple
import weakref

from etils import epath

from orbax_pathways import stats
from orbax_pathways.format import names as format_names
from orbax_pathways._util import said
from orbax_pathways.manager import hooks as hooks_lib
from orbax_pathways.multitier import local_busy
from orbax_pathways.multitier import local_detach
from orbax_pathways.multitier import node_partners
from orbax_pathways.multitier import node_steps
from orbax_pathways.multitier import trailing_deleter
from orbax_pathways.transports import snapshots
from orbax_pathways._compat import orbax_manager as _om

from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways._compat import orbax_v1_training as _v1
log = logging.getLogger('orbax_pathways')


def directory_of(mngr: Any) -> epath.Path:
  """Where ``mngr``'s local-only steps are: ``<directory>/.orbax-pathways-local``."""
  return epath.Path(mngr.directory) / format_names.LOCAL_STEPS_DIR


class Policy(NamedTuple):
  interval: int  # local-only saves on steps that are multiples of this (0: none)
  keep: int  # local-only steps the hidden manager keeps


# Managers whose local policy their builder set (``assign``: the emergency manager's
# ``LocalCheckpointOptions``); every other manager follows the installed handler's Options.
_assigned: 'weakref.WeakKeyDictionary[Any, Policy]' = weakref.WeakKeyDictionary()


def assign(mngr: Any, interval: int, keep: int) -> None:
  """``mngr`` saves local-only steps every ``interval`` steps and keeps ``keep`` of them,
  whatever the installed handler's Options say (``multitier/emergency.py``, at construction)."""
  _assigned[mngr] = Policy(int(interval), int(keep))


class _Background(NamedTuple):
  """A local-only save running in the background."""

  thread: threading.Thread
  # Set once this process's writes of the save finished or failed (its host copies consumed),
  # or the save ended: the next local-only snapshot may be taken from then on.
  handed_off: threading.Event
  on_node: bool = False  # saved on this node alone (node_steps): no storage save waits for it


# Manager -> its newest background local-only save. At most two at a time: one committing,
# and the next, whose snapshot is taken, waiting for that commit to start its own save.
_running: 'weakref.WeakKeyDictionary[Any, _Background]' = weakref.WeakKeyDictionary()
# A storage step on the local interval whose save is under way: (step, args, kwargs), kept from
# ``save_args`` to ``after_save`` (``LocalStepHooks.after_save``: its node step too).
_storage_too: 'weakref.WeakKeyDictionary[Any, tuple[int, tuple, dict]]' = (
    weakref.WeakKeyDictionary())
_in_background = threading.local()  # .active on a background save's own thread


def _busy(mngr: Any) -> bool:
  """Whether ``mngr``'s previous background local-only save still runs."""
  found = _running.get(mngr)
  return found is not None and found.thread.is_alive()


def join(mngr: Any) -> None:
  """Waits for ``mngr``'s background local-only saves (committed or failed and logged: the
  newest joins the one before it); a no-op on such a save's own thread."""
  found = _running.get(mngr)
  if found is not None and not getattr(_in_background, 'active', False):
    found.thread.join()


class LocalStepHooks(hooks_lib.ManagerHooks):
  """Saves declined steps on the local interval through the hidden manager. ``interval`` and
  ``keep`` are read at each save (the installed handler's ``Options``) unless the manager's
  builder assigned its own (``assign``); ``background()``: whether the saves may run on a
  background thread (the transport is the local one)."""

  name = 'local_steps'

  def __init__(self, interval: Callable[[], int], keep: Callable[[], int],
               background: Callable[[], bool] = lambda: False,
               when_busy: Callable[[], str] = lambda: 'wait',
               options: Callable[[], Any] = lambda: None):
    self._interval = interval
    self._keep = keep
    self._background = background
    self._when_busy = when_busy
    self.options = options  # the installed Options (Options.local_steps_in)

  def policy(self, mngr: Any) -> Policy:
    found = _assigned.get(mngr)
    return found if found is not None else Policy(self._interval(), self._keep())

  def before_save(self, mngr: Any, step: int) -> None:
    """A storage save starts once the local-only save before it committed: one save in the
    background per process at a time (Orbax's own rule within one manager; two managers'
    background threads would share Orbax's process-wide operation ids and barrier order).
    Except a node step (``node_steps``): saved by this process alone, in operation ids of its
    own, it never meets a storage save, which starts at once."""
    if _oms.is_local_manager(mngr):
      return
    found = _running.get(mngr)
    inner = _oms.existing_local_manager(mngr)
    if (found is not None and found.on_node
        and (inner is None or not inner.is_saving_in_progress())):
      return  # saved on this node alone: nothing of a storage save meets it (node_steps)
    self._wait_saves(mngr)

  def save_declined(self, mngr: Any, step: int, args: tuple, kwargs: dict) -> None:
    self.save_locally(mngr, step, args, kwargs)

  def save_locally(self, mngr: Any, step: int, args: tuple, kwargs: dict) -> None:
    """Saves step ``step`` of ``mngr`` locally (node step or local-only step) when it is on
    the local interval: a step Orbax's policy declined (``save_declined``), or a storage step
    also kept on the nodes (``after_save``). The loop's thread."""
    every = self.policy(mngr).interval
    if (every <= 0 or step % every or _oms.is_local_manager(mngr)
        or _oms.manager_read_only(mngr)):  # an evaluator's save() writes nothing anywhere
      return
    kwargs = {k: v for k, v in kwargs.items() if k not in ('force', 'metrics')}
    detached = (local_detach.detach(args, kwargs, loop_items=True)
                if self._background() else None)
    on_node = detached is not None and self._node_step(mngr, detached)
    if detached is not None and detached.loop_items and not on_node:
      detached = None  # items only their handler can save, and no node step: Orbax's own save
    if detached is None:
      self._save(mngr, step, args, kwargs)
    elif self._when_busy() == 'skip' and not local_busy.go(mngr, step, _busy(mngr)):
      said.once(logging.INFO, ('local-busy', directory_of(mngr)),
                'orbax_pathways: local-only step %d of %s skipped: the previous local-only save '
                'still commits (Options.local_save_when_busy=%r; later skips are not logged).',
                step, directory_of(mngr), 'skip')
    else:
      self._start(mngr, step, detached, on_node)

  def _start(self, mngr: Any, step: int, detached: local_detach.Detached,
             on_node: bool) -> None:
    """The loop's part of a background local-only save: the previous one's writes finished
    (its host copies consumed; it may still be committing), the snapshot taken, the thread
    started. The loop never waits for the previous save's commit: this save starts once that
    commit is done, on its own thread, so saves still commit one at a time and in order, and
    no more than one save's host copies are held at once. ``on_node``: saved as a node step
    (``_node_step``)."""
    previous = _running.get(mngr)
    if previous is not None:
      previous.handed_off.wait()
    try:
      if on_node and detached.loop_items:  # saved by their handlers now, in the loop's thread
        staged = node_steps.stage(mngr, self.options(), self.policy(mngr).keep, step,
                                  detached.loop_items)
        given = node_steps.joined(detached.kwargs['args'], staged)
        detached = local_detach.Detached(detached.args, dict(detached.kwargs, args=given),
                                         detached.arrays)
      if on_node:
        inner = None
      else:
        inner = _oms.local_manager(mngr, directory_of(mngr), self.policy(mngr).keep,
                                  trailing_deleter.TrailingDeleter)
        _v1.follow_v1_checkpointer(mngr, inner, detached.kwargs.get('args'))  # Orbax v1's
      taken = snapshots.take(detached.arrays)
    except Exception as e:  # pylint: disable=broad-except  (never fails the training step)
      join(mngr)  # its clean-up below runs where no save of the hidden manager does
      _warn_failed(mngr, step, e)
      return
    # The loop's context variables go with the save (Orbax v1's Context, which its handlers
    # read when they save).
    context = contextvars.copy_context()
    handed_off = threading.Event()
    run = self._run if inner is not None else self._run_on_node
    thread = threading.Thread(
        target=context.run,
        args=(run, mngr, inner, step, [detached], taken,
              previous.thread if previous is not None else None, handed_off),
        name=f'orbax_pathways-local-save-{step}', daemon=True)
    _running[mngr] = _Background(thread, handed_off, on_node=inner is None)
    thread.start()

  def _node_step(self, mngr: Any, detached: local_detach.Detached) -> bool:
    """Whether the detached save goes to this process's node (``node_steps.applies``)."""
    return (not detached.args
            and set(detached.kwargs) - {'custom_metadata'} == {'args'}
            and node_steps.applies(mngr, self.options(), detached.kwargs['args'],
                                   detached.loop_items))

  def _run_on_node(self, mngr: Any, inner: None, step: int,
                   holder: list[local_detach.Detached], taken: snapshots.Taken,
                   previous: threading.Thread | None, handed_off: threading.Event) -> None:
    """The background thread of a node step (``node_steps``): the previous local-only save
    ended, then this process's save alone into its node, synchronous (its writes are its
    commit). No storage save is waited for, and none waits for it."""
    del inner
    _in_background.active = True
    detached = holder.pop()
    try:
      if previous is not None:
        previous.join()
      try:
        node_steps.save(mngr, self.options(), step, detached.kwargs['args'],
                        self.policy(mngr).keep, detached.kwargs.get('custom_metadata'))
      finally:
        taken.release()
        del detached
      for st in stats.saves_for_step(step, node_steps.directory_of(mngr)):
        st.loop_snapshot_s = taken.seconds  # the save's part in the loop (stats.SaveStats)
      handed_off.set()  # the copy below reads the node's files, not the host copies
      node_partners.copy_to_partner(mngr, self.options(), step, self.policy(mngr).keep)
    except Exception as e:  # pylint: disable=broad-except  (logged; training goes on)
      log.warning('orbax_pathways: local-only save of step %d of %s into this node failed '
                  '(%s: %s); the newest committed step stays the one to resume from.', step,
                  mngr.directory, type(e).__name__, e)
    finally:
      handed_off.set()

  @staticmethod
  def _run(mngr: Any, inner: Any, step: int, holder: list[local_detach.Detached],
           taken: snapshots.Taken, previous: threading.Thread | None,
           handed_off: threading.Event) -> None:
    """The background thread: the previous local-only save committed and the storage save
    before it, then the hidden manager's save from the host copies (``handed_off`` once this
    process's writes of it finished), then its commit. The save's arguments (the loop's
    arrays, of which only the shape, dtype and sharding are read after the snapshot) are let
    go of once the hidden manager's ``save()`` returned, not at the commit: a loop that does
    not donate its state keeps no more of its old arrays on the devices than before."""
    _in_background.active = True
    detached = holder.pop()
    try:
      if previous is not None:
        previous.join()
      mngr.wait_until_finished()  # one save commits per process at a time (before_save)
      # (Orbax's reads of the files this save writes come from memory, as for every manager
      # save: manager/step_metadata.py.)
      try:
        inner.save(step, *detached.args, force=True, **detached.kwargs)
      finally:
        taken.release()
        del detached
      for st in stats.saves_for_step(step, str(directory_of(mngr))):
        st.loop_snapshot_s = taken.seconds  # the save's part in the loop (stats.SaveStats)
        # Its writes done (a save whose write never ran: the commit's end hands off below).
        while not st.wait_written(0.05) and inner.is_saving_in_progress():
          pass
      handed_off.set()
      inner.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except  (logged; training goes on)
      _warn_failed(mngr, step, e)
    finally:
      handed_off.set()

  def save_args(self, mngr: Any, step: int, args: tuple, kwargs: dict) -> None:
    """The preemption save goes to memory first: its local-only copy is saved and committed
    (the tiers and the small records: seconds) before Orbax's storage save of the step begins,
    so a job whose grace period ends before the storage commit still resumes from it. Any other
    storage step on the local interval is kept for ``after_save`` when node steps take it."""
    every = self.policy(mngr).interval
    if every <= 0 or _oms.is_local_manager(mngr):
      return
    if not mngr.reached_preemption(step):  # latched per step: the save asks it next
      # Node steps are saved on the background thread only (where this process holds its own
      # shards): elsewhere a local save of a storage step would be a second one in storage.
      if (step % every == 0 and self._background()
          and self._node_args(mngr, args, kwargs) is not None):
        _storage_too[mngr] = (step, args, kwargs)
      return
    on_node = self._save_on_node(mngr, step, args, kwargs)
    if on_node:
      log.info('orbax_pathways: preemption step %d is saved on this node (node steps); its '
               'storage save starts now.', step)
    elif on_node is None and self._save(mngr, step, args, kwargs):
      self.wait(mngr)
      log.info('orbax_pathways: preemption step %d is local-committed (node-local tiers); its '
               'storage save starts now.', step)

  def after_save(self, mngr: Any, step: int, saved: bool) -> None:
    """A storage step on the local interval is saved as a node step too, as Orbax's emergency
    manager saves every step on its local interval locally, storage steps too: a storage step
    commits later than a node step, so a job killed before that commit resumes this step from
    the nodes (at most the local interval lost), as Orbax's class resumes it from its local
    copy. Snapshot taken here, save on the background thread, as for a declined step."""
    found = _storage_too.pop(mngr, None)
    if saved and found is not None and found[0] == step:
      self.save_locally(mngr, step, found[1], found[2])

  def save_error(self, mngr: Any, step: int, error: BaseException) -> BaseException | None:
    _storage_too.pop(mngr, None)  # the loop's arrays are not held past a failed save
    return None

  def _node_args(self, mngr: Any, args: tuple, kwargs: dict) -> Any:
    """The save's ``args=`` where node steps take it (``node_steps.applies``), else None."""
    given = kwargs.get('args')
    if (args or set(kwargs) - {'force', 'metrics', 'custom_metadata'} != {'args'}
        or not node_steps.applies(mngr, self.options(), given)):
      return None
    return given

  def _save_on_node(self, mngr: Any, step: int, args: tuple, kwargs: dict) -> bool | None:
    """The preemption step saved by this process alone into its node, in the loop's thread,
    when node steps take the manager's local-only steps (``node_steps.applies``): True once
    saved, False when it failed (logged), None when node steps do not apply. The previous
    background node save ends first; no storage save is waited for."""
    given = self._node_args(mngr, args, kwargs)
    if given is None:
      return None
    try:
      join(mngr)
      node_steps.save(mngr, self.options(), step, given, self.policy(mngr).keep,
                      kwargs.get('custom_metadata'))
      return True
    except Exception as e:  # pylint: disable=broad-except  (never fails the training step)
      _warn_failed(mngr, step, e)
      return False

  def _save(self, mngr: Any, step: int, args: tuple, kwargs: dict) -> bool:
    inner = _oms.local_manager(mngr, directory_of(mngr), self.policy(mngr).keep,
                                  trailing_deleter.TrailingDeleter)
    kwargs = {k: v for k, v in kwargs.items() if k not in ('force', 'metrics')}
    try:
      # The storage save before it, as before_save above, and (this manager's wait hook) the
      # previous local-only save, whose finalize reads the hidden manager's checkpointer.
      mngr.wait_until_finished()
      _v1.follow_v1_checkpointer(mngr, inner, kwargs.get('args'))  # Orbax v1's arguments
      return bool(inner.save(step, *args, force=True, **kwargs))
    except Exception as e:  # pylint: disable=broad-except  (never fails the training step)
      _warn_failed(mngr, step, e)
      return False

  def wait(self, mngr: Any) -> None:
    """The user's ``wait_until_finished``: the local-only save and then the hidden manager's
    retention deletions after its commit (not on the background save's own thread: the next
    local-only save does not wait for the previous one's deletions)."""
    self._wait_saves(mngr)
    inner = _oms.existing_local_manager(mngr)
    if inner is not None and not getattr(_in_background, 'active', False):
      trailing_deleter.wait(inner)

  @staticmethod
  def _wait_saves(mngr: Any) -> None:
    join(mngr)
    inner = _oms.existing_local_manager(mngr)
    if inner is None:
      return
    try:
      inner.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      log.warning('orbax_pathways: a local-only save into %s failed in the background (%s: '
                  '%s); the newest committed step stays the one to resume from.',
                  directory_of(mngr), type(e).__name__, e)
      _oms.discard_unfinished_local_steps(inner)

  def close(self, mngr: Any) -> None:
    inner = _oms.existing_local_manager(mngr)
    if inner is not None:
      self.wait(mngr)
      inner.close()
    join(mngr)
    node_steps.close(mngr)

  def resume_on_nodes(self, mngr: Any, abstract_state: Any, newest_storage: int | None,
                      **agreement: Any) -> tuple[int, Any] | None:
    """``node_steps.resume`` with this manager's options and local policy."""
    if mngr in _assigned:
      return None
    return node_steps.resume(mngr, self.options(), self.policy(mngr).keep, abstract_state,
                             newest_storage, **agreement)


def _warn_failed(mngr: Any, step: int, e: BaseException) -> None:
  """One warning for a failed local-only save, then its unfinished step directory removed
  (``orbax_manager_state.discard_unfinished_local_steps``; called where no save of the hidden
  manager runs: its own save raised, or its background thread's did)."""
  log.warning('orbax_pathways: local-only save of step %d into %s failed (%s: %s); the newest '
              'committed step stays the one to resume from.', step, directory_of(mngr),
              type(e).__name__, e)
  inner = _oms.existing_local_manager(mngr)
  if inner is not None:
    _oms.discard_unfinished_local_steps(inner)


def local_manager(mngr: Any) -> Any | None:
  """The hidden manager of ``mngr``'s local-only steps, or None when there are none (no hook
  registered, or no such directory: ``preemption.resume`` of a restarted job builds it to read
  them)."""
  if _oms.is_local_manager(mngr):
    return None
  inner = _oms.existing_local_manager(mngr)
  if inner is not None:
    join(mngr)  # a local-only save still running: listed once committed
    trailing_deleter.wait(inner)  # and a deleted step not listed again by a reload
    return inner
  hook = next((h for h in _om.registered() if isinstance(h, LocalStepHooks)), None)
  if hook is None or not directory_of(mngr).exists():
    return None
  return _oms.local_manager(mngr, directory_of(mngr), hook.policy(mngr).keep,
                            trailing_deleter.TrailingDeleter)


def on_nodes(mngr: Any) -> tuple[Any, int] | None:
  """``(options, keep)`` of ``mngr``'s node steps when its local-only steps go to the nodes
  (``node_steps.active``), else None (Orbax's emergency manager's listing and restores)."""
  hook = next((h for h in _om.registered() if isinstance(h, LocalStepHooks)), None)
  if hook is None or _oms.is_local_manager(mngr) or not node_steps.active(mngr, hook.options()):
    return None
  join(mngr)  # a node save still running: listed once saved
  return hook.options(), hook.policy(mngr).keep


def resume_on_nodes(mngr: Any, abstract_state: Any, newest_storage: int | None,
                    **agreement: Any) -> tuple[int, Any] | None:
  """``(step, state)`` from the newest node step (``node_steps``: ``Options.local_steps_in=
  'nodes'``) newer than ``newest_storage`` that every process restored, or None
  (``preemption.resume``, every process; ``agreement``: ``node_steps.resume``'s ``all_ok``
  and ``timeout_s``)."""
  hook = next((h for h in _om.registered() if isinstance(h, LocalStepHooks)), None)
  if hook is None or _oms.is_local_manager(mngr):
    return None
  join(mngr)
  return hook.resume_on_nodes(mngr, abstract_state, newest_storage, **agreement)


def newer_steps(mngr: Any, than: int | None) -> tuple[Any | None, list[int]]:
  """The hidden manager and its committed local-only steps newer than ``than`` (the newest
  storage step; None: all), newest first."""
  inner = local_manager(mngr)
  if inner is None:
    return None, []
  inner.reload()
  return inner, sorted((s for s in inner.all_steps() if than is None or s > than), reverse=True)


def drop_newer(mngr: Any, step: int | None, listed: Iterable[int]) -> None:
  """Deletes the local-only steps of ``listed`` newer than ``step`` (the step a resume chose;
  None: all): saved by a run that was rolled back, they must not be resumed from later, nor
  block a save of the same step number. Every process calls it (Orbax's delete is collective),
  with ``listed`` as it listed them (``newer_steps``) before the round that chose ``step``: a
  listing made now could miss a step the primary host already deleted in this very call, and
  that process would skip a collective the others make."""
  inner = local_manager(mngr)
  if inner is None or _oms.manager_read_only(mngr):  # an evaluator's resume deletes nothing
    return
  for s in sorted(listed):
    if step is None or s > step:
      log.info('orbax_pathways: local-only step %d is newer than the step resumed from (%s): '
               'deleted (a rolled-back run saved it).', s, step)
      inner.delete(s)
