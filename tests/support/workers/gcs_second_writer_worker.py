"""Another process commits step 1 into a gs:// checkpoint directory that a reader in the test
process already listed, for ``tests/storage/test_gcs.py``
(``test_long_lived_reader_sees_steps_written_by_another_process``, ``procs.run_worker``).

    python -m support.workers.gcs_second_writer_worker GS_PATH

Saves ``{'w': arange(64).reshape(8, 8) + 1}`` (float32, sharded over 'data' of a 4x2 mesh) as
step 1 with an unchanged ``ocp.CheckpointManager``; the fake-gcs-server environment comes from
the test process.
"""

from __future__ import annotations

import sys


def main() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import  (installs the handler)

  m = Mesh(np.asarray(jax.devices()).reshape(4, 2), ('data', 'model'))
  x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8) + 1, NamedSharding(m, P('data')))
  with ocp.CheckpointManager(sys.argv[1]) as w:
    w.save(1, args=ocp.args.StandardSave({'w': x}))
    w.wait_until_finished()


if __name__ == '__main__':
  main()
