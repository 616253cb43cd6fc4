"""A colocated save over N simulated workers, or its restore, in a fresh interpreter with N
virtual CPU devices, for ``tests/transports/test_colocated_fleet.py`` (``procs.worker_json``).

    python -m support.workers.colocated_fleet_worker save|restore CKPT N

The test sets ``ORBAX_PATHWAYS_TRANSPORT=colocated`` and ``ORBAX_PATHWAYS_TIER_DIR`` (the
node's tier). ``save``: an unchanged ``ocp.CheckpointManager`` saves a state over a
(N/4, 4) mesh; prints ``transport`` and the number of writers. ``restore``: restores it with a
target, counting the files opened under the tier (an audit hook); prints whether every value is
equal, the restore's transport, readers and bytes by source, the state's bytes as read by every
simulated host, the files opened by kind and the tier's entries.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top

  mode, path, expected = sys.argv[1], sys.argv[2], int(sys.argv[3])
  tier = os.environ['ORBAX_PATHWAYS_TIER_DIR']
  n = jax.device_count()
  assert n == expected, n
  mesh = Mesh(np.asarray(jax.devices()).reshape(n // 4, 4), ('data', 'model'))
  specs = {'w': P('data', 'model'), 'v': P(('data', 'model')), 'r': P()}
  shapes = {'w': (n * 4, 64), 'v': (n * 8, 16), 'r': (24, 8)}
  values = {k: (np.arange(np.prod(s), dtype=np.float32).reshape(s) * 0.5 + i)
            for i, (k, s) in enumerate(sorted(shapes.items()))}
  shardings = {k: NamedSharding(mesh, specs[k]) for k in shapes}
  if mode == 'save':
    state = {k: jax.device_put(v, shardings[k]) for k, v in values.items()}
    with ocp.CheckpointManager(path) as mngr:
      mngr.save(1, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()
    st = orbax_pathways.stats.last_save()
    print(json.dumps({'transport': st.transport, 'writers': len(st.written_bytes)}))
    return
  opened = {'manifest': 0, 'chunk': 0}

  def audit(event, args):
    if event == 'open' and args and isinstance(args[0], str) and args[0].startswith(tier):
      opened['manifest' if args[0].endswith('manifest.msgpack') else 'chunk'] += 1

  sys.addaudithook(audit)
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
            for k, v in values.items()}
  with ocp.CheckpointManager(path) as mngr:
    out = mngr.restore(1, args=ocp.args.StandardRestore(target))
  st = orbax_pathways.stats.last_restore()
  entries = sum(1 for dp, _, fs in os.walk(tier) for f in fs if f == 'manifest.msgpack')
  print(json.dumps({
      'equal': {k: bool(np.array_equal(np.asarray(out[k]), v)) for k, v in values.items()},
      'transport': st.transport, 'readers': len(st.bytes_read),
      'by_source': dict(st.bytes_by_source), 'bytes': sum(st.bytes_read.values()),
      'nbytes': sum(v.nbytes * (n if k == 'r' else 1) for k, v in values.items()),
      'opened': opened, 'entries': entries}))


if __name__ == '__main__':
  main()
