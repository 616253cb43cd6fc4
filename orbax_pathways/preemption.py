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

**Notice.** SIGTERM becomes a preemption notice only where a training loop can act on it: the
handler is installed when the first ``CheckpointManager`` of a process is constructed, and only in
the main thread of a main process (not in ``multiprocessing`` children, which must stay stoppable
by ``terminate()``; not at import, so the CLI and libraries that merely import us keep SIGTERM's
default action; a forked child gets the previous disposition back). ``ORBAX_PATHWAYS_NO_SIGTERM``
(a boolean) keeps the default action everywhere. A previous Python SIGTERM handler is still called.
SIGTERM owned by non-Python code (JAX's preemption notifier after ``jax.distributed.initialize``)
or ignored (``SIG_IGN``) is left alone. A platform with its own notice channel calls
``notify_preemption()``.

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
  ``reached_preemption_sync_point``; JAX agrees on the step. ``notify_preemption()`` is then only a
  local flag, not forwarded to JAX (known limitation; send SIGTERM to one process instead).
- Multi-controller with the service off: our agreement through the coordination service's key-value
  store. Every ``agreement_interval`` steps (default 10; every process calls ``should_save`` each
  step, so they all reach the same check step), each process publishes whether it holds an
  unconsumed notice and reads everyone's (one small set + N gets to the coordinator, no device
  collective); if any does, all processes answer True from that step until the preemption save.
  Cost: one KV round per ``agreement_interval`` steps; reaction delay up to
  ``agreement_interval`` steps.

**Exit.** The preemption save is asynchronous. The loop must call ``mngr.wait_until_finished()``
(or ``exit_after_commit(mngr)``) before exiting, otherwise the last step may not be committed.

**Resume** restores the newest complete step; if that fails (a checksum mismatch, a truncated or
missing file) it warns loudly, naming the damaged step's path, and falls back to the next older
step, so an auto-restarting job does not crash-loop on one damaged step (``fallback=False``
raises instead). All processes of a multi-controller job agree on each step's outcome.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any, Callable
import warnings

from absl import logging

from orbax_pathways import errors
from orbax_pathways import options as options_lib
from orbax_pathways import retention
from orbax_pathways import waits
from orbax_pathways._compat import orbax_manager as _om

NO_SIGTERM_ENV = 'ORBAX_PATHWAYS_NO_SIGTERM'
GRACE_ENV = 'ORBAX_PATHWAYS_SIGTERM_GRACE_S'
FORCE_AFTER_S = 5.0  # after the grace: how long the main thread gets to run the default action

_lock = threading.RLock()
_notice = threading.Event()
_notice_info: dict[str, Any] = {}
_consumed = False  # the notice's preemption save has started
_sigterms = 0  # SIGTERMs received since the last clear_notice()
_exiting = False  # exit_after_commit is waiting for the commit

_handler_installed = False
_previous_handler: Any = None
_grace_timer: threading.Timer | None = None
_default_action_ran = False

_installed = False
_handle_sigterm = True
_grace_s = 120.0
_manager_seen = False
_warned_off_main = False
_agreement_interval = 10
_agreement_timeout_s = 300.0
_generation = 0
_agreed_step: int | None = None
_decided: dict[int, bool] = {}
_last_published_key: str | None = None
_resume_round = 0


# ---------------------------------------------------------------------------------------------
# The notice.


def notify_preemption(reason: str = 'platform notice') -> None:
  """Records a preemption notice (the hook a platform calls). Safe from any thread. Ignored while
  an earlier notice is in force (until ``clear_notice()``): one notice, one preemption save."""
  if not _notice.is_set():
    _notice_info.update(reason=reason, time=time.time())
    _notice.set()
    # Kept out of signal context problems: logging from a handler is best effort.
    logging.warning('orbax_pathways: preemption notice received (%s): the next step saves a '
                    'checkpoint.', reason)


