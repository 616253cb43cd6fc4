"""A job saving into (or reading from) a checkpoint directory, for ``tests/manager/test_lease.py``
(its ``Job``, through ``procs.start``; ``mp`` through ``mp_harness.run_processes``).

    python -m support.workers.lease_worker save DIR TAG STEPS [--hold STOPFILE] [--then STEPS]
                                                              [--after GOFILE]
    python -m support.workers.lease_worker read DIR [--stock] [--after GOFILE]
    python lease_worker.py mp DIR TAG STEPS          (a jax.distributed worker, mp_harness)

``save``: an ordinary CheckpointManager saves ``STEPS`` (comma-separated) with ``values(TAG,
step)``; each save prints one JSON line (``{"step", "ok", "error"}``) and ``{"ready": pid}``
follows once they are committed. With ``--hold`` it then keeps its manager open (the lease is
renewed in the background) until STOPFILE exists, saves ``--then`` steps, and closes. ``read``:
an evaluator: constructs an ordinary manager, restores its latest step and prints the steps it
lists and the values; ``--stock`` never imports orbax_pathways. ``--after``: once its imports
are done, the job waits until GOFILE exists before it constructs a manager (the test starts a job
while the previous one still runs, so that the interpreter start-up overlaps it; what the job
does with the directory starts at GOFILE). Top half numpy-only: the test imports ``values``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

TAGS = {'A': 1000.0, 'B': 2000.0, 'C': 3000.0}


def values(tag: str, step: int) -> np.ndarray:
  return np.arange(256, dtype=np.float32) + np.float32(TAGS[tag] + step)


def tag_of(array) -> str | None:
  a = np.asarray(array)
  for tag in TAGS:
    for step in range(100):
      if np.array_equal(a, values(tag, step)):
        return f'{tag}{step}'
  return None


def _say(obj) -> None:
  print(json.dumps(obj), flush=True)


def _steps(text: str) -> list[int]:
  return [int(s) for s in text.split(',') if s]


GO_WAIT_S = 600  # a job whose GOFILE never comes (its test failed early) gives up


def _wait_for_go(argv) -> None:
  """``--after GOFILE``: returns once GOFILE exists; exits 1 if the test process is gone or
  after GO_WAIT_S."""
  if '--after' not in argv:
    return
  go = argv[argv.index('--after') + 1]
  parent, give_up = os.getppid(), time.monotonic() + GO_WAIT_S
  while not os.path.exists(go):
    if os.getppid() != parent or time.monotonic() > give_up:
      sys.exit(1)
    time.sleep(0.02)


def _save_all(mngr, ocp, tag, steps):
  for step in steps:
    try:
      mngr.save(step, args=ocp.args.StandardSave({'a': values(tag, step)}))
      mngr.wait_until_finished()
      _say({'step': step, 'ok': True})
    except Exception as e:  # pylint: disable=broad-except
      _say({'step': step, 'ok': False, 'type': type(e).__name__, 'error': str(e)})


def save(argv) -> None:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  directory, tag, steps = argv[0], argv[1], _steps(argv[2])
  hold = argv[argv.index('--hold') + 1] if '--hold' in argv else None
  then = _steps(argv[argv.index('--then') + 1]) if '--then' in argv else []
  _wait_for_go(argv)
  mngr = ocp.CheckpointManager(directory)
  _save_all(mngr, ocp, tag, steps)
  _say({'ready': os.getpid()})
  if hold:
    while not os.path.exists(hold):
      time.sleep(0.05)
    _save_all(mngr, ocp, tag, then)
  mngr.close()
  _say({'closed': True})


def read(argv) -> None:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  if '--stock' not in argv:
    import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  _wait_for_go(argv)
  mngr = ocp.CheckpointManager(argv[0])
  steps = list(mngr.all_steps())
  got = {}
  for step in steps:
    out = mngr.restore(step, args=ocp.args.StandardRestore({'a': values('A', 0)}))
    got[step] = tag_of(out['a'])
  mngr.close()
  _say({'steps': steps, 'values': {str(k): v for k, v in got.items()},
        'pathways': 'orbax_pathways' in sys.modules})


def mp(argv) -> None:
  from support import mp_worker as w  # pylint: disable=g-import-not-at-top
  w.init()
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from orbax_pathways.manager import lease  # pylint: disable=g-import-not-at-top
  directory, tag, steps = argv[0], argv[1], _steps(argv[2])
  mngr = ocp.CheckpointManager(directory)
  outcomes = []
  for step in steps:
    try:
      mngr.save(step, args=ocp.args.StandardSave({'a': values(tag, step)}))
      mngr.wait_until_finished()
      outcomes.append({'step': step, 'ok': True})
    except Exception as e:  # pylint: disable=broad-except
      outcomes.append({'step': step, 'ok': False, 'type': type(e).__name__, 'error': str(e)})
  held = {d: o.token for d, o in lease.held_leases().items()}
  mngr.close()
  w.emit({'outcomes': outcomes, 'held': held, 'pid': os.getpid()})


def main() -> None:
  {'save': save, 'read': read, 'mp': mp}[sys.argv[1]](sys.argv[2:])


if __name__ == '__main__':
  main()
