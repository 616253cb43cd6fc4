"""A ``jax.distributed`` process running the README loop until it is preempted, for
``tests/multiprocess/test_preemption_multiprocess.py``, which starts N of them itself through
``procs.started`` (with ``mp_worker``'s variables, as ``support.mp_harness`` would) so that it
can send SIGTERM to one or all mid-run.

    python -m support.workers.readme_loop_worker DIRECTORY

An unchanged README loop (``save_interval_steps=50``): each step builds a sharded state, sleeps
10 ms (the training step), calls ``mngr.save(step, ...)``, writes the step to
``progress_<process id>`` in ``shared_dir()`` (replaced atomically) and, once
``mngr.reached_preemption(step)``, emits ``{"preempted_at": step}`` and calls
``preemption.exit_after_commit(mngr)``.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
  from support import mp_worker as w  # pylint: disable=g-import-not-at-top
  w.init()
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from orbax_pathways import preemption  # pylint: disable=g-import-not-at-top

  directory = sys.argv[1]
  me = w.process_id()
  progress = os.path.join(w.shared_dir(), f'progress_{me}')
  sh = NamedSharding(Mesh(np.array(jax.devices()), ('x',)), P('x'))
  base = np.arange(96, dtype=np.float32)  # divisible by 4, 6 and 8 devices

  def state_at(step):
    value = base + np.float32(step)
    return {'w': jax.make_array_from_callback(value.shape, sh, lambda idx: value[idx])}

  mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      save_interval_steps=50))
  for step in range(10**6):
    state = state_at(step)
    time.sleep(0.01)  # the training step
    mngr.save(step, args=ocp.args.StandardSave(state))
    with open(progress + '.tmp', 'w') as f:
      f.write(str(step))
    os.replace(progress + '.tmp', progress)
    if mngr.reached_preemption(step):
      w.emit({'preempted_at': step})
      preemption.exit_after_commit(mngr)


if __name__ == '__main__':
  main()
