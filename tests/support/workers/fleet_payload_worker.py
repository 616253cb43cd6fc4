"""What one colocated worker call carries, in a fresh interpreter with N virtual CPU devices
(each its own simulated worker host), for ``tests/transports/test_fleet.py``'s ``payloads`` fixture
(``procs.worker_json``, one run per fleet size).

    python -m support.workers.fleet_payload_worker CKPT

Saves a state with a fixed share per host through the colocated transport and restores it with
a target (values checked); ``colocated_worker.make_worker_save`` / ``make_worker_restore`` are wrapped
to measure what colocated Python pickles and ships to every worker. Prints the sizes (task,
function, payload row), the writers and readers, the chunks verified and the restore's
metadata reads (index, records).
"""

from __future__ import annotations

import dataclasses
import json
import sys


def main() -> None:
  import cloudpickle  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.experimental.colocated_python import serialization  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax_pathways.storage import meta_io  # pylint: disable=g-import-not-at-top
  from orbax_pathways.transports import colocated  # pylint: disable=g-import-not-at-top
  from orbax_pathways.transports import colocated_worker  # pylint: disable=g-import-not-at-top

  ckpt = sys.argv[1]
  n = jax.device_count()
  mesh = Mesh(np.asarray(jax.devices()).reshape(n // 4, 4), ('data', 'model'))
  # A fixed share per host: every device holds 8x64, 16x32 and 16x64 (4 replicas) elements.
  layout = {'a': ((n * 8, 64), P(('data', 'model'))), 'b': ((n // 4 * 16, 128), P('data', 'model')),
            'c': ((n // 4 * 16, 64), P('data'))}
  rng = np.random.default_rng(0)
  values = {k: rng.standard_normal(shape, dtype=np.float32) for k, (shape, _) in layout.items()}
  state = {k: jax.device_put(values[k], NamedSharding(mesh, spec)) for k, (_, spec) in layout.items()}
  target = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for k, a in state.items()}

  ser = serialization._serialize  # what colocated Python pickles and ships to every worker

  def shipped(fn, specs):
    # The pickle also holds the call's output specs; colocated Python writes an equal sharding
    # once, so shardings the function shares with them cost nothing: count what it adds.
    return len(ser((fn, specs))) - len(ser((None, specs)))

  got = {}
  make_save, make_restore = colocated_worker.make_worker_save, colocated_worker.make_worker_restore

  def save_hook(task):
    fn = make_save(task)
    got['save_task'] = len(cloudpickle.dumps(task))
    got['save_fn'] = shipped(fn, ())
    return fn

  def restore_hook(task):
    fn = make_restore(task)
    specs = tuple(t.sharding for t in task.targets)
    got['restore_fn'] = shipped(fn, specs)
    got['restore_task_no_shardings'] = len(cloudpickle.dumps(dataclasses.replace(
        task, targets=tuple(dataclasses.replace(t, sharding=None) for t in task.targets))))
    got['restore_chunks_in_call'] = sum(len(t.chunks) for t in task.targets)
    return fn

  colocated_worker.make_worker_save, colocated_worker.make_worker_restore = save_hook, restore_hook

  orbax_pathways.install(orbax_pathways.Options(transport='colocated'))
  with ocp.CheckpointManager(ckpt) as mngr:
    mngr.save(0, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
  st = orbax_pathways.stats.last_save()
  meta_io.clear_cache()
  before = meta_io.read_counts()
  with ocp.CheckpointManager(ckpt) as mngr:
    restored = mngr.restore(0, args=ocp.args.StandardRestore(target))
  rst = orbax_pathways.stats.last_restore()
  after = meta_io.read_counts()
  for k, v in values.items():
    np.testing.assert_array_equal(np.asarray(restored[k]), v, err_msg=k)
  got.update(
      row=max(colocated.payload_row_bytes), writers=len(st.written_bytes),
      readers=len(rst.bytes_read), verified=rst.chunks_verified,
      index_reads=after.get('index', 0) - before.get('index', 0),
      record_reads=after.get('record', 0) - before.get('record', 0))
  print(json.dumps(got))


if __name__ == '__main__':
  main()
