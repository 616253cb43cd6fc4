"""The preemption notice and SIGTERM: who owns the signal, what it records, when it terminates.

Runs in the main process of each controller (every process of a multi-controller job; the single
controller under Pathways). ``notify_preemption`` is safe from any thread; the SIGTERM handler runs
in the main thread; the grace timer runs in its own daemon thread. ``decision`` reads the notice
(``pending()``) and marks it consumed once its save started; the package's ``install()`` sets the
options here (``configure``) and the ``PreemptionHooks.manager_init`` (``manager_constructed``).

**Who owns SIGTERM.** Ours only where no one else can act on it: not while JAX's preemption
service runs (``jax.distributed``, the default: its native notifier owns SIGTERM and its sync
point decides; Python's ``signal.getsignal`` still says ``SIG_DFL`` there, so the kernel's
disposition is read too), not over any other native handler, not over ``SIG_IGN``, not in
``multiprocessing`` children, not off the main thread, and not for a manager whose save decision
policy never saves for preemption (``FixedIntervalPolicy`` alone, e.g. v1 ``training.Checkpointer``
with that policy): there SIGTERM keeps its default action, as in stock Orbax.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from absl import logging

from orbax_pathways._compat import jax_distributed
from orbax_pathways._compat import orbax_policies

GRACE_ENV = 'ORBAX_PATHWAYS_SIGTERM_GRACE_S'
FORCE_AFTER_S = 5.0  # after the grace: how long the main thread gets to run the default action

lock = threading.RLock()  # notice, handler and (in ``decision``) agreement state
_notice = threading.Event()
_notice_info: dict[str, Any] = {}
@dataclasses.dataclass
class _State:
  """The notice's process-wide state (one SIGTERM per process), under ``lock``."""
  consumed: bool = False  # the notice's preemption save has started
  sigterms: int = 0  # SIGTERMs received since the last clear()
  grace_ran_out: bool = False  # the SIGTERM being handled was sent by the grace timer
  exiting: bool = False  # exit_after_commit is waiting for the commit
  generation: int = 0  # bumped by clear(): stale timers and agreement keys are ignored
  handler_installed: bool = False
  previous_handler: Any = None
  grace_timer: threading.Timer | None = None
  default_action_ran: bool = False
  handle_sigterm: bool = True  # configure()'s settings
  grace_s: float = 120.0
  manager_seen: bool = False  # a manager whose policy saves for preemption was built here
  what_next: Callable[[], str] = lambda: 'a preemption checkpoint follows'


_s = _State()
_said: set[str] = set()


def configure(*, handle_sigterm: bool, grace_s: float,
              what_next: Callable[[], str] | None = None) -> None:
  """Called by ``preemption.install``: whether SIGTERM may become a notice, the grace period, and
  the sentence the notice log line ends with (what the decision will do with it)."""
  with lock:
    _s.handle_sigterm = handle_sigterm
    _s.grace_s = float(grace_s)
    if what_next is not None:
      _s.what_next = what_next


def _say_once(key: str, level: int, msg: str, *args) -> None:
  if key not in _said:
    _said.add(key)
    logging.log(level, msg, *args)


# ---------------------------------------------------------------------------------------------
# The notice.


def notify_preemption(reason: str = 'platform notice') -> None:
  """Records a preemption notice (the hook a platform calls). Safe from any thread. Ignored while
  an earlier notice is in force (until ``clear_notice()``): one notice, one preemption save."""
  if not _notice.is_set():
    _notice_info.update(reason=reason, time=time.time())
    _notice.set()
    # Kept out of signal context problems: logging from a handler is best effort.
    logging.warning('orbax_pathways: preemption notice received (%s): %s.', reason, _s.what_next())


def noticed() -> bool:
  return _notice.is_set()


def pending() -> bool:
  return _notice.is_set() and not _s.consumed


def info() -> dict[str, Any]:
  return dict(_notice_info)


def generation() -> int:
  return _s.generation


def mark_consumed() -> bool:
  """The notice's preemption save started (``decision``). False if there was nothing to consume."""
  with lock:
    if _s.consumed or not _notice.is_set():
      return False
    _s.consumed = True
    return True


def set_exiting(exiting: bool) -> None:
  """``exit_after_commit`` waits for the commit: the grace clock does not run out meanwhile."""
  _s.exiting = exiting


