"""A training loop that never acts on the preemption notice, for ``tests/manager/test_sigterm.py``
(the stray notice, the second SIGTERM, ``timeout``, a main thread stuck in native code), through
``procs.run`` / ``procs.started``.

    python -m support.workers.sigterm_loop_worker DIRECTORY self|idle|stuck

A CheckpointManager on DIRECTORY (``save_interval_steps=10``, ``max_to_keep=3``); prints
``READY``. ``self``: 60 steps, sending itself SIGTERM at step 21 (a stray notice the loop does not
stop for); ``idle`` and ``stuck``: one step. Then prints one JSON line, ``{"saved", "kept",
"preempted"}`` (the steps ``save`` saved, ``all_steps()``, the steps ``reached_preemption`` was
true for). ``stuck``: sends itself SIGTERM, lets the handler run, then blocks SIGTERM and sleeps
in native code (prints ``STUCK``). Otherwise prints ``IDLE`` and sleeps until SIGTERM's default
action ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  directory, mode = sys.argv[1], sys.argv[2]
  mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      save_interval_steps=10, max_to_keep=3))
  saved, preempted = [], []
  print('READY', flush=True)
  for step in range(60 if mode == 'self' else 1):
    if mode == 'self' and step == 21:
      os.kill(os.getpid(), 15)  # a stray notice; this loop does not stop for it
      time.sleep(0.1)
    if mngr.save(step, args=ocp.args.StandardSave({'w': jnp.full(8, step)})):
      saved.append(step)
    if mngr.reached_preemption(step):
      preempted.append(step)
  mngr.wait_until_finished()
  print(json.dumps({'saved': saved, 'kept': mngr.all_steps(), 'preempted': preempted}),
        flush=True)
  if mode == 'stuck':
    import ctypes  # pylint: disable=g-import-not-at-top
    import signal  # pylint: disable=g-import-not-at-top
    os.kill(os.getpid(), 15)
    time.sleep(0.2)  # the handler runs (notice, grace clock) in the main thread
    # Then the main thread blocks in native code that SIGTERM does not interrupt (as in a hung
    # collective): it cannot run Python signal handlers any more.
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    print('STUCK', flush=True)
    ctypes.CDLL(None).sleep(600)
  print('IDLE', flush=True)
  while True:  # never acts on the notice: SIGTERM's default action must end this
    time.sleep(0.05)


if __name__ == '__main__':
  main()
