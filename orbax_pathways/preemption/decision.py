"""Which step saves for preemption: our answer for ``CheckpointManager.reached_preemption``.

Called by the patched ``CheckpointManager.reached_preemption`` (``_compat/orbax_manager``), which
``should_save`` (through ``PreemptionCheckpointingPolicy``), ``save`` and the user's loop call, on
every controller process; ``after_save`` is ``PreemptionHooks.after_save``; ``exit_after_commit`` is
called by the user's loop. The notice itself lives in ``notice``.

- Single controller (``jax.process_count() == 1``, Pathways included): a pending notice, OR the
  stock answer; latched per step.
- Multi-controller with JAX's preemption service on: the stock answer (JAX's sync point, which
  hears SIGTERM through JAX's native notifier; ``notice`` leaves SIGTERM to it).
- Multi-controller with the service off: every ``agreement_interval`` steps, one round through the
  coordination service's key-value store among the processes that call the manager (its
  ``active_processes``: ``coord/participants.py``; every process for the public
  ``reached_preemption(step)`` without a manager); if any of them holds a pending notice, they
  all answer True from that step until its preemption save started. Each set of participants
  has its own round and its own latched answers, so a per-slice manager (Orbax's emergency
  manager) never waits for the other slices.
"""

from __future__ import annotations

import sys
from typing import Any, Callable
import weakref

from absl import logging

from orbax_pathways.coord import agreement as agreement_lib
from orbax_pathways.coord import rounds
from orbax_pathways.coord import participants as participants_lib
from orbax_pathways.preemption import notice
from orbax_pathways._compat import jax_distributed
from orbax_pathways._compat import orbax_manager_state as _oms


Agreement = agreement_lib.Agreement  # preemption.install's arguments (``coord/agreement.py``)
_EVERY_PROCESS = participants_lib.Participants(None, 0)
# Per round name (one per set of participants, ``Participants.name``; '' for one controller):
_agreed_step: dict[str, int] = {}  # the step from which its participants answer True
_decided: dict[str, dict[int, bool]] = {}  # its latched answers, by step
# A single controller's latched answers, per manager: a second manager of the process (a new
# run in a notebook, an evaluator's loop) starts with none, so a step number the first one
# was asked about is answered afresh. (Several processes agree per step in rounds instead,
# all of them keeping the same answers: ``_decided``.)
_decided_by_manager: 'weakref.WeakKeyDictionary[Any, dict[int, bool]]' = weakref.WeakKeyDictionary()


def set_current(agreement: Agreement) -> None:
  """``preemption.install``: the agreement of the hooks it registers."""
  agreement_lib.configure(agreement)


def agreement_timeout_s() -> float:
  return agreement_lib.current().timeout_s


def reset() -> None:
  """Forgets the latched answers and any agreement (``preemption.clear_notice``)."""
  with notice.lock:
    _agreed_step.clear()
    _decided.clear()
    _decided_by_manager.clear()


def what_next() -> str:
  """How the notice becomes a save in this process: the end of the notice's log line."""
  if jax_distributed.distributed_process_count() <= 1:
    return ('CheckpointManager.should_save and reached_preemption answer True from the next step '
            'on, for one preemption checkpoint')
  if jax_distributed.jax_preemption_service_active():
    return ("this process does not decide: JAX's preemption sync point does (send SIGTERM to a "
            'process instead)')
  return (f'all processes agree on the next multiple of {agreement_lib.current().interval} steps and save '
          'one preemption checkpoint there')


def _consume(step: int) -> None:
  with notice.lock:
    if not notice.mark_consumed():
      return
    _agreed_step.clear()
  logging.warning('orbax_pathways: preemption checkpoint of step %d started; later steps follow '
                  'the normal save interval and retention.', step)


def after_save(mngr, step: int, saved: bool) -> None:
  """``PreemptionHooks.after_save`` (the loop's thread, every process): the notice is consumed once the save
  of a step answered as a preemption step started."""
  mine = _decided_by_manager.get(mngr) if mngr is not None else None
  if saved and (any(d.get(step) for d in _decided.values()) or (mine or {}).get(step)):
    _consume(step)


