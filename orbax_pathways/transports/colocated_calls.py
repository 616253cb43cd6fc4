"""One colocated call from the controller, waited for as long as it makes progress; the
deadline measures silence and its error names the workers that went silent.

Called by ``transports/colocated.py`` on the controller (Orbax's commit thread for a save, the
restoring thread for a restore): ``call_with_deadline`` runs a call on a daemon thread and
raises ``WorkerTimeoutError`` once the call has shown no sign of progress for
``call_deadline_s`` (``Options.peer_timeout_s`` plus the busiest host's bytes at a
conservative rate), naming the workers (``worker_key``) that went silent. A call that is slow
but still progressing is never cut off, however long it runs in all.

Signs of progress (``waits.Progress``, one per call, registered here under the call's id,
which the call's task carries to its workers):

- a worker host starting, moving bytes (each array read or written) and finishing its share:
  the worker code (``colocated_worker.make_worker_save`` / ``make_worker_restore``) reports
  them with ``progress(call_id)``, which finds this registry where the worker runs in the
  controller's process (the CPU backend; the test suite and ``benchmarks/fleet.py``). A remote
  Pathways worker runs in its own process: ``progress`` is None there and it reports nothing;
- a worker's results becoming ready (asynchronous dispatch: the controller polls the call's
  outputs), wherever it runs.

So on a remote fleet the silence between two workers finishing is what is bounded, and the
deadline's bytes term covers the busiest host's whole share at the conservative rate.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any, Callable, Sequence

import jax
import numpy as np

from orbax_pathways import errors
from orbax_pathways.coord import waits
from orbax_pathways.storage import deadline as deadline_lib

# How often the waiter looks at the call's outputs and its silence (at most; less for short
# deadlines).
POLL_S = 0.5

_lock = threading.Lock()
_calls: dict[str, waits.Progress] = {}  # call id -> its progress, while the controller waits


def worker_key(cpu_device) -> str:
  return f'w{cpu_device.id}'


def new_call_id() -> str:
  """A fresh id for one colocated call (its task carries it to every worker: constant size)."""
  return uuid.uuid4().hex[:16]


def progress(call_id: str) -> waits.Progress | None:
  """The progress of call ``call_id`` that its workers report to, or None where the
  controller's wait is not in this process (a remote worker) or the id is empty."""
  if not call_id:
    return None
  with _lock:
    return _calls.get(call_id)


def call_and_fetch(fn: Callable[..., Any], xs: Sequence[jax.Array],
                    outputs: list | None = None) -> tuple[np.ndarray, ...]:
  """Runs one colocated call to completion (blocking: on a thread) and fetches its results;
  ``outputs`` receives the call's (maybe not yet ready) results as soon as it returns them."""
  out = fn(*xs)
  if outputs is not None:
    outputs.extend(out)
  return tuple(np.asarray(r) for r in jax.block_until_ready(out))


def call_deadline_s(max_host_bytes: int, peer_timeout_s: float) -> float:
  """How long one colocated call may go without any sign of progress when its busiest worker
  host moves ``max_host_bytes``: the peer timeout (``Options.peer_timeout_s``) plus those bytes
  at a conservative storage rate (``storage/deadline.DEFAULT_THROUGHPUT``). Each storage request
  inside the call has its own, shorter deadline (``storage/hedge.py``); this one catches a
  worker that goes silent."""
  return peer_timeout_s + max(max_host_bytes, 0) / deadline_lib.DEFAULT_THROUGHPUT


def _describe(cpu_devices: Sequence[Any]) -> str:
  keys = [worker_key(d) for d in cpu_devices]
  shown = ', '.join(keys[:16]) + (f' ... ({len(keys)} in all)' if len(keys) > 16 else '')
  hosts = sorted({str(getattr(d, 'process_index', '?')) for d in cpu_devices})
  return f'{shown} (CPU devices {[d.id for d in cpu_devices][:16]}; process(es) {", ".join(hosts[:8])})'


def _not_ready(outputs: Sequence[Any]) -> list[Any]:
  """The devices whose shard of some output is not ready yet."""
  pending = []
  for out in list(outputs):
    for shard in getattr(out, 'addressable_shards', ()):
      try:
        if not shard.data.is_ready():
          pending.append(shard.device)
      except Exception:  # pylint: disable=broad-except
        pending.append(shard.device)
  return pending


