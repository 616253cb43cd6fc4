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

**Notice.** ``install_notice_handler()`` (called by ``install()`` from the main thread) makes
SIGTERM record a notice instead of killing the process; a previous Python SIGTERM handler is still
called. A platform with its own notice channel calls ``notify_preemption()``. If SIGTERM is owned by
non-Python code (JAX's preemption notifier after ``jax.distributed.initialize``), we leave it alone.

**Decision** (patched ``CheckpointManager.reached_preemption``, which feeds ``should_save``):

- Single controller (``jax.process_count() == 1``, which includes Pathways, where stock Orbax always
  answers False): True for every step from the notice on, OR the stock answer. The answer for a
  given step is latched at its first call (``save`` asks before the loop does), so the loop's
  ``reached_preemption(step)`` is True only for steps that ``save`` also treated as preemption
  steps.
- Multi-controller with JAX's preemption service on (the default with ``jax.distributed``): stock
  ``reached_preemption_sync_point``; JAX agrees on the step. ``notify_preemption()`` is then only a
  local flag, not forwarded to JAX (known limitation; send SIGTERM to one process instead).
- Multi-controller with the service off: our agreement through the coordination service's key-value
  store. Every ``agreement_interval`` steps (default 10; every process calls ``should_save`` each
  step, so they all reach the same check step), each process publishes its notice flag and reads
  everyone's (one small set + N gets to the coordinator, no device collective); if any is set, all
  processes answer True from that step on. Cost: one KV round per ``agreement_interval`` steps;
  reaction delay up to ``agreement_interval`` steps.

**Exit.** The preemption save is asynchronous. The loop must call ``mngr.wait_until_finished()``
(or ``exit_after_commit(mngr)``) before exiting, otherwise the last step may not be committed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from absl import logging

from orbax_pathways import retention
from orbax_pathways._compat import orbax_manager as _om

_lock = threading.RLock()
_notice = threading.Event()
_notice_info: dict[str, Any] = {}

_handler_installed = False
_previous_handler: Any = None

_installed = False
_agreement_interval = 10
_agreement_timeout_s = 300.0
_generation = 0
_agreed_step: int | None = None
_decided: dict[int, bool] = {}
_last_published_key: str | None = None


# ---------------------------------------------------------------------------------------------
# The notice.


def notify_preemption(reason: str = 'platform notice') -> None:
  """Records a preemption notice (the hook a platform calls). Safe from any thread."""
  if not _notice.is_set():
    _notice_info.update(reason=reason, time=time.time())
    _notice.set()
    # Kept out of signal context problems: logging from a handler is best effort.
    logging.warning('orbax_pathways: preemption notice received (%s).', reason)


def preemption_noticed() -> bool:
  return _notice.is_set()


def notice_info() -> dict[str, Any]:
  return dict(_notice_info)


def clear_notice() -> None:
  """Forgets the notice and any agreement (tests, or a platform that cancels a preemption)."""
  global _agreed_step, _generation, _last_published_key
  with _lock:
    _notice.clear()
    _notice_info.clear()
    _agreed_step = None
    _decided.clear()
    _generation += 1
    _last_published_key = None


def _sigterm_handler(signum, frame):
  notify_preemption(f'signal {signal.Signals(signum).name}')
  prev = _previous_handler
  if callable(prev) and prev is not _sigterm_handler:
    prev(signum, frame)


def install_notice_handler() -> bool:
  """Makes SIGTERM record a preemption notice. Returns True if our handler is in place.

  Only from the main thread (Python's rule for ``signal.signal``). A previous Python handler is
  chained; a non-Python one (e.g. JAX's preemption notifier) is left alone and we return False.
  """
  global _handler_installed, _previous_handler
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
    _previous_handler = current
    signal.signal(signal.SIGTERM, _sigterm_handler)
    _handler_installed = True
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


# ---------------------------------------------------------------------------------------------
# The decision.


def _kv_agreement(step: int) -> bool:
  """Multi-controller agreement on a preemption step through the coordination KV store."""
  global _agreed_step, _last_published_key
  if _agreed_step is not None:
    return step >= _agreed_step
  if step in _decided:
    return _decided[step]
  if step % _agreement_interval != 0:
    return False
  client = _om.distributed_client()
  if client is None:
    return preemption_noticed()
  n, me = _om.process_count(), _om.process_index()
  prefix = f'orbax_pathways/preemption/{_generation}/{step}'
  key = f'{prefix}/{me}'
  client.key_value_set(key, '1' if preemption_noticed() else '0', allow_overwrite=True)
  timeout_ms = int(_agreement_timeout_s * 1000)
  try:
    flags = [client.blocking_key_value_get(f'{prefix}/{p}', timeout_ms) for p in range(n)]
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(
        f'orbax_pathways: preemption agreement at step {step} timed out after '
        f'{_agreement_timeout_s}s waiting for all {n} processes (key prefix {prefix}). Every '
        'process must call CheckpointManager.should_save/save at every step.') from e
  if _last_published_key is not None:
    try:
      client.key_value_delete(_last_published_key)
    except Exception:  # pylint: disable=broad-except
      pass
  _last_published_key = key
  decided = _remember(step, any(f == '1' for f in flags))
  if decided:
    _agreed_step = step
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
  then counts from the next step on.
  """
  global _agreed_step
  if step in _decided:
    return _decided[step]
  if _agreed_step is not None and step >= _agreed_step:
    return _remember(step, True)
  if preemption_noticed():
    _agreed_step = step
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
  error instead (non-zero), so a zero exit means the preemption step is on storage.
  """
  mngr.wait_until_finished()
  latest = mngr.latest_step()
  mngr.close()
  logging.warning('orbax_pathways: checkpoint committed (latest step %s); exiting.', latest)
  sys.stdout.flush()
  sys.stderr.flush()
  sys.exit(exit_code)


# ---------------------------------------------------------------------------------------------
# Resume.


def latest_complete_step(mngr) -> int | None:
  """Newest step in ``mngr.directory`` that is complete per ``retention.is_step_complete``."""
  steps = _om.manager_steps_on_disk(mngr)
  for step, path in reversed(steps):
    if retention.is_step_complete(path):
      return step
  return None


def resume(mngr, init_fn: Callable[[], Any], *, abstract_state: Any = None):
  """Returns ``(step, state)`` from the newest complete step, or ``(None, init_fn())``.

  ``abstract_state`` goes to ``ocp.args.StandardRestore`` unchanged (None: restore with the saved
  shardings). On the primary host, leftovers of interrupted deletes and uncommitted temporary steps
  are removed first; nothing else must be saving into this directory while resume runs.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  mngr.wait_until_finished()
  if _om.is_primary_host(_om.manager_primary_host(mngr)) and not mngr._options.read_only:  # pylint: disable=protected-access
    retention.cleanup_leftovers(mngr.directory)
    _om.cleanup_temporary_paths(mngr.directory, _om.manager_primary_host(mngr))
  mngr.reload()
  step = latest_complete_step(mngr)
  if step is None:
    return None, init_fn()
  state = mngr.restore(step, args=ocp.args.StandardRestore(abstract_state))
  return step, state


# ---------------------------------------------------------------------------------------------
# Activation.


def install(*, agreement_interval: int = 10, agreement_timeout_s: float = 300.0,
            handle_sigterm: bool = True) -> None:
  """Activates preemption saves for every CheckpointManager (idempotent)."""
  global _installed, _agreement_interval, _agreement_timeout_s
  if agreement_interval < 1:
    raise ValueError(f'agreement_interval must be >= 1, got {agreement_interval}.')
  with _lock:
    _agreement_interval = agreement_interval
    _agreement_timeout_s = agreement_timeout_s
    if handle_sigterm and os.environ.get('ORBAX_PATHWAYS_NO_SIGTERM') != '1':
      install_notice_handler()
    _om.set_hook('reached_preemption', reached_preemption)
    _om.install_manager_hooks()
    _installed = True


def uninstall() -> None:
  """Back to stock preemption behaviour; restores the previous SIGTERM handler (idempotent)."""
  global _installed
  with _lock:
    _om.set_hook('reached_preemption', None)
    if not _om.any_hook_set():
      _om.uninstall_manager_hooks()
    uninstall_notice_handler()
    _installed = False


def installed() -> bool:
  return _installed
