"""A process that exits while its writer lease's delete never answers, for
``tests/manager/test_lease_exit.py`` (``procs.started``, stdin and stdout piped).

    python -m support.workers.lease_exit_worker DIR

Imports orbax_pathways; an ordinary ``CheckpointManager`` on ``DIR`` (a ``gs://`` path behind
the fault proxy) saves the suite's ``random_state`` as step 0 and prints ``SAVED``; then waits
for a line on stdin (the test holds the lease's DELETE meanwhile), prints ``MAIN DONE`` and
returns without ``close()``: the lease is released at interpreter exit.
"""

from __future__ import annotations

import sys


def main() -> None:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from support.arrays import mesh, random_state  # pylint: disable=g-import-not-at-top

  state = random_state(mesh())
  mngr = ocp.CheckpointManager(sys.argv[1])
  mngr.save(0, args=ocp.args.StandardSave(state))
  mngr.wait_until_finished()
  print('SAVED', flush=True)
  sys.stdin.readline()
  print('MAIN DONE', flush=True)  # no close(): the lease is released at exit


if __name__ == '__main__':
  main()