async def call_with_deadline(call: Callable[[list], Any], cpu_devices: Sequence[Any],
                             deadline_s: float, what: str, call_id: str = '', *,
                             peer_timeout_s: float | None = None) -> Any:
  """``call(outputs)`` on a daemon thread, waited for while it makes progress; once it has
  shown none for ``deadline_s``, ``WorkerTimeoutError`` names the workers that went silent:
  those the call's workers reported running and not finished (under ``call_id``, see the
  module docstring), else those whose outputs are not ready when the call returned them
  (asynchronous dispatch), else every worker of the call.
  The thread is a daemon: a call that never answers does not keep the process alive at exit.
  ``peer_timeout_s``: the part of ``deadline_s`` that is ``Options.peer_timeout_s``, for the
  error's text.
  Called on the controller (Orbax's commit thread for a save, the restoring thread)."""
  loop = asyncio.get_running_loop()
  done: asyncio.Future = loop.create_future()
  outputs: list = []
  watch = waits.Progress()
  if call_id:
    with _lock:
      _calls[call_id] = watch

  def settle(value: Any, error: BaseException | None) -> None:
    if done.done():
      return
    if error is not None:
      done.set_exception(error)
    else:
      done.set_result(value)

  def run() -> None:
    try:
      value, error = call(outputs), None
    except BaseException as e:  # pylint: disable=broad-except  (handed to the waiter)
      value, error = None, e
    try:
      loop.call_soon_threadsafe(settle, value, error)
    except RuntimeError:  # the loop is gone: the waiter gave up long ago
      pass

  threading.Thread(target=run, name='orbax_pathways-colocated-call', daemon=True).start()
  poll_s = min(POLL_S, max(deadline_s / 4, 0.01))
  ready: set[int] = set()  # devices whose results were seen ready
  try:
    while True:
      left = deadline_s - watch.silent_for()
      if left <= 0:
        break
      try:
        return await asyncio.wait_for(asyncio.shield(done), min(left, poll_s))
      except asyncio.TimeoutError:
        pass
      if outputs:  # a worker's results that became ready: progress, wherever it runs
        now_ready = {d.id for d in cpu_devices} - {d.id for d in _not_ready(outputs)}
        if now_ready - ready:
          ready |= now_ready
          watch.beat()
  finally:
    if call_id:
      with _lock:
        _calls.pop(call_id, None)
  by_key = {worker_key(d): d for d in cpu_devices}
  pending = {d.id for d in _not_ready(outputs)}
  reported = watch.beats > 0 and bool(watch.running() or watch.finished())
  if reported:
    silent = [by_key[k] for k in watch.silent(by_key) if k in by_key]
    how = ('they started their share and reported nothing since' if watch.running() else
           'they did not start their share')
  elif pending:
    silent = [d for d in cpu_devices if d.id in pending]
    how = 'their results were not ready'
  else:
    silent = []
    how = ''
  if not silent:
    silent = list(cpu_devices)
    how = 'the call did not return; any of them may be the one'
  raise errors.WorkerTimeoutError(
      f'{what}: worker(s) {_describe(silent)} did not answer within {deadline_s:.0f}s: no sign '
      f'of progress for {deadline_s:.0f}s ({how}; the call ran '
      f'{time.monotonic() - watch.began:.0f}s in all, {len(watch.finished())} of '
      f'{len(cpu_devices)} workers finished). Check those workers\' logs and hosts (a dead or '
      'stuck worker, or a storage request that never ends). The deadline measures silence: '
      + (f'ORBAX_PATHWAYS_PEER_TIMEOUT_S={peer_timeout_s:g}s (Options.peer_timeout_s) plus '
         if peer_timeout_s is not None else 'the peer timeout (Options.peer_timeout_s) plus ')
      + f'the busiest worker host\'s bytes at {deadline_lib.DEFAULT_THROUGHPUT / 2**20:.0f} MiB/s.',
      [worker_key(d) for d in silent]) from None


def call_ready(fn: Callable[..., Any], payload: jax.Array, outputs: list) -> tuple:
  """A restore call, its (maybe not yet ready) results in ``outputs``, then waited for."""
  out = fn(payload)
  outputs.extend(out)
  return jax.block_until_ready(out)
