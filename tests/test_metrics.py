"""Orbax's ``jax.monitoring`` telemetry (what dashboards are built on) is recorded with the
package installed as without it: every metric stock's save and restore record, by name."""

import json

from support.procs import run_python

_CHILD = """
    import json, jax, numpy as np, sys
    import orbax.checkpoint as ocp
    if {ours}:
      import orbax_pathways
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    names = set()
    jax.monitoring.register_event_listener(lambda n, **kw: names.add(n))
    jax.monitoring.register_event_duration_secs_listener(lambda n, d, **kw: names.add(n))
    jax.monitoring.register_scalar_listener(lambda n, v, **kw: names.add(n))
    m = Mesh(np.asarray(jax.devices()).reshape(4, 2), ('data', 'model'))
    state = {{'w': jax.device_put(np.ones((512, 256), np.float32), NamedSharding(m, P('data', 'model'))),
             'r': jax.device_put(np.ones((64,), np.int32), NamedSharding(m, P()))}}
    with ocp.CheckpointManager({path!r}) as mngr:
      mngr.save(0, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()
      target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
      mngr.restore(0, args=ocp.args.StandardRestore(target))
    print(json.dumps(sorted(n for n in names if n.startswith('/jax/orbax') or n.startswith('/jax/checkpoint'))))
"""


def _names(path, ours):
  out = run_python(_CHILD.format(ours=ours, path=str(path)),
                   env={} if ours else {'ORBAX_PATHWAYS_DISABLE': '1'})
  return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_every_orbax_metric_stock_records_is_recorded(tmp_path):
  stock = _names(tmp_path / 'stock', False)
  ours = _names(tmp_path / 'ours', True)
  assert '/jax/orbax/write/worker/io/requested/gbytes' in stock  # the probe sees stock's metrics
  assert stock - ours == set(), sorted(stock - ours)