def clear() -> None:
  """Forgets the notice and the SIGTERM grace clock (``preemption.clear_notice``)."""
  with lock:
    _notice.clear()
    _notice_info.clear()
    _s.generation += 1
    _s.consumed = False
    _s.sigterms = 0
    _s.grace_ran_out = False
    _s.exiting = False
    cancel_grace()


# ---------------------------------------------------------------------------------------------
# SIGTERM: a notice, then the default action.


def _sigterm_handler(signum, frame):
  _s.sigterms += 1
  if _s.sigterms > 1:
    _default_action(signum, frame, (
        f'the preemption notice went unanswered for {_s.grace_s:g} s ({GRACE_ENV})'
        if _s.grace_ran_out else 'a second SIGTERM'))
    return
  notify_preemption(f'signal {signal.Signals(signum).name}')
  _arm_grace()
  prev = _s.previous_handler
  if callable(prev) and prev is not _sigterm_handler:
    prev(signum, frame)


def _default_action(signum, frame, why: str) -> None:
  """Restores SIGTERM's previous disposition and re-raises the signal (main thread only)."""
  _s.default_action_ran = True
  prev = _s.previous_handler
  logging.warning("orbax_pathways: %s: giving SIGTERM its previous disposition (%s) back and "
                  're-raising it.', why, _disposition_name(prev))
  cancel_grace()
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
  with lock:
    cancel_grace()
    if math.isinf(_s.grace_s):
      return
    _s.grace_timer = threading.Timer(_s.grace_s, _grace_expired, args=(_s.generation,))
    _s.grace_timer.daemon = True
    _s.grace_timer.name = 'orbax_pathways_sigterm_grace'
    _s.grace_timer.start()


def cancel_grace() -> None:
  timer, _s.grace_timer = _s.grace_timer, None
  if timer is not None and timer is not threading.current_thread():
    timer.cancel()


def _grace_expired(generation: int) -> None:
  """Timer thread: the notice was not acted on in time. SIGTERM again, which the main thread
  handles as the end of the grace period; if it cannot (stuck in native code), force the
  default action."""
  with lock:
    if generation != _s.generation or not _s.handler_installed:
      return  # cleared, or already back to the previous disposition
    if _s.exiting:  # exit_after_commit is waiting for the preemption commit: let it finish
      _s.grace_timer = threading.Timer(_s.grace_s, _grace_expired, args=(generation,))
      _s.grace_timer.daemon = True
      _s.grace_timer.start()
      return
    _s.grace_ran_out = True
  logging.warning('orbax_pathways: the preemption notice (SIGTERM) is %.0f s old and the process '
                  'has not exited (%s=%g): applying SIGTERM\'s default action.', _s.grace_s,
                  GRACE_ENV, _s.grace_s)
  prev = _s.previous_handler
  os.kill(os.getpid(), signal.SIGTERM)  # handled in the main thread: the default action
  deadline = time.monotonic() + FORCE_AFTER_S
  while time.monotonic() < deadline:
    if _s.default_action_ran:
      return
    time.sleep(0.05)
  if prev in (None, signal.SIG_DFL) and generation == _s.generation:
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


def kernel_sigterm_disposition() -> int | None:
  """The kernel's SIGTERM disposition for this process: 0 (``SIG_DFL``), 1 (``SIG_IGN``), else
  the handler's address; None if it cannot be read. Python's ``signal.getsignal`` only knows what
  Python set: a handler installed by native code (JAX's preemption notifier) shows as ``SIG_DFL``
  there."""
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    libc = ctypes.CDLL(None, use_errno=True)
    old = ctypes.create_string_buffer(512)  # struct sigaction: the handler is its first field
    if libc.sigaction(int(signal.SIGTERM), None, old) != 0:
      return None
    return ctypes.c_void_p.from_buffer(old).value or 0
  except Exception:  # pylint: disable=broad-except
    return None


def _native_owner() -> str | None:
  """Who other than Python handles SIGTERM in this process, or None."""
  if jax_distributed.jax_preemption_service_active():
    return "JAX's preemption service (jax.distributed)"
  current = signal.getsignal(signal.SIGTERM)
  if current is None:
    return 'non-Python code'
  if current in (signal.SIG_DFL, signal.SIG_IGN):
    native = kernel_sigterm_disposition()
    if native not in (None, 0, 1):
      return 'non-Python code (a native handler Python does not know about)'
  return None


