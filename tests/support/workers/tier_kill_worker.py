"""One ``jax.distributed`` process of ``tests/tier/test_tier_multiprocess.py`` (``mp_harness``): a
simulated node with its own tier directory (``ORBAX_PATHWAYS_TIER_DIR``, set by the test).

    tier_kill_worker.py save|restore CKPT

``save``: saves steps 1 and 2 of a sharded, a row-sharded and a replicated array with an
unchanged ``ocp.CheckpointManager``, waits for the tier copy, meets the others in a barrier,
emits ``{'saved': True}`` and SIGKILLs itself (right after the commit). ``restore``: restores
the latest step onto the same shardings, checks every addressable shard against the saved
values, emits the step and the bytes by source.
"""

from __future__ import annotations

import os
import signal
import sys


def main() -> None:
  from support import mp_worker  # pylint: disable=g-import-not-at-top

  mp_worker.init()
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from orbax_pathways import stats  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import store as tier_store  # pylint: disable=g-import-not-at-top

  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  mode, root = sys.argv[1], sys.argv[2]
  host = {'w': np.arange(256 * 64, dtype=np.float32).reshape(256, 64) * 0.5,
          'b': np.arange(96, dtype=np.int32), 'r': np.arange(40, dtype=np.float32) + 0.25}
  n = jax.device_count()
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(n // 2, 2), ('x', 'y'))
  shard = {'w': jax.sharding.NamedSharding(mesh, P('x', 'y')),
           'b': jax.sharding.NamedSharding(mesh, P('x')),
           'r': jax.sharding.NamedSharding(mesh, P())}  # replicated: p0 writes it

  def make(k):
    return jax.make_array_from_callback(host[k].shape, shard[k], lambda i: host[k][i])

  state = {k: make(k) for k in host}
  with ocp.CheckpointManager(root) as m:
    if mode == 'save':
      for step in (1, 2):
        m.save(step, args=ocp.args.StandardSave(state))
      m.wait_until_finished()
      # The tier copy runs in the background, off the commit path: this test is about a kill
      # after the copy landed (a kill before it only costs that copy: storage serves it).
      tier_store.flush()
      multihost_utils.sync_global_devices('saved')
      mp_worker.emit({'saved': True})
      os.kill(os.getpid(), signal.SIGKILL)
    target = {k: jax.ShapeDtypeStruct(host[k].shape, host[k].dtype, sharding=shard[k])
              for k in host}
    out = m.restore(m.latest_step(), args=ocp.args.StandardRestore(target))
    for k in host:
      for s in out[k].addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), host[k][s.index])
    st = stats.last_restore()
    mp_worker.emit({'step': st.step, 'bytes_by_source': st.bytes_by_source, 'exact': True})


if __name__ == '__main__':
  main()
