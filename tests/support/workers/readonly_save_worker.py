"""A save into a read-only directory, for ``tests/storage/test_readonly_exit.py``
(``procs.run_worker``): the save must raise and the process exit promptly.

    python -m support.workers.readonly_save_worker DIR

Saves the suite's ``random_state`` into ``DIR`` with an unchanged ``ocp.CheckpointManager``;
prints ``SAVED`` if that worked, else ``ERROR <type> <message>``, then ``MAIN DONE``, and
returns from main (the test measures how long the interpreter then takes to exit).
"""

from __future__ import annotations

import sys


def main() -> None:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from support.arrays import mesh, random_state  # pylint: disable=g-import-not-at-top

  state = random_state(mesh())
  try:
    with ocp.CheckpointManager(sys.argv[1]) as mngr:
      mngr.save(0, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()
    print('SAVED', flush=True)
  except Exception as e:  # pylint: disable=broad-except  (printed for the test)
    print('ERROR', type(e).__name__, e, flush=True)
  print('MAIN DONE', flush=True)


if __name__ == '__main__':
  main()
