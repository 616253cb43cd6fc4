"""A training loop on 8 CPU devices that SIGTERM preempts, then its resume, for
``tests/manager/test_preemption.py``
(``test_sigterm_saves_at_notice_commits_and_exits_zero_then_resumes``), through
``procs.started`` and ``procs.run_worker``.

    python -m support.workers.preemption_loop_worker DIRECTORY train|resume

Installs retention and preemption; a CheckpointManager on DIRECTORY (``save_interval_steps=100``,
``max_to_keep=3``) over a state ``{'w': BASE + step sharded over 8 devices, 'step': step}``.
``train``: resumes (or starts from step 0), prints ``READY``, then each 2 ms step saves, prints
``STEP n`` every 50 steps and, once ``reached_preemption``, prints ``PREEMPTED_AT step latest``
and calls ``preemption.exit_after_commit``. ``resume``: ``preemption.resume`` with the abstract
state, then without it, printing ``RESUMED step ok same_sharding`` for each.
"""

from __future__ import annotations

import sys
import time


def main() -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from orbax_pathways import preemption  # pylint: disable=g-import-not-at-top
  from orbax_pathways.manager import retention  # pylint: disable=g-import-not-at-top
  retention.install()
  preemption.install()
  directory, mode = sys.argv[1], sys.argv[2]
  mesh = Mesh(np.array(jax.devices()).reshape(8), ('x',))
  sh = NamedSharding(mesh, P('x'))
  base = np.arange(8 * 1024, dtype=np.float32)

  def state_at(step):
    return {'w': jax.device_put(base + step, sh), 'step': step}

  abstract = {'w': jax.ShapeDtypeStruct(base.shape, base.dtype, sharding=sh), 'step': 0}
  mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      save_interval_steps=100, max_to_keep=3))
  if mode == 'resume':
    for target in (abstract, None):
      step, state = preemption.resume(mngr, lambda: None, abstract_state=target)
      ok = (np.asarray(state['w']).tobytes() == (base + step).tobytes()
            and int(state['step']) == step)
      print('RESUMED', step, ok, state['w'].sharding == sh, flush=True)
    sys.exit(0)
  step, state = preemption.resume(mngr, lambda: state_at(0), abstract_state=abstract)
  start = 0 if step is None else step + 1
  print('READY', flush=True)
  for step in range(start, 10**6):
    state = state_at(step)
    time.sleep(0.002)
    mngr.save(step, args=ocp.args.StandardSave(state))
    if step % 50 == 0:
      print('STEP', step, flush=True)
    if mngr.reached_preemption(step):
      print('PREEMPTED_AT', step, mngr.latest_step(), flush=True)
      preemption.exit_after_commit(mngr)


if __name__ == '__main__':
  main()
