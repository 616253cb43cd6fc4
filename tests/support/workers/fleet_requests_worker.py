"""Storage requests per step on fake-gcs-server, ours against stock Orbax in one interpreter with
N virtual CPU devices, for ``tests/transports/test_fleet.py``'s
``test_requests_per_step_exceed_stock_by_a_constant_per_host`` (``procs.worker_json``).

    python -m support.workers.fleet_requests_worker save|restore SERVER_URL ROOT

This process's own ``FaultProxy`` (no faults) counts every request on its way to the server.
For stock Orbax, then the local and the colocated transport (hedging off), in ``ROOT/<impl>``:
``save`` saves step 0 (jit, directories) and counts the requests of saving step 1; ``restore``
counts those of restoring step 1 with a target (values checked). Prints per implementation the
requests, those under ``_pathways/`` and the hedged ones.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def main() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  from support import gcs_server  # pylint: disable=g-import-not-at-top
  from support.fault_proxy import FaultProxy  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax_pathways.storage import hedge  # pylint: disable=g-import-not-at-top

  mode, server_url, root = sys.argv[1:4]
  proxy = FaultProxy(server_url, rate=0.0).start()
  seen = []
  orig = proxy._choose
  proxy._choose = lambda m, t: (seen.append(t.replace('%2F', '/')), orig(m, t))[1]
  for k in gcs_server.FakeGcs.unset_keys():
    os.environ.pop(k, None)
  os.environ.update(gcs_server.hermetic_env(proxy.url, tempfile.mkdtemp()))
  gcs_server.configure_fsspec_anon()

  n = jax.device_count()
  mesh = Mesh(np.asarray(jax.devices()).reshape(n // 4, 4), ('data', 'model'))
  specs = [P('data', 'model'), P(('data', 'model')), P('data'), P('model', 'data')]
  values = {f'a{i}': np.arange(n * 64, dtype=np.float32).reshape(n, 64) + i for i in range(8)}
  state = {k: jax.device_put(v, NamedSharding(mesh, specs[i % 4]))
           for i, (k, v) in enumerate(values.items())}
  target = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for k, a in state.items()}
  out = {}
  for impl in ('stock', 'local', 'colocated'):
    if impl == 'stock':
      orbax_pathways.uninstall()
    else:
      # Hedging off (a deadline of an hour, which no request here reaches): a hedge is a
      # second request issued because the first was slow, so on a loaded machine it would add
      # requests that say nothing about what a step costs; hedging has tests of its own
      # (test_gcs_deadlines, test_gcs_request_kinds).
      orbax_pathways.install(orbax_pathways.Options(
          transport=impl, request_deadline_floor_s=3600, request_deadline_cap_s=3600))
    path = f'{root}/{impl}'
    if mode == 'save':
      with ocp.CheckpointManager(path) as mngr:
        mngr.save(0, args=ocp.args.StandardSave(state))  # the first save: jit, directories
        mngr.wait_until_finished()
        del seen[:]
        mngr.save(1, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
    else:
      with ocp.CheckpointManager(path) as mngr:
        del seen[:]
        restored = mngr.restore(1, args=ocp.args.StandardRestore(target))
      for k, v in values.items():
        np.testing.assert_array_equal(np.asarray(restored[k]), v, err_msg=k)
    out[impl] = {'requests': len(seen), 'pathways': sum('/_pathways/' in t for t in seen),
                 'hedged': {k: v for k, v in hedge.counts().items() if v}}
  proxy.stop()
  print(json.dumps(out))


if __name__ == '__main__':
  main()
