"""One ``jax.distributed`` process of ``tests/manager/test_emergency_dropin.py``
(``support.mp_harness``): a simulated node whose node-local directory is
``SHARED/local/<NODE>`` (``NODE`` set per process by the test, default the process id), built
as MaxText builds Orbax's emergency ``CheckpointManager``, with ``orbax_pathways`` imported (its
drop-in). Each process is one slice (a mesh of ``('data', 'fsdp')`` = (processes, 2)).

    emergency_dropin_worker.py save|restart

State: ``'w'`` split over every device (each process holds a quarter on 4 processes) and
``'b'`` replicated; values are a function of the step. A data iterator's state (``dataset``,
``JsonSave``) goes with each step.

``save``: local every step (``LocalCheckpointOptions(save_interval_steps=1)``), persistent
every 4 (``PersistentCheckpointOptions(save_interval_steps=4)``), steps 0..6; waits for the
saves, emits the listing, and exits without closing the manager (every process stops at once,
as a preempted job does).
``restart``: a fresh manager over however many processes there are now (the mesh and abstract
state of this topology), ``latest_step()`` and ``restore`` of it with the dataset; checks every
addressable shard against that step's values; emits the step, the dataset and the bytes by
source of the restore.

``DATASET=iterator``: the dataset is a data iterator saved by its own handler
(``support/iterators.py``) at position ``100 * step + process``, moved on right after each
``save()``; the restart emits its restored position as ``{'pos': ...}``.
"""

from __future__ import annotations

import os
import sys


def values(step: int):
  import numpy as np  # pylint: disable=g-import-not-at-top
  return {'w': np.arange(48 * 16, dtype=np.float32).reshape(48, 16) + 1000 * step,
          'b': np.arange(8, dtype=np.int32) - step}


def main() -> None:
  from support import mp_worker  # pylint: disable=g-import-not-at-top

  mp_worker.init()
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint.experimental.emergency import checkpoint_manager as em  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from orbax_pathways import stats  # pylint: disable=g-import-not-at-top

  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  mode = sys.argv[1]
  shared = mp_worker.shared_dir()
  me = mp_worker.process_id()
  node = os.environ.get('NODE', str(me))
  devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
  mesh = jax.sharding.Mesh(devices.reshape(-1, 2), ('data', 'fsdp'))
  shardings = {'w': jax.sharding.NamedSharding(mesh, P(('data', 'fsdp'), None)),
               'b': jax.sharding.NamedSharding(mesh, P())}

  def state(step):
    host = values(step)
    return {k: jax.make_array_from_callback(host[k].shape, shardings[k],
                                            lambda i, k=k: host[k][i]) for k in host}

  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
              for k, v in values(0).items()}
  local = os.path.join(shared, 'local', node)
  persistent = os.path.join(shared, 'persistent')
  os.makedirs(local, exist_ok=True)
  os.makedirs(persistent, exist_ok=True)
  options = em.CheckpointManagerOptions(
      local=em.LocalCheckpointOptions(save_interval_steps=1),
      persistent=em.PersistentCheckpointOptions(save_interval_steps=4))
  mngr = em.CheckpointManager(local, persistent, global_mesh=mesh, abstract_state=abstract,
                              options=options)
  iterator = os.environ.get('DATASET') == 'iterator'
  if iterator:
    from support import iterators  # pylint: disable=g-import-not-at-top
  if mode == 'save':
    it = iterators.Iterator() if iterator else None
    saved = []
    for step in range(7):
      if iterator:
        it.pos = 100 * step + me
        dataset = iterators.IteratorSave(it)
      else:
        dataset = ocp.args.JsonSave({'step': step})
      saved.append(bool(mngr.save(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeSave(state(step)), dataset=dataset))))
      if iterator:
        it.pos = -1  # the next batches are drawn while the local save runs
    mngr.wait_until_finished()
    mp_worker.emit({'saved': saved, 'steps': list(mngr.all_steps()),
                    'class': type(mngr).__name__})
    multihost_utils.sync_global_devices('saved')
    mp_worker.stop_all_now()  # stopped, not closed: a preempted job
  step = mngr.latest_step()
  got = mngr.restore(step, args=ocp.args.Composite(
      dataset=(iterators.IteratorRestore(iterators.Iterator()) if iterator
               else ocp.args.JsonRestore())))
  if iterator:
    got = dict(got, dataset={'pos': got['dataset'].pos})
  want = values(step)
  for k, arr in got['state'].items():
    assert arr.sharding.is_equivalent_to(shardings[k], arr.ndim), (k, arr.sharding)
    for s in arr.addressable_shards:
      np.testing.assert_array_equal(np.asarray(s.data), want[k][s.index])
  mp_worker.emit({'step': step, 'exact': True, 'dataset': got['dataset'],
                  'bytes_by_source': stats.last_restore().bytes_by_source,
                  'steps': list(mngr.all_steps())})
  mngr.close()
  multihost_utils.sync_global_devices('done')


if __name__ == '__main__':
  main()
