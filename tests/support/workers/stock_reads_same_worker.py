"""Stock Orbax, in a fresh interpreter that never imports orbax_pathways, restores one step of
two checkpoint directories and compares them leaf by leaf, for
``support.ckpt.assert_stock_reads_same`` (``tests/transports/test_transports.py``, ``tests/frontends/test_handler.py``,
``tests/frontends/test_host_leaves.py``; ``procs.run_worker``).

    python -m support.workers.stock_reads_same_worker DIR_A DIR_B STEP

Exits non-zero unless every leaf of ``DIR_A``'s step equals ``DIR_B``'s (restored without a
target by stock ``ocp.CheckpointManager``).
"""

from __future__ import annotations

import sys


def main() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  dir_a, dir_b, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
  a = ocp.CheckpointManager(dir_a).restore(step)
  b = ocp.CheckpointManager(dir_b).restore(step)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert 'orbax_pathways' not in sys.modules


if __name__ == '__main__':
  main()
