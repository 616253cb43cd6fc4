"""Save on preemption with unchanged CheckpointManager code, and resume from the latest complete step.

The user's loop stays the stock Orbax one::

    mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(save_interval_steps=100))
    step, state = orbax_pathways.preemption.resume(mngr, init_fn, abstract_state=abstract)
    step = 0 if step is None else step + 1
    for step in range(step, num_steps):
      state = train_step(state)
      mngr.save(step, args=ocp.args.StandardSave(state))   # saves at the preemption step too
      if mngr.reached_preemption(step):
        orbax_pathways.preemption.exit_after_commit(mngr)  # wait for the commit, then exit 0
    mngr.wait_until_finished()

This package is the public face (``orbax_pathways.preemption``); the work is in two modules,
each with one job: ``notice`` (the notice and SIGTERM) and ``decision`` (which step saves for
preemption; ``exit_after_commit``); ``resume`` is multi-tier's step choice
(``orbax_pathways/multitier/resume.py``), exported here. ``install``/``uninstall`` here
are called by ``orbax_pathways.install``/``uninstall`` (``_install.py``) in every process; they
register ``PreemptionHooks`` (``manager/hooks.py``).

**Notice.** SIGTERM becomes a preemption notice only where a training loop can act on it and no
one else owns it: the handler is installed when the first ``CheckpointManager`` of a process whose
save decision policy saves for preemption (the default; ``PreemptionCheckpointingPolicy``) is
constructed, and only in the main thread of a main process (not in ``multiprocessing`` children,
which must stay stoppable by ``terminate()``; not at import, so the CLI and libraries that merely
import us keep SIGTERM's default action; a forked child gets the previous disposition back).
``ORBAX_PATHWAYS_NO_SIGTERM`` (a boolean) keeps the default action everywhere. A previous Python
SIGTERM handler is still called. SIGTERM owned by JAX's preemption service (``jax.distributed``
with the service on, the default: a native notifier that Python's ``signal.getsignal`` reports as
``SIG_DFL``), by any other native handler, or ignored (``SIG_IGN``) is left alone. A manager whose
policy never saves for preemption (``FixedIntervalPolicy`` alone, as v1 ``training.Checkpointer``
users may pass) leaves SIGTERM's default action in place, as stock Orbax does. A platform with its
own notice channel calls ``notify_preemption()``.

SIGTERM still ends the process, just later: a **second SIGTERM**, or a notice the process has not
acted on within the **grace period** (``ORBAX_PATHWAYS_SIGTERM_GRACE_S``, 120 s; ``install(
sigterm_grace_s=...)``; ``inf`` waits for a second SIGTERM), restores the previous disposition and
re-raises the signal, so the default action (termination) applies. The grace clock pauses while
``exit_after_commit`` waits for the preemption commit; if the main thread is stuck in native code
(a hung collective) and cannot run Python handlers, the default action is forced 5 s later.

**Decision** (patched ``CheckpointManager.reached_preemption``, which feeds ``should_save``).
**One preemption save per notice**: from the notice on, steps answer True until a ``save()`` of
such a step has started; later steps get the normal answer again (save interval, retention), so a
notice the loop does not stop for costs one extra save, not one per step. Further
``notify_preemption()`` calls are ignored until ``clear_notice()``.

- Single controller (``jax.process_count() == 1``, which includes Pathways, where stock Orbax always
  answers False): the rule above, OR the stock answer. The answer for a given step is latched at
  its first call (``save`` asks before the loop does), so the loop's ``reached_preemption(step)``
  is True only for steps that ``save`` also treated as preemption steps.
- Multi-controller with JAX's preemption service on (the default with ``jax.distributed``): stock
  ``reached_preemption_sync_point``; SIGTERM reaches JAX's notifier (we never take it), and JAX
  agrees on the step (the largest step any process reached, plus one). ``notify_preemption()`` is
  then only a local flag, not forwarded to JAX (known limitation; send SIGTERM to one process).
- Multi-controller with the service off (``jax_enable_preemption_service=False``): our agreement
  through the coordination service's key-value store. Every ``agreement_interval`` steps (default
  10; every process calls ``should_save`` each step, so they all reach the same check step), each
  process that calls the manager (its ``active_processes``; all by default) publishes whether it
  holds an unconsumed notice and the first of them publishes whether any does
  (``coord.rounds.agree``: a set and a read per process, the first one reads every flag; no
  device collective); if any does, they all answer True from that step until the preemption
  save. A per-slice manager (Orbax's emergency manager) agrees within its slice only. Cost: one KV round per ``agreement_interval`` steps; reaction
  delay up to ``agreement_interval`` steps.

**Exit.** The preemption save is asynchronous. The loop must call ``mngr.wait_until_finished()``
(or ``exit_after_commit(mngr)``) before exiting, otherwise the last step may not be committed.

**Resume** restores the newest complete step; if that fails (a checksum mismatch, a truncated or
missing file) it warns loudly, naming the damaged step's path, and falls back to the next older
step, so an auto-restarting job does not crash-loop on one damaged step (``fallback=False``
raises instead). All processes of a multi-controller job agree on each step's outcome.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

from orbax_pathways import options as options_lib
from orbax_pathways.manager import hooks as hooks_lib
from orbax_pathways._compat import orbax_manager as _om
from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways.preemption import decision
from orbax_pathways.preemption import notice
from orbax_pathways.preemption.decision import exit_after_commit, reached_preemption
from orbax_pathways.preemption.notice import (GRACE_ENV, install_notice_handler,
                                              notify_preemption, uninstall_notice_handler)
from orbax_pathways.multitier.resume import latest_complete_step, resume

__all__ = [
    'clear_notice', 'exit_after_commit', 'install', 'install_notice_handler', 'installed',
    'latest_complete_step', 'notice_info', 'notify_preemption', 'preemption_noticed',
    'preemption_pending', 'reached_preemption', 'resume', 'uninstall', 'uninstall_notice_handler',
]

NO_SIGTERM_ENV = 'ORBAX_PATHWAYS_NO_SIGTERM'

_installed = False


def preemption_noticed() -> bool:
  """True once a notice was received (until ``clear_notice()``), also after its save."""
  return notice.noticed()


def preemption_pending() -> bool:
  """True while a notice waits for its preemption save."""
  return notice.pending()


def notice_info() -> dict:
  return notice.info()


def clear_notice() -> None:
  """Forgets the notice, any agreement and the SIGTERM grace clock (tests, or a platform that
  cancels a preemption)."""
  with notice.lock:
    notice.clear()
    decision.reset()


@dataclasses.dataclass(frozen=True)
class PreemptionHooks(hooks_lib.ManagerHooks):
  """Preemption's calls around a CheckpointManager (``manager/hooks.py``): SIGTERM becomes a
  notice once a manager that saves for preemption exists (``notice.manager_constructed``); every
  process of the manager agrees on the step that saves for it (``decision.reached_preemption``);
  the notice is consumed once that save started (``decision.after_save``). Their settings are
  ``install``'s (``decision`` and ``notice`` keep them, with the notice's process-wide state:
  one SIGTERM per process)."""

  name: ClassVar[str] = 'preemption'
  agreement: decision.Agreement = decision.Agreement()

  def manager_init(self, mngr: Any) -> None:
    notice.manager_constructed(mngr)

  def reached_preemption(self, mngr: Any, step: int, stock: Callable[[], bool],
                         participants: Any) -> bool:
    if _oms.is_local_manager(mngr):  # the manager it serves decides (multitier/local_steps.py)
      return False
    return decision.reached_preemption(step, stock, participants, self.agreement, mngr)

  def after_save(self, mngr: Any, step: int, saved: bool) -> None:
    if not _oms.is_local_manager(mngr):  # its saves never consume the notice
      decision.after_save(mngr, step, saved)


HOOKS = PreemptionHooks()  # the registered one (replaced by install)


def install(*, agreement_interval: int = 10, agreement_timeout_s: float = 300.0,
            handle_sigterm: bool = True, sigterm_grace_s: float | None = None) -> None:
  """Activates preemption saves for every CheckpointManager (idempotent).

  ``handle_sigterm``: make SIGTERM a notice in the main process once it has a CheckpointManager
  (also off when ``ORBAX_PATHWAYS_NO_SIGTERM`` is true). ``sigterm_grace_s``: seconds a notice may
  go unanswered before SIGTERM's default action applies (None: ``ORBAX_PATHWAYS_SIGTERM_GRACE_S``,
  120; ``math.inf``: only a second SIGTERM). Both environment variables are parsed here.
  """
  global _installed, HOOKS
  agreement = decision.Agreement(agreement_interval, float(agreement_timeout_s))
  no_sigterm = options_lib.env_value(NO_SIGTERM_ENV)
  grace = options_lib.env_value(GRACE_ENV) if sigterm_grace_s is None else sigterm_grace_s
  if not grace > 0:
    raise ValueError(f'sigterm_grace_s={sigterm_grace_s!r} must be > 0 seconds (math.inf: wait '
                     'for a second SIGTERM).')
  handle = handle_sigterm and not no_sigterm
  with notice.lock:
    HOOKS = PreemptionHooks(agreement)
    decision.set_current(agreement)
    notice.configure(handle_sigterm=handle, grace_s=float(grace), what_next=decision.what_next)
    _om.register(HOOKS)
    _installed = True
    if not handle:
      uninstall_notice_handler()
    elif notice.may_install_now():
      install_notice_handler()  # re-installed after uninstall(): a manager already exists


def uninstall() -> None:
  """Back to stock preemption behaviour; restores the previous SIGTERM handler (idempotent)."""
  global _installed
  with notice.lock:
    _om.unregister(HOOKS)
    notice.cancel_grace()
    uninstall_notice_handler()
    _installed = False


def installed() -> bool:
  return _installed
