"""Worker for ``tests/manager/test_emergency.py``'s multi-process tests (``support.mp_harness``), with
orbax_pathways imported. ``argv[1]`` is the mode:

``emergency``: Orbax's emergency CheckpointManager built as MaxText's
``create_orbax_emergency_checkpoint_manager`` builds it (``experimental_orbax_use_distributed_
process_id``, a local directory per process, one persistent directory, a mesh of 2 slices over
the ``data`` axis, ``LocalCheckpointOptions(save_interval_steps=1)``,
``PersistentCheckpointOptions(save_interval_steps=2)``), with a data iterator's state saved
through its ``persistent_non_replicated_directory`` manager (every process; primary host 0).
Saves steps 0..3 (values differ per step), lists them, restores step 3 (only in the local directories) and step 2 (only in the
persistent one), then empties this process's local directory and restores the newest step with a
fresh manager (from persistent). Emits what each step restored equal to, the listings, and which
writer leases were held while saving.

``subset``: managers that some processes never call. Process 0 calls none; processes 1 and 2
save and restore through an ordinary CheckpointManager over their own devices
(``active_processes={1, 2}``, ``primary_host=1``) and through one with ``primary_host=None``
(a directory per process, as Orbax's local manager), then every process meets in one final
barrier.

A hang shows in the harness's error: each worker dumps its threads' stacks to stderr
``DUMP_S`` seconds after it started (``faulthandler``), before the harness's timeout.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import sys

faulthandler.dump_traceback_later(float(os.environ.get('DUMP_S', '100')), exit=False)

from support import mp_worker as w  # pylint: disable=g-import-not-at-top

w.init()

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
from orbax_pathways.manager import lease  # pylint: disable=g-import-not-at-top
from orbax_pathways._compat import jax_distributed  # pylint: disable=g-import-not-at-top

P = jax.sharding.PartitionSpec
MODE = sys.argv[1]
SHARED = w.shared_dir()
ME, N = w.process_id(), w.num_processes()


def value(step: int, shape) -> np.ndarray:
  return (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1000 * step)


def make_state(step: int, mesh):
  def put(shape, spec):
    v = value(step, shape)
    return jax.make_array_from_callback(v.shape, jax.sharding.NamedSharding(mesh, spec),
                                        lambda idx: v[idx])
  return {'params': {'w': put((16, 8), P('fsdp', None)), 'b': put((8,), P())},
          'opt': {'mu': put((16, 8), P(None, 'fsdp'))}}


def equals(restored, step: int) -> bool:
  """Every shard this process holds of every leaf equals step ``step``'s values."""
  ok = True
  for leaf in jax.tree.leaves(restored):
    full = value(step, leaf.shape)
    for shard in leaf.addressable_shards:
      ok &= np.array_equal(np.asarray(shard.data), full[shard.index])
  return bool(ok)


