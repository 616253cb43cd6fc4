"""The ``jax.monitoring`` metric names a save and a restore record, in a fresh interpreter, for
``tests/install/test_metrics.py`` (``procs.run_worker``).

    python -m support.workers.metrics_probe_worker ours|stock CKPT

Listens to every event, duration and scalar; with ``ours`` imports orbax_pathways first (the
test sets ``ORBAX_PATHWAYS_DISABLE=1`` for ``stock``); saves a sharded and a replicated array
with an unchanged ``CheckpointManager`` and restores them with a target. Prints the sorted names
under ``/jax/orbax`` and ``/jax/checkpoint`` as a JSON list.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  if sys.argv[1] == 'ours':
    import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  path = sys.argv[2]
  names = set()
  jax.monitoring.register_event_listener(lambda n, **kw: names.add(n))
  jax.monitoring.register_event_duration_secs_listener(lambda n, d, **kw: names.add(n))
  jax.monitoring.register_scalar_listener(lambda n, v, **kw: names.add(n))
  m = Mesh(np.asarray(jax.devices()).reshape(4, 2), ('data', 'model'))
  state = {'w': jax.device_put(np.ones((512, 256), np.float32), NamedSharding(m, P('data', 'model'))),
           'r': jax.device_put(np.ones((64,), np.int32), NamedSharding(m, P()))}
  with ocp.CheckpointManager(path) as mngr:
    mngr.save(0, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
    mngr.restore(0, args=ocp.args.StandardRestore(target))
  print(json.dumps(sorted(n for n in names
                          if n.startswith('/jax/orbax') or n.startswith('/jax/checkpoint'))))


if __name__ == '__main__':
  main()
