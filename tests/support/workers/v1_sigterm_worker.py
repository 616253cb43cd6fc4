"""A training loop on Orbax v1's ``training.Checkpointer``, for ``tests/manager/test_sigterm.py``
(``test_v1_training_checkpointer_sigterm_saves_or_keeps_the_default_action``), through
``procs.started``.

    python -m support.workers.v1_sigterm_worker DIRECTORY fixed|with_preemption_policy

The save decision policy is ``FixedIntervalPolicy(50)``, alone (``fixed``) or with
``PreemptionCheckpointingPolicy`` (``with_preemption_policy``). Each 10 ms step saves when
``should_save``; prints ``READY`` at step 60. A save at a step that is not a multiple of 50 (the
preemption save) is waited for, then one JSON line ``{"preemption_save": step, "steps"}`` (the
checkpoints' steps) is printed and the process closes the checkpointer and exits 0.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  v1 = ocp.v1
  directory, mode = sys.argv[1], sys.argv[2]
  p = v1.training.save_decision_policies
  policy = (p.FixedIntervalPolicy(50) if mode == 'fixed' else
            p.AnySavePolicy([p.FixedIntervalPolicy(50), p.PreemptionCheckpointingPolicy()]))
  ckpt = v1.training.Checkpointer(directory, save_decision_policy=policy)
  for step in range(10**6):
    time.sleep(0.01)  # the training step
    if step == 60:
      print('READY', flush=True)
    if ckpt.should_save(step):
      ckpt.save(step, {'w': jnp.full(8, step)})
      if step % 50:  # not an interval step: the preemption save
        ckpt.wait()
        print(json.dumps({'preemption_save': step, 'steps': [c.step for c in ckpt.checkpoints]}),
              flush=True)
        ckpt.close()
        sys.exit(0)


if __name__ == '__main__':
  main()
