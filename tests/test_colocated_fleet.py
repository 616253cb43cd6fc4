"""A colocated save over 256 simulated workers, restored in a fresh process (issue 26, item 7).

Two fresh interpreters with 256 virtual CPU devices (``XLA_FLAGS``), the colocated transport
chosen by ``ORBAX_PATHWAYS_TRANSPORT=colocated``, the node-local tier on (a directory of the
test's own): one saves a state, the other restores it with a target and checks every value.
Each CPU device is its own simulated worker host, and on the CPU backend they all share this
one node's tier.

What a user checks: the restore finishes within its call's deadline (a 10 s peer timeout),
every value is the one saved, every byte came from the tier, and the tier's manifests were each
opened once by the whole restore. Before: every one of the 256 simulated hosts listed the
node's tier and read all 256 manifests (65,536 reads, 13 s here), and the call's deadline
counted from its start.
"""

from __future__ import annotations

import os

from support.procs import run_json

N = 256

_CODE = r'''
import json, os, sys
import numpy as np
import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import orbax_pathways

mode, path, tier = os.environ['MODE'], os.environ['CKPT'], os.environ['ORBAX_PATHWAYS_LOCAL_DIR']
n = jax.device_count()
assert n == %(n)d, n
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
else:
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
''' % {'n': N}


def test_colocated_restore_over_256_workers_in_a_fresh_process(tmp_path):
  path, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  env = {'ORBAX_PATHWAYS_TRANSPORT': 'colocated', 'ORBAX_PATHWAYS_LOCAL_DIR': tier, 'CKPT': path}
  saved = run_json(_CODE, env={**env, 'MODE': 'save'}, devices=N, timeout=240)
  assert saved == {'transport': 'colocated', 'writers': N}, saved
  # A 10 s peer timeout: the call's deadline, which the restore ran past before (~13 s of
  # manifest reads here, unloaded); a restore that keeps making progress never reaches it.
  got = run_json(_CODE, env={**env, 'MODE': 'restore', 'ORBAX_PATHWAYS_PEER_TIMEOUT_S': 10},
                 devices=N, timeout=240)
  print(f'\n[256 colocated workers] {got}')
  assert got['equal'] == {'r': True, 'v': True, 'w': True}, got
  assert got['transport'] == 'colocated' and got['readers'] == N, got
  # Every byte from this node's tier ('r', replicated, is read by every simulated host).
  assert got['bytes'] == got['nbytes'] and got['by_source'].get('storage', 0) == 0, got
  # One manifest read per entry for the whole restore, not one per entry per simulated host.
  assert got['entries'] == N and got['opened']['manifest'] == N, got
  assert os.path.isdir(tier)
