"""One of two ``jax.distributed`` processes (two devices each) saving or restoring on gs://, for
``tests/storage/test_gcs.py`` (``test_two_processes_save_and_restore_on_gcs``, ``mp_harness``).

    gcs_mp_worker.py GS_PATH save|restore

``save``: a (64, 32) float32 array sharded over a (2, 2) ('proc', 'local') mesh saved as step 0
with an unchanged ``ocp.CheckpointManager``; emits this process's written bytes by writer.
``restore``: restores step 0 without a target; emits this process's shard digests and the
restored PartitionSpec.
"""

from __future__ import annotations

import sys


def main() -> None:
  from support import mp_worker  # pylint: disable=g-import-not-at-top

  mp_worker.init()

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top

  path, mode = sys.argv[1], sys.argv[2]
  m = Mesh(np.asarray(jax.devices()).reshape(2, 2), ('proc', 'local'))
  value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  x = jax.make_array_from_callback(value.shape, NamedSharding(m, P('proc', 'local')),
                                   lambda i: value[i])
  with ocp.CheckpointManager(path) as mngr:
    if mode == 'save':
      mngr.save(0, args=ocp.args.StandardSave({'w': x}))
      mngr.wait_until_finished()
      st = orbax_pathways.stats.last_save()
      mp_worker.emit({'written': st.written_bytes})
    else:
      r = mngr.restore(0)
      mp_worker.emit({'shards': mp_worker.shard_digests(r['w']),
                      'spec': list(r['w'].sharding.spec)})


if __name__ == '__main__':
  main()
