"""A process that prints its pid and sleeps for 10 minutes: started by ``mp_harness`` for
``tests/multiprocess/test_mp_harness.py``'s ``test_timeout_kills_everything`` (the harness must kill it at
its timeout), and as the grandchild of ``harness_failing_worker``. Imports nothing of jax.

    harness_sleeping_worker.py
"""

from __future__ import annotations

import os
import time


def main() -> None:
  print('pid', os.getpid(), flush=True)
  time.sleep(600)


if __name__ == '__main__':
  main()
