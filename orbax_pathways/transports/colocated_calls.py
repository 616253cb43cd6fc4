"""One colocated call from the controller, waited for with a deadline that names its workers.

Called by ``transports/colocated.py`` on the controller (Orbax's commit thread for a save, the
restoring thread for a restore): ``call_with_deadline`` runs a call on a daemon thread and, past
``call_deadline_s`` (``Options.peer_timeout_s`` plus the busiest host's bytes at a conservative
rate), raises ``WorkerTimeoutError`` naming the workers (``worker_key``) that did not answer.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np

from orbax_pathways import errors
from orbax_pathways import liveness
from orbax_pathways.storage import deadline as deadline_lib


def worker_key(cpu_device) -> str:
  return f'w{cpu_device.id}'


def call_and_fetch(fn: Callable[..., Any], xs: Sequence[jax.Array],
                    outputs: list | None = None) -> tuple[np.ndarray, ...]:
  """Runs one colocated call to completion (blocking: on a thread) and fetches its results;
  ``outputs`` receives the call's (maybe not yet ready) results as soon as it returns them."""
  out = fn(*xs)
  if outputs is not None:
    outputs.extend(out)
  return tuple(np.asarray(r) for r in jax.block_until_ready(out))


def call_deadline_s(max_host_bytes: int) -> float:
  """How long the controller waits for one colocated call whose busiest worker host moves
  ``max_host_bytes``: the peer timeout (``Options.peer_timeout_s``) plus those bytes at a
  conservative storage rate (``storage/deadline.DEFAULT_THROUGHPUT``). Each storage request
  inside the call has its own, shorter deadline (``storage/hedge.py``); this one catches a
  worker that does not answer at all."""
  return liveness.peer_timeout_s() + max(max_host_bytes, 0) / deadline_lib.DEFAULT_THROUGHPUT


def _describe(cpu_devices: Sequence[Any]) -> str:
  keys = [worker_key(d) for d in cpu_devices]
  shown = ', '.join(keys[:16]) + (f' ... ({len(keys)} in all)' if len(keys) > 16 else '')
  hosts = sorted({str(getattr(d, 'process_index', '?')) for d in cpu_devices})
  return f'{shown} (CPU devices {[d.id for d in cpu_devices][:16]}; process(es) {", ".join(hosts[:8])})'


async def call_with_deadline(call: Callable[[list], Any], cpu_devices: Sequence[Any],
                             deadline_s: float, what: str) -> Any:
  """``call(outputs)`` on a daemon thread, waited for at most ``deadline_s``; past it,
  ``WorkerTimeoutError`` names the workers that did not answer: those whose outputs are not
  ready when the call returned them (asynchronous dispatch), else every worker of the call.
  The thread is a daemon: a call that never answers does not keep the process alive at exit.
  Called on the controller (Orbax's commit thread for a save, the restoring thread)."""
  loop = asyncio.get_running_loop()
  done: asyncio.Future = loop.create_future()
  outputs: list = []

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
  try:
    return await asyncio.wait_for(asyncio.shield(done), deadline_s)
  except asyncio.TimeoutError:
    pending = []
    for out in list(outputs):
      for shard in getattr(out, 'addressable_shards', ()):
        try:
          if not shard.data.is_ready():
            pending.append(shard.device)
        except Exception:  # pylint: disable=broad-except
          pending.append(shard.device)
    silent = sorted(set(pending), key=lambda d: d.id) or list(cpu_devices)
    how = ('their results were not ready' if pending else
           'the call did not return; any of them may be the one')
    raise errors.WorkerTimeoutError(
        f'{what}: worker(s) {_describe(silent)} did not answer within {deadline_s:.0f}s '
        f'({how}). Check those workers\' logs and hosts (a dead or stuck worker, or a storage '
        'request that never ends). The deadline is ORBAX_PATHWAYS_PEER_TIMEOUT_S='
        f'{liveness.peer_timeout_s():g}s (Options.peer_timeout_s) plus the call\'s bytes at '
        f'{deadline_lib.DEFAULT_THROUGHPUT / 2**20:.0f} MiB/s per worker host.',
        [worker_key(d) for d in silent]) from None


def call_ready(fn: Callable[..., Any], payload: jax.Array, outputs: list) -> tuple:
  """A restore call, its (maybe not yet ready) results in ``outputs``, then waited for."""
  out = fn(payload)
  outputs.extend(out)
  return jax.block_until_ready(out)
