"""Five saves with ``max_to_keep=3``, killed in the middle of an old step's delete, for
``tests/manager/test_retention.py`` (the torn-delete tests, ``_run_killed_child``), run through
``procs.run`` under ``strace``, which sends SIGKILL at the K-th ``unlinkat``.

    python -m support.workers.retention_torn_worker DIR MODE

``MODE`` ``ours``: installs only ``orbax_pathways.manager.retention`` (safe deletion and strict
listing); ``stock``: never imports orbax_pathways. An ordinary ``CheckpointManager`` on ``DIR``
saves steps 0-4 (each ``{'p0'..'p5': arange(4096) * (i + 1) + step}``, float32, waited for one
by one) and closes. Only the deletes of steps 0 and 1 call ``unlinkat`` (about 20 calls each),
so a K of about 20 or less kills the process inside the delete of step 0. Prints nothing.
"""

from __future__ import annotations

import sys

import numpy as np


def state(step: int) -> dict:
  """The values saved at ``step`` (numpy; the test's ``_state``)."""
  return {f'p{i}': np.arange(4096, dtype=np.float32) * (i + 1) + step for i in range(6)}


def main() -> None:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  directory, mode = sys.argv[1], sys.argv[2]
  if mode == 'ours':
    from orbax_pathways.manager import retention  # pylint: disable=g-import-not-at-top
    retention.install()
  m = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=3))
  for s in range(5):
    m.save(s, args=ocp.args.StandardSave({k: jnp.asarray(v) for k, v in state(s).items()}))
    m.wait_until_finished()
  m.close()


if __name__ == '__main__':
  main()
