"""One process of ``tests/tier/test_local_steps.py``'s preemption case: an unchanged
``CheckpointManager`` (``save_interval_steps=100``) with local-only steps every 5, a preemption
notice after step 7, so step 8 is the preemption save.

    python -m support.workers.local_preempt_worker save|resume CKPT

``save``: prints ``{"local_at_save_return": [...], "storage": [...]}``: the hidden manager's
committed steps (with ``ORBAX_PATHWAYS_LOCAL_STEPS_IN=nodes``: the node's steps) at the moment
``save(8)`` returned (its storage save still committing), and
Orbax's steps at the end. ``resume``: ``preemption.resume``; prints the step and whether every
value is that step's.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from orbax_pathways import preemption  # pylint: disable=g-import-not-at-top
  from orbax_pathways.multitier import local_steps  # pylint: disable=g-import-not-at-top
  from orbax_pathways.multitier import node_steps  # pylint: disable=g-import-not-at-top

  mode, root = sys.argv[1], sys.argv[2]
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('x', 'y'))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x', 'y'))
  base = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)

  def state(step):
    return {'w': jax.device_put(base + step, sharding)}

  options = ocp.CheckpointManagerOptions(save_interval_steps=100)
  with ocp.CheckpointManager(root, options=options) as m:
    if mode == 'save':
      seen = None
      for step in range(9):
        m.save(step, args=ocp.args.StandardSave(state(step)))
        if step == 7:
          preemption.notify_preemption()
        if step == 8 and os.environ.get('ORBAX_PATHWAYS_LOCAL_STEPS_IN') == 'nodes':
          found = node_steps.directory_of(m)
          seen = sorted(int(n) for n in os.listdir(found) if n.isdigit()) if found else []
        elif step == 8:
          inner = local_steps.local_manager(m)
          inner.reload()
          seen = inner.all_steps()
      m.wait_until_finished()
      print(json.dumps({'local_at_save_return': seen, 'storage': m.all_steps()}))
    else:
      target = {'w': jax.ShapeDtypeStruct(base.shape, base.dtype, sharding=sharding)}
      step, got = preemption.resume(m, lambda: None, abstract_state=target)
      exact = bool(np.array_equal(np.asarray(got['w']), base + step))
      print(json.dumps({'step': step, 'exact': exact}))


if __name__ == '__main__':
  main()