def preemption_noticed() -> bool:
  """True once a notice was received (until ``clear_notice()``), also after its save."""
  return _notice.is_set()


def preemption_pending() -> bool:
  """True while a notice waits for its preemption save."""
  return _notice.is_set() and not _consumed


def notice_info() -> dict[str, Any]:
  return dict(_notice_info)


def clear_notice() -> None:
  """Forgets the notice, any agreement and the SIGTERM grace clock (tests, or a platform that
  cancels a preemption)."""
  global _agreed_step, _generation, _last_published_key, _consumed, _sigterms, _exiting
  with _lock:
    _notice.clear()
    _notice_info.clear()
    _agreed_step = None
    _decided.clear()
    _generation += 1
    _last_published_key = None
    _consumed = False
    _sigterms = 0
    _exiting = False
    _cancel_grace()


def _consume(step: int) -> None:
  global _consumed, _agreed_step
  with _lock:
    if _consumed or not _notice.is_set():
      return
    _consumed = True
    _agreed_step = None
  logging.warning('orbax_pathways: preemption checkpoint of step %d started; later steps follow '
                  'the normal save interval and retention.', step)


def _after_save(mngr, step: int, saved: bool) -> None:
  del mngr
  if saved and _decided.get(step):
    _consume(step)


# ---------------------------------------------------------------------------------------------
# SIGTERM: a notice, then the default action.


def _sigterm_handler(signum, frame):
  global _sigterms
  _sigterms += 1
  if _sigterms > 1:
    _default_action(signum, frame, 'a second SIGTERM')
    return
  notify_preemption(f'signal {signal.Signals(signum).name}')
  _arm_grace()
  prev = _previous_handler
  if callable(prev) and prev is not _sigterm_handler:
    prev(signum, frame)


def _default_action(signum, frame, why: str) -> None:
  """Restores SIGTERM's previous disposition and re-raises the signal (main thread only)."""
  global _default_action_ran
  _default_action_ran = True
  prev = _previous_handler
  logging.warning("orbax_pathways: %s: giving SIGTERM its previous disposition (%s) back and "
                  're-raising it.', why, _disposition_name(prev))
  _cancel_grace()
  uninstall_notice_handler()
  sys.stdout.flush()
  sys.stderr.flush()
  if callable(prev):
    prev(signum, frame)
  elif prev in (None, signal.SIG_DFL):
    signal.raise_signal(signal.SIGTERM)


def _disposition_name(handler) -> str:
  if handler in (None, signal.SIG_DFL):
    return 'default action: terminate'
  if handler == signal.SIG_IGN:
    return 'ignored'
  return f'Python handler {getattr(handler, "__qualname__", handler)}'


def _arm_grace() -> None:
  global _grace_timer
  with _lock:
    _cancel_grace()
    if math.isinf(_grace_s):
      return
    _grace_timer = threading.Timer(_grace_s, _grace_expired, args=(_generation,))
    _grace_timer.daemon = True
    _grace_timer.name = 'orbax_pathways_sigterm_grace'
    _grace_timer.start()


def _cancel_grace() -> None:
  global _grace_timer
  timer, _grace_timer = _grace_timer, None
  if timer is not None and timer is not threading.current_thread():
    timer.cancel()


def _grace_expired(generation: int) -> None:
  """Timer thread: the notice was not acted on in time. SIGTERM again, which the main thread
  handles as a second SIGTERM; if it cannot (stuck in native code), force the default action."""
  global _grace_timer
  with _lock:
    if generation != _generation or not _handler_installed:
      return  # cleared, or already back to the previous disposition
    if _exiting:  # exit_after_commit is waiting for the preemption commit: let it finish
      _grace_timer = threading.Timer(_grace_s, _grace_expired, args=(generation,))
      _grace_timer.daemon = True
      _grace_timer.start()
      return
  logging.warning('orbax_pathways: the preemption notice (SIGTERM) is %.0f s old and the process '
                  'has not exited (%s=%g): applying SIGTERM\'s default action.', _grace_s,
                  GRACE_ENV, _grace_s)
  prev = _previous_handler
  os.kill(os.getpid(), signal.SIGTERM)  # handled in the main thread as a second SIGTERM
  deadline = time.monotonic() + FORCE_AFTER_S
  while time.monotonic() < deadline:
    if _default_action_ran:
      return
    time.sleep(0.05)
  if prev in (None, signal.SIG_DFL) and generation == _generation:
    _force_default_sigterm()


