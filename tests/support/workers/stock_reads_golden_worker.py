"""Stock Orbax, in a fresh interpreter that never imports orbax_pathways, restores the golden
state a test saved with orbax_pathways, for ``tests/frontends/test_format_compat.py``
(``test_stock_orbax_restores_our_checkpoints``, ``procs.run_worker``).

    python -m support.workers.stock_reads_golden_worker CKPT USE_OCDBT USE_ZARR3

Restores ``golden.GOLDEN_STEP`` onto ``golden.abstract_target`` with a
``PyTreeCheckpointHandler(use_ocdbt, use_zarr3)``; every leaf must equal
``golden.expected_state()`` in values and dtype; exits non-zero otherwise.
"""

from __future__ import annotations

import sys


def main() -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  from support import golden  # pylint: disable=g-import-not-at-top
  from support.arrays import mesh  # pylint: disable=g-import-not-at-top

  path, use_ocdbt, use_zarr3 = sys.argv[1], sys.argv[2] == 'True', sys.argv[3] == 'True'
  m = mesh(golden.MESH_SHAPE, golden.MESH_AXES)
  with ocp.CheckpointManager(path, item_handlers=ocp.PyTreeCheckpointHandler(
      use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)) as mngr:
    target = golden.abstract_target(m)
    r = mngr.restore(golden.GOLDEN_STEP, args=ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
  exp = golden.expected_state()
  for k, v in golden.flatten(r).items():
    np.testing.assert_array_equal(np.asarray(v), np.asarray(exp[k]), err_msg=k)
    assert np.asarray(v).dtype == np.asarray(exp[k]).dtype, k
  assert 'orbax_pathways' not in sys.modules
  print('stock read ok')


if __name__ == '__main__':
  main()
