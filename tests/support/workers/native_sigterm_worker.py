"""A native SIGTERM handler (invisible to Python's ``signal.getsignal``) that a manager must not
replace, for ``tests/manager/test_sigterm.py`` (``test_a_native_sigterm_handler_is_not_replaced``),
through ``procs.run_worker``.

    python -m support.workers.native_sigterm_worker jax|other DIRECTORY PORT

``jax``: the native handler is JAX's preemption notifier (``jax.distributed.initialize`` with
one process, coordinator on 127.0.0.1:PORT); ``other``: a harmless native handler installed
through libc behind Python's back. Then a CheckpointManager on DIRECTORY
(``save_interval_steps=50``); prints one JSON line: ``{"python_sees_default", "native_before",
"kept"}`` (the kernel's disposition is the same after the manager as before). With ``jax`` it then
runs the README loop, sends itself SIGTERM at step 30, and once ``reached_preemption`` prints
the same line with ``"preempted_at"`` added and calls ``preemption.exit_after_commit``.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time


def kernel_disposition() -> int:
  """sigaction(SIGTERM, NULL, &old): the handler is its first field."""
  old = ctypes.create_string_buffer(512)
  assert ctypes.CDLL(None).sigaction(int(signal.SIGTERM), None, old) == 0
  return ctypes.c_void_p.from_buffer(old).value or 0


def main() -> None:
  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from orbax_pathways import preemption  # pylint: disable=g-import-not-at-top
  mode, directory = sys.argv[1], sys.argv[2]
  if mode == 'jax':
    import jax  # pylint: disable=g-import-not-at-top
    jax.distributed.initialize('127.0.0.1:' + sys.argv[3], num_processes=1, process_id=0)
  else:
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    # A harmless native handler, installed behind Python's back.
    libc.signal(int(signal.SIGTERM), ctypes.cast(libc.getpid, ctypes.c_void_p))
  before = kernel_disposition()
  mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      save_interval_steps=50))
  out = {'python_sees_default': signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
         'native_before': before not in (0, 1),
         'kept': kernel_disposition() == before}
  print(json.dumps(out), flush=True)
  if mode == 'jax':  # the README loop: SIGTERM reaches JAX's notifier, its sync point decides
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    for step in range(10**6):
      if step == 30:
        os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(0.01)
      mngr.save(step, args=ocp.args.StandardSave({'w': jnp.full(8, step)}))
      if mngr.reached_preemption(step):
        print(json.dumps(dict(out, preempted_at=step)), flush=True)
        preemption.exit_after_commit(mngr)


if __name__ == '__main__':
  main()