def _force_default_sigterm() -> None:
  """The main thread cannot run Python signal handlers (it is stuck in native code): set the
  kernel disposition to SIG_DFL behind Python's back and signal ourselves."""
  logging.warning('orbax_pathways: the main thread did not handle SIGTERM within %.0f s; '
                  'terminating the process.', FORCE_AFTER_S)
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(int(signal.SIGTERM), ctypes.c_void_p(0))  # SIG_DFL
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1.0)
  except Exception:  # pylint: disable=broad-except
    pass
  os._exit(128 + int(signal.SIGTERM))  # pylint: disable=protected-access


def install_notice_handler() -> bool:
  """Makes SIGTERM record a preemption notice. Returns True if our handler is in place.

  Only from the main thread (Python's rule for ``signal.signal``). A previous Python handler is
  chained; a non-Python one (e.g. JAX's preemption notifier) or ``SIG_IGN`` is left alone and we
  return False. ``CheckpointManager`` construction calls this in the main process (see the module
  docstring); call it yourself only to get notices in a process without a manager.
  """
  global _handler_installed, _previous_handler, _default_action_ran
  with _lock:
    current = signal.getsignal(signal.SIGTERM)
    if current is _sigterm_handler:
      _handler_installed = True
      return True
    if threading.current_thread() is not threading.main_thread():
      logging.warning('orbax_pathways: SIGTERM handler not installed: not on the main thread. '
                      'Call orbax_pathways.preemption.install_notice_handler() from the main '
                      'thread, or have your platform call notify_preemption().')
      return False
    if current is None:
      logging.warning('orbax_pathways: SIGTERM is handled by non-Python code (JAX preemption '
                      'service?); not replacing it.')
      return False
    if current == signal.SIG_IGN:
      logging.info('orbax_pathways: SIGTERM is ignored in this process (SIG_IGN); not making it '
                   'a preemption notice.')
      return False
    _previous_handler = current
    signal.signal(signal.SIGTERM, _sigterm_handler)
    _handler_installed = True
    _default_action_ran = False
    logging.info('orbax_pathways: SIGTERM is now a preemption notice in this process (pid %d); '
                 'a second SIGTERM, or %g s without exiting, terminates it.', os.getpid(),
                 _grace_s)
    return True


def uninstall_notice_handler() -> None:
  global _handler_installed, _previous_handler
  with _lock:
    if not _handler_installed:
      return
    if (signal.getsignal(signal.SIGTERM) is _sigterm_handler
        and threading.current_thread() is threading.main_thread()):
      prev = _previous_handler
      signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
    _handler_installed = False
    _previous_handler = None


def _in_main_process() -> bool:
  return multiprocessing.parent_process() is None


def _manager_init_notice(mngr) -> None:
  """Hook run after each CheckpointManager construction: SIGTERM becomes a notice here, once."""
  global _manager_seen, _warned_off_main
  del mngr
  _manager_seen = True
  if (not _handle_sigterm or _handler_installed or _default_action_ran
      or not _in_main_process()):
    return
  if threading.current_thread() is not threading.main_thread():
    if not _warned_off_main:
      _warned_off_main = True
      logging.warning('orbax_pathways: CheckpointManager constructed off the main thread: SIGTERM '
                      'is not a preemption notice in this process. Call orbax_pathways.'
                      'preemption.install_notice_handler() from the main thread, or have your '
                      'platform call notify_preemption().')
    return
  install_notice_handler()