def install_notice_handler() -> bool:
  """Makes SIGTERM record a preemption notice. Returns True if our handler is in place.

  Only from the main thread (Python's rule for ``signal.signal``). A previous Python handler is
  chained; a native one (JAX's preemption notifier, installed by ``jax.distributed.initialize``
  with the preemption service on) or ``SIG_IGN`` is left alone and we return False: then JAX's
  sync point decides the preemption step. ``CheckpointManager`` construction calls this in the
  main process (see the module docstring); call it yourself only to get notices in a process
  without a manager.
  """
  with lock:
    current = signal.getsignal(signal.SIGTERM)
    if current is _sigterm_handler:
      _s.handler_installed = True
      return True
    if threading.current_thread() is not threading.main_thread():
      logging.warning('orbax_pathways: SIGTERM handler not installed: not on the main thread. '
                      'Call orbax_pathways.preemption.install_notice_handler() from the main '
                      'thread, or have your platform call notify_preemption().')
      return False
    owner = _native_owner()
    if owner is not None:
      _say_once('native', logging.INFO,
                'orbax_pathways: SIGTERM is handled by %s; not replacing it (its preemption sync '
                'point decides when CheckpointManager saves for preemption).', owner)
      return False
    if current == signal.SIG_IGN:
      _say_once('ignored', logging.INFO,
                'orbax_pathways: SIGTERM is ignored in this process (SIG_IGN); not making it a '
                'preemption notice.')
      return False
    _s.previous_handler = current
    signal.signal(signal.SIGTERM, _sigterm_handler)
    _s.handler_installed = True
    _s.default_action_ran = False
    logging.info('orbax_pathways: SIGTERM is now a preemption notice in this process (pid %d); '
                 'a second SIGTERM, or %g s without exiting, terminates it.', os.getpid(),
                 _s.grace_s)
    return True


def uninstall_notice_handler() -> None:
  with lock:
    if not _s.handler_installed:
      return
    if (signal.getsignal(signal.SIGTERM) is _sigterm_handler
        and threading.current_thread() is threading.main_thread()):
      prev = _s.previous_handler
      signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
    _s.handler_installed = False
    _s.previous_handler = None


def in_main_process() -> bool:
  return multiprocessing.parent_process() is None


def may_install_now() -> bool:
  """``install()`` after ``uninstall()``: a manager that saves for preemption already exists."""
  return (_s.handle_sigterm and _s.manager_seen and in_main_process()
          and threading.current_thread() is threading.main_thread())


def manager_constructed(mngr) -> None:
  """``PreemptionHooks.manager_init``, run after each CheckpointManager construction (v0, and the one
  inside v1's ``training.Checkpointer``): SIGTERM becomes a notice here, once per process, if the
  manager's save decision policy saves for preemption."""
  if not _s.handle_sigterm or _s.handler_installed or _s.default_action_ran or not in_main_process():
    return
  if not orbax_policies.manager_saves_on_preemption(mngr):
    _say_once('policy', logging.INFO,
              'orbax_pathways: SIGTERM keeps its default action: the save decision policy of the '
              'CheckpointManager for %s (%s) never saves for preemption. Add '
              'PreemptionCheckpointingPolicy() (in an AnySavePolicy) to save on a preemption '
              'notice.', mngr.directory, orbax_policies.manager_policy_name(mngr))
    return
  _s.manager_seen = True
  if threading.current_thread() is not threading.main_thread():
    _say_once('off_main', logging.WARNING,
              'orbax_pathways: CheckpointManager constructed off the main thread: SIGTERM is not a '
              'preemption notice in this process. Call orbax_pathways.preemption.'
              'install_notice_handler() from the main thread, or have your platform call '
              'notify_preemption().')
    return
  install_notice_handler()


def _after_fork_in_child() -> None:
  """A forked child (multiprocessing 'fork', os.fork) is not the training loop: SIGTERM must stop
  it (``Pool.terminate``, ``Process.terminate``). Back to the parent's previous disposition."""
  _s.grace_timer = None  # the timer thread does not exist in the child
  _s.sigterms = 0
  if _s.handler_installed:
    try:
      if signal.getsignal(signal.SIGTERM) is _sigterm_handler:
        prev = _s.previous_handler
        signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
    except (ValueError, OSError):
      pass
    _s.handler_installed = False
    _s.previous_handler = None


os.register_at_fork(after_in_child=_after_fork_in_child)
