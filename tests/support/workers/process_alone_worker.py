"""Worker for ``tests/multiprocess/test_process_alone.py`` (``support.mp_harness``), with
orbax_pathways imported: the job's asynchronous storage ``CheckpointManager`` saves every third
step, and beside it each process saves every step alone into a directory of its own (a
synchronous manager with ``active_processes={process}``, ``primary_host=None`` and an array
handler with ``replica_id=None``) on a background thread, inside
``_compat.orbax_process_local.alone``: process 0 every step, process 1 every other step, so the
processes have made different numbers of saves alone when the job's storage save starts (and
process 0 falls behind on odd steps).

Emits the job's Orbax operation id after each storage ``save()`` (Orbax names the key-value
signals of a save after it), the storage steps, this process's own steps, and whether the
newest of each restores
equal to the values saved (the storage step on every shard this process holds; its own step
from its own directory).
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time

faulthandler.dump_traceback_later(float(os.environ.get('DUMP_S', '100')), exit=False)

from support import mp_worker as w  # pylint: disable=g-import-not-at-top

w.init()

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

import orbax_pathways  # pylint: disable=g-import-not-at-top
from orbax_pathways._compat import jax_distributed  # pylint: disable=g-import-not-at-top
from orbax_pathways._compat import orbax_process_local  # pylint: disable=g-import-not-at-top

P = jax.sharding.PartitionSpec
ME = w.process_id()
STEPS = 10


def values(step: int) -> dict[str, np.ndarray]:
  return {'w': np.arange(64 * 8, dtype=np.float32).reshape(64, 8) + step,
          'b': np.full((16,), step, np.float32)}


def main() -> None:
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  shardings = {'w': jax.sharding.NamedSharding(mesh, P('x', None)),
               'b': jax.sharding.NamedSharding(mesh, P())}

  def state(step):
    v = values(step)
    return {k: jax.make_array_from_callback(v[k].shape, shardings[k], lambda i, k=k: v[k][i])
            for k in v}

  def equal(restored, step) -> bool:
    v = values(step)
    return all(np.array_equal(np.asarray(s.data), v[k][s.index])
               for k, arr in restored.items() for s in arr.addressable_shards)

  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state(0))
  restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
  storage = ocp.CheckpointManager(
      os.path.join(w.shared_dir(), 'storage'),
      options=ocp.CheckpointManagerOptions(save_interval_steps=3, max_to_keep=10))
  own_dir = os.path.join(w.shared_dir(), f'node_{ME}')
  os.makedirs(own_dir)
  mp = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={ME})
  registry = ocp.type_handlers.create_type_handler_registry((jax.Array, (
      orbax_pathways.ProxyArrayHandler(primary_host=None, replica_id=None,
                                       use_replica_parallel=False))))
  own = ocp.CheckpointManager(own_dir, options=ocp.CheckpointManagerOptions(
      create=False, save_root_metadata=False, enable_async_checkpointing=False, max_to_keep=2,
      multiprocessing_options=mp), item_handlers=ocp.PyTreeCheckpointHandler(
          multiprocessing_options=mp, type_handler_registry=registry))

  errors: list[str] = []

  def save_alone(step, st):
    try:
      with orbax_process_local.alone(ME):
        own.save(step, args=ocp.args.PyTreeSave(st))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(f'{type(e).__name__}: {e}')

  thread = None
  op_ids = []
  for step in range(STEPS):
    st = state(step)
    storage.save(step, args=ocp.args.StandardSave(st))
    op_ids.append(orbax_process_local.job_operation_id())
    if ME == 0 and step % 2:
      time.sleep(0.05)
    if thread is not None:
      thread.join()
    if ME == 0 or step % 2 == 0:  # process 1 saves alone half as often: no lockstep
      thread = threading.Thread(target=save_alone, args=(step, st))
      thread.start()
  if thread is not None:
    thread.join()
  storage.wait_until_finished()
  newest_storage, newest_own = storage.latest_step(), own.latest_step()
  w.emit({
      'storage_steps': storage.all_steps(), 'own_steps': own.all_steps(), 'errors': errors,
      'op_ids': op_ids,
      'storage_restored': equal(storage.restore(newest_storage, args=ocp.args.StandardRestore(
          abstract)), newest_storage),
      'own_restored': equal(own.restore(newest_own, args=ocp.args.PyTreeRestore(
          abstract, restore_args=restore_args)), newest_own),
      'patched_after': orbax_process_local.installed()})
  storage.close()
  own.close()
  jax_distributed.distributed_client().wait_at_barrier('process_alone_worker', 10 ** 6)


main()