def _after_fork_in_child() -> None:
  """A forked child (multiprocessing 'fork', os.fork) is not the training loop: SIGTERM must stop
  it (``Pool.terminate``, ``Process.terminate``). Back to the parent's previous disposition."""
  global _handler_installed, _previous_handler, _sigterms, _grace_timer
  _grace_timer = None  # the timer thread does not exist in the child
  _sigterms = 0
  if _handler_installed:
    try:
      if signal.getsignal(signal.SIGTERM) is _sigterm_handler:
        prev = _previous_handler
        signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
    except (ValueError, OSError):
      pass
    _handler_installed = False
    _previous_handler = None


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------------------------------------
# The decision.


def _kv_agreement(step: int) -> bool:
  """Multi-controller agreement on a preemption step through the coordination KV store."""
  global _agreed_step, _last_published_key
  if step in _decided:
    return _decided[step]
  if _agreed_step is not None:
    return _remember(step, step >= _agreed_step)
  if step % _agreement_interval != 0:
    return False
  client = _om.distributed_client()
  if client is None:
    return _remember(step, preemption_pending())
  n, me = _om.process_count(), _om.process_index()
  prefix = f'orbax_pathways/preemption/{_generation}/{step}'
  key = f'{prefix}/{me}'
  client.key_value_set(key, '1' if preemption_pending() else '0', allow_overwrite=True)
  flags = waits.gather(client, prefix, n, _agreement_timeout_s,
                       what=f'orbax_pathways: preemption agreement at step {step}')
  if _last_published_key is not None:
    try:
      client.key_value_delete(_last_published_key)
    except Exception:  # pylint: disable=broad-except
      pass
  _last_published_key = key
  decided = _remember(step, any(f == '1' for f in flags))
  if decided:
    _agreed_step = step
    if not _notice.is_set():  # another process got the notice: this one saves once, too
      notify_preemption('another process of this job')
    logging.warning('orbax_pathways: all %d processes agree to save for preemption at step %d.',
                    n, step)
  return decided


def _remember(step: int, answer: bool) -> bool:
  _decided[step] = answer
  while len(_decided) > 16:
    del _decided[min(_decided)]
  return answer


def _single_controller(step: int, stock: Callable[[], bool]) -> bool:
  """Latched per step: the first answer for ``step`` is the answer for every later call.

  ``save(step)`` asks before the user's own ``reached_preemption(step)``; a notice that lands
  between the two must not make the second say True for a step that was not saved. The notice
  then counts from the next step on, until a save of a True step started (``_after_save``).
  """
  if step in _decided:
    return _decided[step]
  if preemption_pending():
    return _remember(step, True)
  return _remember(step, bool(stock()))


def reached_preemption(step: int, stock: Callable[[], bool] | None = None) -> bool:
  """Our answer for ``CheckpointManager.reached_preemption(step)``; ``stock`` is Orbax's."""
  stock = stock or (lambda: False)
  if _om.process_count() <= 1:
    with _lock:
      return _single_controller(step, stock)
  if _om.jax_preemption_service_active():
    return bool(stock())
  with _lock:
    return _kv_agreement(step)


def exit_after_commit(mngr, exit_code: int = 0) -> None:
  """Waits until every pending save is committed, closes ``mngr`` and exits with ``exit_code``.

  If the background commit failed, ``wait_until_finished`` re-raises and the process exits with that
  error instead (non-zero), so a zero exit means the preemption step is on storage. The SIGTERM
  grace clock does not run out while this waits.
  """
  global _exiting
  _exiting = True
  try:
    mngr.wait_until_finished()
    latest = mngr.latest_step()
    mngr.close()
  except BaseException:
    _exiting = False
    raise
  logging.warning('orbax_pathways: checkpoint committed (latest step %s); exiting.', latest)
  sys.stdout.flush()
  sys.stderr.flush()
  sys.exit(exit_code)


