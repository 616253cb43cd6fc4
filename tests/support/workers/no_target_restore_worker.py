"""Restores step 0 of a checkpoint without a target in a fresh interpreter with however many
CPU devices the test gave it, for ``tests/sharding/test_elastic.py``
(``test_no_target_restore_onto_any_device_count``, ``procs.worker_json``).

    python -m support.workers.no_target_restore_worker CKPT

Prints the device count; per array its sha256, dtype, mesh shape, PartitionSpec and the number
of devices it lies on; and the INFO lines that say how the saved mesh was laid over the devices.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys


def main() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import  (installs the handler)

  lines = []

  class Keep(logging.Handler):
    def emit(self, record):
      lines.append(record.getMessage())

  logging.getLogger('orbax_pathways').addHandler(Keep())
  logging.getLogger('orbax_pathways').setLevel(logging.INFO)
  with ocp.CheckpointManager(sys.argv[1]) as mngr:
    restored = mngr.restore(0)
  print(json.dumps({
      'devices': len(jax.devices()),
      'arrays': {k: [hashlib.sha256(np.asarray(v).tobytes()).hexdigest(), str(v.dtype),
                     dict(v.sharding.mesh.shape), str(v.sharding.spec), len(v.sharding.device_set)]
                 for k, v in restored.items()},
      'laid': [l for l in lines if 'without target shardings' in l]}))


if __name__ == '__main__':
  main()
