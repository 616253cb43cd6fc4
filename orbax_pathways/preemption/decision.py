"""Which step saves for preemption: our answer for ``CheckpointManager.reached_preemption``.

Called by the patched ``CheckpointManager.reached_preemption`` (``_compat/orbax_manager``), which
``should_save`` (through ``PreemptionCheckpointingPolicy``), ``save`` and the user's loop call, on
every controller process; ``after_save`` is the ``after_save`` hook; ``exit_after_commit`` is
called by the user's loop. The notice itself lives in ``notice``.

- Single controller (``jax.process_count() == 1``, Pathways included): a pending notice, OR the
  stock answer; latched per step.
- Multi-controller with JAX's preemption service on: the stock answer (JAX's sync point, which
  hears SIGTERM through JAX's native notifier; ``notice`` leaves SIGTERM to it).
- Multi-controller with the service off: every ``agreement_interval`` steps, one round through the
  coordination service's key-value store; if any process holds a pending notice, every process
  answers True from that step until its preemption save started.
"""

from __future__ import annotations

import sys
from typing import Callable

from absl import logging

from orbax_pathways import waits
from orbax_pathways.preemption import notice
from orbax_pathways._compat import jax_distributed

_agreement_interval = 10
_agreement_timeout_s = 300.0
_agreed_step: int | None = None
_decided: dict[int, bool] = {}
_last_published_key: str | None = None


def configure(*, agreement_interval: int, agreement_timeout_s: float) -> None:
  global _agreement_interval, _agreement_timeout_s
  with notice.lock:
    _agreement_interval = agreement_interval
    _agreement_timeout_s = agreement_timeout_s


def agreement_timeout_s() -> float:
  return _agreement_timeout_s


def reset() -> None:
  """Forgets the latched answers and any agreement (``preemption.clear_notice``)."""
  global _agreed_step, _last_published_key
  with notice.lock:
    _agreed_step = None
    _decided.clear()
    _last_published_key = None


def what_next() -> str:
  """How the notice becomes a save in this process: the end of the notice's log line."""
  if jax_distributed.distributed_process_count() <= 1:
    return ('CheckpointManager.should_save and reached_preemption answer True from the next step '
            'on, for one preemption checkpoint')
  if jax_distributed.jax_preemption_service_active():
    return ("this process does not decide: JAX's preemption sync point does (send SIGTERM to a "
            'process instead)')
  return (f'all processes agree on the next multiple of {_agreement_interval} steps and save '
          'one preemption checkpoint there')


def _consume(step: int) -> None:
  global _agreed_step
  with notice.lock:
    if not notice.mark_consumed():
      return
    _agreed_step = None
  logging.warning('orbax_pathways: preemption checkpoint of step %d started; later steps follow '
                  'the normal save interval and retention.', step)


def after_save(mngr, step: int, saved: bool) -> None:
  """``after_save`` hook (the loop's thread, every process): the notice is consumed once the save
  of a step answered as a preemption step started."""
  del mngr
  if saved and _decided.get(step):
    _consume(step)


def _kv_agreement(step: int) -> bool:
  """Multi-controller agreement on a preemption step through the coordination KV store."""
  global _agreed_step, _last_published_key
  if step in _decided:
    return _decided[step]
  if _agreed_step is not None:
    return _remember(step, step >= _agreed_step)
  if step % _agreement_interval != 0:
    return False
  client = jax_distributed.distributed_client()
  if client is None:
    return _remember(step, notice.pending())
  n, me = jax_distributed.process_count(), jax_distributed.process_index()
  prefix = f'orbax_pathways/preemption/{notice.generation()}/{step}'
  key = f'{prefix}/{me}'
  client.key_value_set(key, '1' if notice.pending() else '0', allow_overwrite=True)
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
    if not notice.noticed():  # another process got the notice: this one saves once, too
      notice.notify_preemption('another process of this job')
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
  then counts from the next step on, until a save of a True step started (``after_save``).
  """
  if step in _decided:
    return _decided[step]
  if notice.pending():
    return _remember(step, True)
  return _remember(step, bool(stock()))


def reached_preemption(step: int, stock: Callable[[], bool] | None = None) -> bool:
  """Our answer for ``CheckpointManager.reached_preemption(step)``; ``stock`` is Orbax's."""
  stock = stock or (lambda: False)
  if jax_distributed.process_count() <= 1:
    with notice.lock:
      return _single_controller(step, stock)
  if jax_distributed.jax_preemption_service_active():
    return bool(stock())
  with notice.lock:
    return _kv_agreement(step)


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