# ---------------------------------------------------------------------------------------------
# Resume.


def latest_complete_step(mngr, exclude=()) -> int | None:
  """Newest step in ``mngr.directory`` that is complete per ``retention.is_step_complete``."""
  steps = _om.manager_steps_on_disk(mngr)
  for step, path in reversed(steps):
    if step not in exclude and retention.is_step_complete(path):
      return step
  return None


def _all_processes_ok(ok: bool, step: int) -> bool:
  """Whether every process of a multi-controller job restored ``step`` (one KV round)."""
  global _resume_round
  client = _om.distributed_client()
  if client is None or _om.process_count() <= 1:
    return ok
  _resume_round += 1
  prefix = f'orbax_pathways/resume/{_resume_round}/{step}'
  client.key_value_set(f'{prefix}/{_om.process_index()}', '1' if ok else '0',
                       allow_overwrite=True)
  flags = waits.gather(client, prefix, _om.process_count(), _agreement_timeout_s,
                       what=f'orbax_pathways: resume agreement on step {step}')
  return all(f == '1' for f in flags)


def _still_complete(mngr, step: int) -> bool:
  return any(s == step and retention.is_step_complete(p)
             for s, p in _om.manager_steps_on_disk(mngr))


def _damaged_warning(step: int, path, error: BaseException | None, fallback_step: int) -> str:
  what = ('another process of this job failed to restore it' if error is None else
          f'{type(error).__name__}: {str(error)[:1000]}')
  return (f'orbax_pathways.preemption.resume: step {step} at {path} is DAMAGED and was '
          f'skipped ({what}). Resuming from step {fallback_step} instead. The damaged step stays '
          f'on storage for inspection (`orbax-pathways verify {path}`); this manager no longer '
          'lists it, so saving that step again replaces it. Pass fallback=False to raise '
          'instead.')


