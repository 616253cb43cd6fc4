"""The default node-local tier on a real node, in a private mount namespace with its own
/dev/shm (``support.private_shm.run``), for ``tests/tier/test_tier.py``
(``test_the_default_tier_on_a_real_node``).

    python -m support.workers.default_tier_worker PARAMS_JSON

``PARAMS_JSON``: ``local`` (a local checkpoint directory) and ``gs`` (one on fake-gcs-server).
With ``ORBAX_PATHWAYS_TIER_DIR`` unset before orbax_pathways is imported (the default), saves
and restores one sharded array into each. Prints after ``RESULT `` whether each restore was
exact and its bytes by source, /dev/shm's listing after the local save and at the end, and
every path under /dev/shm with whether it is a directory and its mode.
"""

from __future__ import annotations

import json
import os
import stat
import sys


def main() -> None:
  p = json.loads(sys.argv[1])
  os.environ.pop('ORBAX_PATHWAYS_TIER_DIR', None)  # the default: before the import reads it
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from orbax_pathways import stats  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import store  # pylint: disable=g-import-not-at-top

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  w = np.arange(8 * 4096, dtype=np.float32).reshape(8, 4096)
  state = {'w': jax.device_put(w, jax.sharding.NamedSharding(mesh,
                                                             jax.sharding.PartitionSpec('x')))}

  def save_restore(path):
    with ocp.CheckpointManager(path) as m:
      m.save(1, args=ocp.args.StandardSave(state))
      m.wait_until_finished()
      store.flush()
      out = m.restore(1, args=ocp.args.StandardRestore(state))
    return bool(np.array_equal(np.asarray(out['w']), w)), stats.last_restore().bytes_by_source

  def tree(top):
    out = {}
    for d, dirs, files in os.walk(top):
      for n in dirs + files:
        st = os.lstat(os.path.join(d, n))
        out[os.path.relpath(os.path.join(d, n), top)] = [stat.S_ISDIR(st.st_mode),
                                                          stat.S_IMODE(st.st_mode)]
    return out

  local = save_restore(p['local'])
  after_local = sorted(os.listdir('/dev/shm'))
  remote = save_restore(p['gs'])
  print('RESULT ' + json.dumps({'local': local, 'after_local': after_local, 'remote': remote,
                                'shm': sorted(os.listdir('/dev/shm')), 'tree': tree('/dev/shm')}))


if __name__ == '__main__':
  main()
