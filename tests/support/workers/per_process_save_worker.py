"""Worker for ``tests/multiprocess/test_per_process_saves.py`` (``support.mp_harness``), with
orbax_pathways imported: each process saves alone into a directory of its own, as Orbax's
local managers do (``MultiprocessingOptions(primary_host=None, active_processes={process})``,
an array handler with ``primary_host=None, replica_id=None``; Orbax's operation ids and signals
of the process's own, ``orbax_process_local.alone``), once through Orbax's
``ArrayHandler`` and once through ``ProxyArrayHandler``. The state spans every process's devices:
``w`` sharded, ``b`` replicated, ``s`` small and sharded.

Emits, per handler: the item's array names on disk, whether the restore from this process's own
directory equals the saved values on every shard this process holds, and (ours) whether a stock
registry restores ours the same.
"""

from __future__ import annotations

import faulthandler
import os

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
SHAPES = {'w': ((16, 8), P('x', None)), 'b': ((8,), P()), 's': ((4,), P('x'))}


def value(name: str) -> np.ndarray:
  shape = SHAPES[name][0]
  return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 100 * len(name)


def main() -> None:
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  shardings = {n: jax.sharding.NamedSharding(mesh, spec) for n, (_, spec) in SHAPES.items()}
  state = {n: jax.make_array_from_callback(value(n).shape, shardings[n],
                                           lambda idx, n=n: value(n)[idx]) for n in SHAPES}
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)

  def registry(cls):
    return ocp.type_handlers.create_type_handler_registry((jax.Array, cls(
        primary_host=None, replica_id=None, use_replica_parallel=False)))

  def manager(directory, cls):
    mp = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={ME},
                                            barrier_sync_key_prefix=f'own-{ME}')
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=mp,
                                          type_handler_registry=registry(cls))
    options = ocp.CheckpointManagerOptions(create=False, save_root_metadata=False,
                                           multiprocessing_options=mp)
    os.makedirs(directory, exist_ok=True)
    return ocp.CheckpointManager(directory, options=options, item_handlers=handler)

  def equal(restored) -> bool:
    return all(np.array_equal(np.asarray(s.data), value(n)[s.index])
               for n, arr in restored.items() for s in arr.addressable_shards)

  out = {}
  for cls in (ocp.type_handlers.ArrayHandler, orbax_pathways.ProxyArrayHandler):
    directory = os.path.join(w.shared_dir(), cls.__name__, f'process_{ME}')
    # Each process's saves with operation ids and signals of their own, as a node step's: two
    # processes saving alone at once would otherwise wait on each other's signal keys.
    with orbax_process_local.alone(ME), manager(directory, cls) as mngr:
      mngr.save(0, args=ocp.args.PyTreeSave(state))
      mngr.wait_until_finished()
      item = os.path.join(directory, '0', 'default')
      got = {'arrays': sorted(n for n in os.listdir(item) if n in SHAPES)
                       or sorted(mngr.item_metadata(0).keys())}
      got['restored'] = equal(mngr.restore(0, args=ocp.args.PyTreeRestore(
          abstract, restore_args=restore_args)))
    if cls is orbax_pathways.ProxyArrayHandler:
      got['wrote'] = orbax_pathways.stats.last_save().arrays
      with orbax_process_local.alone(ME), manager(directory,
                                                  ocp.type_handlers.ArrayHandler) as stock:
        got['stock_reads_ours'] = equal(stock.restore(0, args=ocp.args.PyTreeRestore(
            abstract, restore_args=restore_args)))
    out[cls.__name__] = got
  w.emit(out)
  # Process 0 hosts jax's coordination service: every process meets once more before exiting.
  jax_distributed.distributed_client().wait_at_barrier('per_process_save_worker', 10 ** 6)


main()