def resume(mngr, init_fn: Callable[[], Any], *, abstract_state: Any = None,
           fallback: bool = True):
  """Returns ``(step, state)`` from the newest complete step that restores, or
  ``(None, init_fn())`` when the directory has no complete step.

  ``abstract_state`` goes to ``ocp.args.StandardRestore`` unchanged (None: restore with the saved
  shardings). If restoring the newest step fails (checksum mismatch, missing or truncated files),
  the next older step is tried, and once one restores, a loud warning (``RuntimeWarning`` and an
  ERROR log line) names each damaged step's path; the damaged steps are dropped from ``mngr``'s
  listing so that training saves normally. ``fallback=False`` raises the first error instead.
  Two consecutive failures of the same kind other than a checksum mismatch, or a
  ``TopologyError``, point at the request (``abstract_state``), not the data: the newest step's
  error is raised. If no step restores, ``RestoreError`` lists them all. A step deleted while it
  is read (another process's retention) is not damage: the newest step is looked up again.

  On the primary host, provably abandoned leftovers of interrupted deletes and saves are removed
  first (see ``retention``); work in progress of other processes (a trainer saving into this
  directory while an evaluator resumes) is left alone.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  mngr.wait_until_finished()
  if _om.is_primary_host(_om.manager_primary_host(mngr)) and not _om.manager_read_only(mngr):
    retention.cleanup_leftovers(mngr.directory)
    retention.cleanup_abandoned_temporary_steps(mngr.directory)
  mngr.reload()
  damaged: list[tuple[int, Any, BaseException | None]] = []
  vanished = 0
  while True:
    step = latest_complete_step(mngr, exclude={d[0] for d in damaged})
    if step is None:
      if damaged:
        raise errors.RestoreError(
            f'orbax_pathways.preemption.resume: no complete step in {mngr.directory} restores: '
            + '; '.join(f'step {s} ({p}): ' + (f'{type(e).__name__}: {str(e)[:300]}' if e else
                                               'failed on another process')
                        for s, p, e in damaged)) from damaged[0][2]
      return None, init_fn()
    path = _om.manager_step_path(mngr, step)
    error = None
    try:
      state = mngr.restore(step, args=ocp.args.StandardRestore(abstract_state))
    except Exception as e:  # pylint: disable=broad-except
      error = e
    if _all_processes_ok(error is None, step):
      for s, p, err in damaged:
        message = _damaged_warning(s, p, err, step)
        logging.error(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        _om.forget_step(mngr, s)
      return step, state
    if error is not None and not _still_complete(mngr, step):
      vanished += 1  # deleted meanwhile by a process saving here: look again
      if vanished <= 100:
        mngr.reload()
        continue
    if not fallback or isinstance(error, errors.TopologyError):
      if error is not None:
        raise error
      raise errors.RestoreError(f'orbax_pathways.preemption.resume: step {step} ({path}) failed '
                                'to restore on another process of this job.')
    prev = damaged[-1][2] if damaged else None
    if (error is not None and prev is not None
        and not isinstance(error, errors.ChecksumMismatchError)
        and type(error) is type(prev)):
      raise damaged[0][2] or error  # the same failure twice: the request, not the data
    logging.warning('orbax_pathways.preemption.resume: restoring step %d (%s) failed (%s); '
                    'trying the next older step.', step, path,
                    type(error).__name__ if error else 'on another process')
    damaged.append((step, path, error))


# ---------------------------------------------------------------------------------------------
# Activation.


def install(*, agreement_interval: int = 10, agreement_timeout_s: float = 300.0,
            handle_sigterm: bool = True, sigterm_grace_s: float | None = None) -> None:
  """Activates preemption saves for every CheckpointManager (idempotent).

  ``handle_sigterm``: make SIGTERM a notice in the main process once it has a CheckpointManager
  (also off when ``ORBAX_PATHWAYS_NO_SIGTERM`` is true). ``sigterm_grace_s``: seconds a notice may
  go unanswered before SIGTERM's default action applies (None: ``ORBAX_PATHWAYS_SIGTERM_GRACE_S``,
  120; ``math.inf``: only a second SIGTERM). Both environment variables are parsed here.
  """
  global _installed, _agreement_interval, _agreement_timeout_s, _handle_sigterm, _grace_s
  if agreement_interval < 1:
    raise ValueError(f'agreement_interval must be >= 1, got {agreement_interval}.')
  no_sigterm = options_lib.env_value(NO_SIGTERM_ENV)
  grace = options_lib.env_value(GRACE_ENV) if sigterm_grace_s is None else sigterm_grace_s
  if not grace > 0:
    raise ValueError(f'sigterm_grace_s={sigterm_grace_s!r} must be > 0 seconds (math.inf: wait '
                     'for a second SIGTERM).')
  with _lock:
    _agreement_interval = agreement_interval
    _agreement_timeout_s = agreement_timeout_s
    _handle_sigterm = handle_sigterm and not no_sigterm
    _grace_s = float(grace)
    _om.set_hook('reached_preemption', reached_preemption)
    _om.set_hook('after_save', _after_save)
    _om.set_hook('manager_init_notice', _manager_init_notice)
    _om.install_manager_hooks()
    _installed = True
    if not _handle_sigterm:
      uninstall_notice_handler()
    elif _manager_seen and _in_main_process() and (
        threading.current_thread() is threading.main_thread()):
      install_notice_handler()  # re-installed after uninstall(): a manager already exists


def uninstall() -> None:
  """Back to stock preemption behaviour; restores the previous SIGTERM handler (idempotent)."""
  global _installed
  with _lock:
    _om.set_hook('reached_preemption', None)
    _om.set_hook('after_save', None)
    _om.set_hook('manager_init_notice', None)
    if not _om.any_hook_set():
      _om.uninstall_manager_hooks()
    _cancel_grace()
    uninstall_notice_handler()
    _installed = False


def installed() -> bool:
  return _installed