def _kv_agreement(step: int, part: participants_lib.Participants,
                  agreement: Agreement) -> bool:
  """Agreement on a preemption step among ``part`` through the coordination KV store."""
  name = part.name('preemption')
  decided = _decided.setdefault(name, {})
  if step in decided:
    return decided[step]
  if name in _agreed_step:
    return _remember(decided, step, step >= _agreed_step[name])
  if step % agreement.interval != 0:
    return False
  client = jax_distributed.distributed_client()
  n, me = jax_distributed.process_count(), _oms.process_index()
  if client is None or not part.includes(me, n) or part.size(n) <= 1:
    return _remember(decided, step, notice.pending())
  # One round per (notice generation, step): every member derives the same key.
  seq = rounds.sequence(name, keep=1)
  verdict = rounds.agree(
      client, seq, seq.next(f'{notice.generation()}/{step}'), me=me, members=part.members(n),
      count=n, leader=part.leader(n), value='1' if notice.pending() else '0',
      decide=lambda flags: '1' if any(f == '1' for f in flags) else '0',
      timeout_s=agreement.timeout_s,
      what=f'orbax_pathways: preemption agreement at step {step} among {part.describe(n)}')
  answer = _remember(decided, step, verdict == '1')
  if answer:
    _agreed_step[name] = step
    if not notice.noticed():  # another process got the notice: this one saves once, too
      notice.notify_preemption('another process of this job')
    logging.warning('orbax_pathways: %s agree to save for preemption at step %d.',
                    part.describe(n), step)
  return answer


def _remember(decided: dict[int, bool], step: int, answer: bool) -> bool:
  decided[step] = answer
  while len(decided) > 16:
    del decided[min(decided)]
  return answer


def _single_controller(step: int, stock: Callable[[], bool], mngr: Any = None) -> bool:
  """Latched per step: the first answer for ``step`` is the answer for every later call.

  ``save(step)`` asks before the user's own ``reached_preemption(step)``; a notice that lands
  between the two must not make the second say True for a step that was not saved. The notice
  then counts from the next step on, until a save of a True step started (``after_save``).
  """
  if mngr is None:
    decided = _decided.setdefault('', {})
  else:
    decided = _decided_by_manager.setdefault(mngr, {})
  if step in decided:
    return decided[step]
  if notice.pending():
    return _remember(decided, step, True)
  return _remember(decided, step, bool(stock()))


def reached_preemption(step: int, stock: Callable[[], bool] | None = None,
                       participants: participants_lib.Participants | None = None,
                       agreement: Agreement | None = None, mngr: Any = None) -> bool:
  """Our answer for ``CheckpointManager.reached_preemption(step)``; ``stock`` is Orbax's;
  ``participants``: the processes that call the manager (None: every process of the job);
  ``agreement``: the calling hooks' (None: the registered one); ``mngr``: the manager asked
  (a single controller latches its answers per manager; None: per process)."""
  stock = stock or (lambda: False)
  if jax_distributed.process_count() <= 1:
    with notice.lock:
      return _single_controller(step, stock, mngr)
  if jax_distributed.jax_preemption_service_active():
    return bool(stock())
  with notice.lock:
    return _kv_agreement(step, participants or _EVERY_PROCESS, agreement or agreement_lib.current())


def exit_after_commit(mngr, exit_code: int = 0) -> None:
  """Waits until every pending save is committed, closes ``mngr`` and exits with ``exit_code``.

  If the background commit failed, ``wait_until_finished`` re-raises and the process exits with that
  error instead (non-zero), so a zero exit means the preemption step is on storage. The SIGTERM
  grace clock does not run out while this waits.
  """
  notice.set_exiting(True)
  try:
    mngr.wait_until_finished()
    latest = mngr.latest_step()
    mngr.close()
  except BaseException:
    notice.set_exiting(False)
    raise
  logging.warning('orbax_pathways: checkpoint committed (latest step %s); exiting.', latest)
  sys.stdout.flush()
  sys.stderr.flush()
  sys.exit(exit_code)