def emergency() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint.experimental.emergency import checkpoint_manager as em  # pylint: disable=g-import-not-at-top

  if not flags.FLAGS.is_parsed():  # MaxText runs under absl.app, which parses them
    flags.FLAGS.mark_as_parsed()
  flags.FLAGS.experimental_orbax_use_distributed_process_id = True  # as MaxText does
  ocp.multihost.initialize_runtime_to_distributed_ids()
  ocp.multihost.initialize_distributed_to_device_ids()
  devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
  mesh = jax.sharding.Mesh(devices.reshape(2, -1), ('data', 'fsdp'))  # 2 slices on 'data'
  local = epath.Path(SHARED) / 'local' / str(ME)
  local.mkdir(parents=True, exist_ok=True)
  persistent = epath.Path(SHARED) / 'persistent'
  persistent.mkdir(parents=True, exist_ok=True)
  non_replicated = epath.Path(SHARED) / 'non_replicated'  # the data iterator's, every process
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, make_state(0, mesh))
  options = em.CheckpointManagerOptions(
      local=em.LocalCheckpointOptions(save_interval_steps=1),
      persistent=em.PersistentCheckpointOptions(save_interval_steps=2))

  def manager():
    return em.CheckpointManager(local, persistent, global_mesh=mesh, abstract_state=abstract,
                                options=options,
                                persistent_non_replicated_directory=non_replicated)

  mngr = manager()
  saved = [bool(mngr.save(step, args=ocp.args.Composite(
      state=ocp.args.PyTreeSave(make_state(step, mesh)),
      dataset=ocp.args.JsonSave({'process': ME, 'step': step})))) for step in range(4)]
  mngr.wait_until_finished()
  held = sorted(os.path.relpath(d, SHARED) for d in lease.held_leases())
  out = {'saved': saved, 'steps': sorted(mngr.all_steps()), 'latest': mngr.latest_step(),
         'in_primary_slice': bool(mngr.in_primary_slice), 'held': held,
         'local_steps': sorted(int(p.name) for p in local.iterdir() if p.name.isdigit()),
         'restored_3': equals(mngr.restore(3)['state'], 3),  # local only
         'restored_2': equals(mngr.restore(2)['state'], 2)}  # persistent only
  with_data = mngr.restore(2, args=ocp.args.Composite(dataset=ocp.args.JsonRestore()))
  out['dataset_2'] = with_data['dataset']
  out['restored_2_with_dataset'] = equals(with_data['state'], 2)
  mngr.close()
  out['held_after_close'] = sorted(lease.held_leases())
  for p in list(local.iterdir()):  # this node's local copies are lost: persistent must serve
    if p.is_dir():
      shutil.rmtree(p)
    else:
      p.unlink()
  fresh = manager()
  out['fresh_latest'] = fresh.latest_step()
  out['fresh_restored'] = equals(fresh.restore(fresh.latest_step())['state'], 2)
  fresh.close()
  w.emit(out)


def subset() -> None:
  """Built as Orbax's emergency manager builds its per-slice managers: the handler and Orbax's
  ArrayHandler get the manager's multiprocessing options (our handler is not used)."""
  group = (1, 2)
  out: dict = {'calls': ME in group,
               'preemption_service': jax_distributed.jax_preemption_service_active()}
  if ME in group:
    devices = np.array([d for d in jax.devices() if d.process_index in group])
    mesh = jax.sharding.Mesh(devices, ('fsdp',))
    abstract = {'w': jax.ShapeDtypeStruct((16, 8), np.float32, sharding=jax.sharding
                                          .NamedSharding(mesh, P(None, 'fsdp')))}
    for kind, primary, directory in (
        ('shared', 1, os.path.join(SHARED, 'shared')),
        ('per_process', None, os.path.join(SHARED, f'own_{ME}'))):
      mp = ocp.options.MultiprocessingOptions(primary_host=primary, active_processes=set(group),
                                              barrier_sync_key_prefix=f'subset-{kind}')
      registry = ocp.type_handlers.create_type_handler_registry((jax.Array, ocp.type_handlers
          .ArrayHandler(primary_host=primary, replica_id=None if primary is None else 0,
                        use_replica_parallel=False)))
      handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True,
                                            multiprocessing_options=mp,
                                            type_handler_registry=registry)
      options = ocp.CheckpointManagerOptions(
          create=False, save_root_metadata=False, multiprocessing_options=mp,
          enable_per_process_directory_creation=primary is None)
      os.makedirs(directory, exist_ok=True)
      with ocp.CheckpointManager(directory, options=options, item_handlers=handler) as mngr:
        for step in range(2):
          mngr.save(step, args=ocp.args.PyTreeSave({'w': make_state(step, mesh)['opt']['mu']}))
        mngr.wait_until_finished()
        out[f'{kind}_held'] = sorted(os.path.relpath(d, SHARED) for d in lease.held_leases())
        out[f'{kind}_steps'] = list(mngr.all_steps())
        out[f'{kind}_restored'] = equals(mngr.restore(1, args=ocp.args.PyTreeRestore(
            abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))), 1)
  w.emit(out)
  # Every process meets once more (process 0 hosts jax's coordination service and must outlive
  # the others), through the service, not a collective: gloo's own 30 s would end a wait for a
  # process still stuck in a manager before the harness names it.
  jax_distributed.distributed_client().wait_at_barrier('emergency_worker:subset', 10 ** 6)


{'emergency': emergency, 'subset': subset}[MODE]()
