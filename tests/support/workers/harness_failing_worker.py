"""A ``jax.distributed`` process of ``tests/multiprocess/test_mp_harness.py``'s
``test_failure_reports_every_stderr_and_kills_peers`` (``mp_harness``): process 1 raises,
process 0 blocks in a barrier with it.

    harness_failing_worker.py

Each process first starts a grandchild in its process group
(``harness_sleeping_worker``, which the harness must not leave alive) and emits its pid.
"""

from __future__ import annotations

import subprocess
import sys


def main() -> None:
  from support import mp_worker as w  # pylint: disable=g-import-not-at-top

  w.init()
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  # A grandchild in the worker's process group: must not survive the run.
  child = subprocess.Popen([sys.executable, '-m', 'support.workers.harness_sleeping_worker'])
  w.emit({'grandchild': child.pid})
  if w.process_id() == 1:
    raise RuntimeError('deliberate failure in process 1')
  multihost_utils.sync_global_devices('never reached by process 1')  # process 0 blocks here
  w.emit({'unreachable': True})


if __name__ == '__main__':
  main()
