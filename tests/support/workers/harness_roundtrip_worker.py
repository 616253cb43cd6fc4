"""One ``jax.distributed`` process of ``tests/multiprocess/test_mp_harness.py``'s round trips
(``mp_harness``): stock Orbax (no orbax_pathways import) across real processes.

    harness_roundtrip_worker.py

Saves a NamedSharding array spread over all 8 global devices and a partly replicated one, plus a
Python int, with a stock ``ocp.CheckpointManager`` (StandardSave) into ``shared_dir()/ckpt``;
restores them on the same sharding and resharded onto another layout (every process then reads
chunks other processes wrote). Emits this process's index, its local devices, the digests of
every addressable shard (saved, restored the same, restored moved), the restored step and the
manager's latest step. The shapes and values are ``GLOBAL_SHAPE``, ``REPLICATED_SHAPE``,
``STEP`` and ``values()`` below (numpy only), which the test imports to check the digests.
"""

from __future__ import annotations

import os

import numpy as np

GLOBAL_SHAPE = (32, 16)
REPLICATED_SHAPE = (8, 4)
STEP = 5


def values() -> dict[str, np.ndarray]:
  """The saved arrays: 'w' (8 distinct shards) and 'r' (replicated along 'model')."""
  w_np = np.arange(np.prod(GLOBAL_SHAPE), dtype=np.float32).reshape(GLOBAL_SHAPE) * 0.5
  r_np = (np.arange(np.prod(REPLICATED_SHAPE), dtype=np.int32) - 7).reshape(REPLICATED_SHAPE)
  return {'w': w_np, 'r': r_np}


def main() -> None:
  from support import mp_worker as w  # pylint: disable=g-import-not-at-top

  w.init()

  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  assert jax.device_count() == 8, jax.device_count()
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('data', 'model'))
  host = values()

  def make(value, spec):
    s = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, s, lambda idx: value[idx])

  state = {
      'w': make(host['w'], P('data', 'model')),  # 8 distinct shards, one per device
      'r': make(host['r'], P('data', None)),  # replicated along 'model'
      'step': STEP,
  }
  assert not state['w'].is_fully_addressable

  shard_sums = w.shard_digests

  ckpt_dir = os.path.join(w.shared_dir(), 'ckpt')
  mngr = ocp.CheckpointManager(ckpt_dir)
  mngr.save(STEP, args=ocp.args.StandardSave(state))
  mngr.wait_until_finished()

  def target(spec_w, spec_r):
    return {
        'w': jax.ShapeDtypeStruct(GLOBAL_SHAPE, np.float32, sharding=NamedSharding(mesh, spec_w)),
        'r': jax.ShapeDtypeStruct(REPLICATED_SHAPE, np.int32, sharding=NamedSharding(mesh, spec_r)),
        'step': 0,
    }

  same = mngr.restore(STEP, args=ocp.args.StandardRestore(target(P('data', 'model'),
                                                                 P('data', None))))
  # Resharded: columns over all 8 devices, so every process reads chunks other processes wrote.
  moved = mngr.restore(STEP, args=ocp.args.StandardRestore(target(P(None, ('data', 'model')),
                                                                  P())))
  mngr.close()

  w.emit({
      'process_index': jax.process_index(),
      'local_devices': [d.id for d in jax.local_devices()],
      'saved': {'w': shard_sums(state['w']), 'r': shard_sums(state['r'])},
      'same': {'w': shard_sums(same['w']), 'r': shard_sums(same['r']), 'step': same['step']},
      'moved': {'w': shard_sums(moved['w']), 'r': shard_sums(moved['r'])},
      'latest_step': mngr.latest_step(),
  })


if __name__ == '__main__':
  main()
