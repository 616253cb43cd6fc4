"""A training job's main process using ``multiprocessing`` (its manager makes SIGTERM a notice
there), whose children must still stop on SIGTERM, for ``tests/manager/test_sigterm.py``
(``test_multiprocessing_children_stop_on_sigterm``), through ``procs.run_worker``.

    python -m support.workers.mp_sigterm_worker fork|spawn DIRECTORY CASE

CASE ``pool_exception``: a ``with mp.Pool(2)`` block whose children build their own managers
(and keep SIGTERM's default), has work running, and raises; prints ``{"raised": text}`` once the
block has ended. ``pool_terminate``: ``Pool.terminate()`` and ``join()`` with work running;
prints ``{"terminated": true}``. ``process_terminate``: ``Process.terminate()`` of a child that
built its own manager and sleeps; prints ``{"exitcode"}``. A hang shows as the test's timeout.

Unlike the other workers, this one imports orbax_pathways and Orbax at the top, as the program
it replaces did: a ``spawn`` child re-imports this module, and its children must have the
package imported as a training job's children do. The test starts it by name, never imports it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time

import orbax_pathways  # pylint: disable=unused-import
import orbax.checkpoint as ocp


def child_manager(directory):
  # A child that builds its own manager: still not a training loop's main process.
  ocp.CheckpointManager(os.path.join(directory, f'c{os.getpid()}')).close()
  return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def sleeper(directory, ready):
  child_manager(directory)
  ready.set()
  time.sleep(600)


def work(x):  # pylint: disable=unused-argument
  time.sleep(600)


def main() -> None:
  method, directory, case = sys.argv[1], sys.argv[2], sys.argv[3]
  mp.set_start_method(method)
  # The parent is a training job: its manager makes SIGTERM a notice here.
  mngr = ocp.CheckpointManager(os.path.join(directory, 'parent'))  # pylint: disable=unused-variable
  assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
  if case == 'pool_exception':
    try:
      with mp.Pool(2) as pool:
        assert all(pool.map(child_manager, [directory] * 2))
        pool.map_async(work, range(2))
        time.sleep(1)
        raise RuntimeError('boom in the pool block')
    except RuntimeError as e:
      print(json.dumps({'raised': str(e)}), flush=True)
  elif case == 'pool_terminate':
    pool = mp.Pool(2)
    pool.map_async(work, range(2))
    time.sleep(1)
    pool.terminate()
    pool.join()
    print(json.dumps({'terminated': True}), flush=True)
  else:
    ready = mp.Event()
    p = mp.Process(target=sleeper, args=(directory, ready))
    p.start()
    assert ready.wait(120)
    p.terminate()
    p.join(120)
    print(json.dumps({'exitcode': p.exitcode}), flush=True)


if __name__ == '__main__':
  main()
