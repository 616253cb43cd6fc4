"""Builds Orbax's emergency ``CheckpointManager`` through a name bound to the class, the way
MaxText's ``emergency_checkpointing`` module binds it at import, either before or after
``import orbax_pathways``; saves steps 0..3 on 2 slices (local every step, persistent every 2)
and prints what was built and where the steps went. For
``tests/manager/test_emergency_dropin.py::test_the_drop_in_holds_whatever_the_import_order``.

    python -m support.workers.emergency_import_order_worker {orbax_first|package_first} DIR
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
  order, root = sys.argv[1], sys.argv[2]
  if order == 'package_first':
    import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  # MaxText: CheckpointManager = emergency_checkpoint_manager.CheckpointManager, at import.
  from orbax.checkpoint.experimental.emergency import checkpoint_manager as em  # pylint: disable=g-import-not-at-top
  bound = em.CheckpointManager
  if order == 'orbax_first':
    import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import,redefined-outer-name
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ('replica', 'data'))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  state = {'w': jax.device_put(np.arange(64, dtype=np.float32), sharding)}
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  local, persistent = os.path.join(root, 'local'), os.path.join(root, 'persistent')
  os.makedirs(local, mode=0o700)
  options = em.CheckpointManagerOptions(
      local=em.LocalCheckpointOptions(save_interval_steps=1),
      persistent=em.PersistentCheckpointOptions(save_interval_steps=2))
  with bound(local, persistent, mesh, abstract, options=options) as mngr:
    for step in range(4):
      mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    mngr.wait_until_finished()
    out = {'class': type(mngr).__name__, 'is_orbax_class': isinstance(mngr, bound),
           'steps': list(mngr.all_steps()), 'persistent': sorted(os.listdir(persistent))}
  print(json.dumps(out))


if __name__ == '__main__':
  main()
