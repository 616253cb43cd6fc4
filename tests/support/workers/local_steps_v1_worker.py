"""One ``jax.distributed`` process of ``tests/tier/test_local_steps_v1.py`` (``mp_harness``): a
simulated node with its own tier directory (``ORBAX_PATHWAYS_TIER_DIR``, set by the test),
saving through Orbax v1's ``training.Checkpointer``.

    local_steps_v1_worker.py save|resume CKPT

``save``: a v1 Checkpointer saving to storage every 100 steps saves steps 0..25 (local-only
steps every ``ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS``, set by the test): 'w' split over every
device, 'r' replicated, the numpy leaf 'n'; right after each ``save()`` the arrays are donated
to a jitted step and 'n' is overwritten in place (the loop goes on while the local-only save
runs in the background). With ``V1_ITERATOR=1`` a v1 data iterator
(``support.iterators.V1Iterator``, at position ``100 * step + process``, moved on right after
``save()``) is saved beside the state through ``save_checkpointables``, as MaxText's v1
trainers save grain's, and ``resume`` restores it beside the state (``args=``). Emits v1's
storage steps. The values and layout are
``local_steps_worker.py``'s (``sharded``). ``resume``: ``preemption.resume`` through a
v1 Checkpointer onto the current processes (a mesh of however many there are), checks every
addressable shard against the step it returned, emits the step and the bytes by source.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
  from support import mp_worker  # pylint: disable=g-import-not-at-top

  mp_worker.init()
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from orbax_pathways import preemption  # pylint: disable=g-import-not-at-top
  from orbax_pathways import stats  # pylint: disable=g-import-not-at-top

  from support import iterators  # pylint: disable=g-import-not-at-top
  from support.workers import local_steps_worker as same  # pylint: disable=g-import-not-at-top
  mode, root = sys.argv[1], sys.argv[2]
  shard = same.shardings('sharded')

  def state(step):
    return same.state_of(step, shard)

  policy = ocp.v1.training.save_decision_policies.FixedIntervalPolicy(100)
  if mode == 'save':
    own = jax.jit(lambda t: jax.tree.map(lambda x: x + 0, t))  # buffers jax owns
    spoil = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 1, t), donate_argnums=0)
    it = iterators.V1Iterator() if os.environ.get('V1_ITERATOR') == '1' else None
    with ocp.v1.training.Checkpointer(root, save_decision_policy=policy) as ckptr:
      for step in range(26):
        st = state(step)
        st = {**own({k: st[k] for k in shard}), 'n': st['n']}
        if it is None:
          ckptr.save(step, st)
        else:
          it.pos = 100 * step + jax.process_index()
          ckptr.save_checkpointables(step, {'state': st, 'iter': it})
          it.pos = -1
        spoil({k: st[k] for k in shard})
        st['n'][...] = -1
      ckptr.wait()
      mp_worker.emit({'steps': [c.step for c in ckptr.checkpoints]})
  else:
    it = iterators.V1Iterator(-1) if os.environ.get('V1_ITERATOR') == '1' else None
    with ocp.v1.training.Checkpointer(root, save_decision_policy=policy) as ckptr:
      if it is None:
        step, got = preemption.resume(ckptr, lambda: None, abstract_state=same.target_of(shard))
      else:
        step, items = preemption.resume(ckptr, lambda: None,
                                        args={'state': same.target_of(shard), 'iter': it})
        assert items['iter'] is it
        got = items['state']
    same.assert_step(got, step)
    mp_worker.emit({'step': step, 'exact': True, 'pos': None if it is None else it.pos,
                    'bytes_by_source': stats.last_restore().bytes_by_source})
  multihost_utils.sync_global_devices('done')


if __name__ == '__main__':
  main()
