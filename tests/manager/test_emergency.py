"""Orbax's own emergency (multi-tier) CheckpointManager with orbax_pathways imported: the class
``ORBAX_PATHWAYS_EMERGENCY=orbax`` keeps (``import orbax_pathways`` otherwise puts the drop-in of
``multitier/emergency.py`` in its place: ``test_emergency_dropin.py``), and the one that options the
drop-in does not map fall back to. Here it is built as Orbax's class itself
(``_compat.orbax_emergency.build_stock``), and the workers run with the variable set.

In one process (8 CPU devices, local and persistent directories under tmp_path): with one slice
it is a plain CheckpointManager over the persistent directory, so our handler writes the arrays
(our ``_pathways`` metadata is there). With several slices it builds its PyTreeCheckpointHandlers
with explicit type-handler registries holding Orbax's own ArrayHandler, so our handler is never
called: the README says so, and the second test fails the day that changes.

On several ``jax.distributed`` processes (``support/workers/
emergency_worker.py``): built as MaxText builds it, on 2 processes x 4 devices and on 4 x 2
(Orbax's own test layout), it saves, lists and restores from local and from persistent, as
stock does. Each slice runs its own manager (the persistent one on the primary slice, a local
one per process on the others), so no agreement of ours may wait for a process of another
slice. The same for managers that some processes never call at all. A hang fails in bounded
time: every worker dumps its stacks to stderr before the harness kills it and names it.
"""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency
import pytest

import orbax_pathways
from orbax_pathways.manager import lease
from orbax_pathways._compat import orbax_emergency
from support import REPO
from support.arrays import mesh, put
from support.mp_harness import run_processes

WORKER = os.path.join(REPO, 'tests', 'support', 'workers', 'emergency_worker.py')
LIMIT_S = 150  # a run that has not ended by then hangs (a healthy one takes 5-20 s)


def _run(tmp_path, monkeypatch, slices: int):
  """Saves steps 0..2 (persistent every 2 steps), restores the latest; returns (steps, restored,
  state, which ProxyArrayHandler methods ran)."""
  m = mesh((slices, 8 // slices), ('replica', 'data'))
  state = {'w': put(np.arange(256, dtype=np.float32).reshape(16, 16), m, None, 'data'),
           'b': put(np.arange(8, dtype=np.int32), m, 'data')}
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  (tmp_path / 'local').mkdir()
  options = emergency.CheckpointManagerOptions(
      local=emergency.LocalCheckpointOptions(save_interval_steps=1),
      persistent=emergency.PersistentCheckpointOptions(save_interval_steps=2))
  ours = orbax_pathways.installed()
  assert ours is not None
  calls = []
  for name in ('serialize', 'deserialize'):
    original = getattr(ours, name)

    async def spy(*a, _original=original, _name=name, **k):
      calls.append(_name)
      return await _original(*a, **k)
    monkeypatch.setattr(ours, name, spy)
  with orbax_emergency.build_stock(tmp_path / 'local', tmp_path / 'persistent', m, abstract,
                                   options=options) as mngr:
    for step in range(3):
      mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    mngr.wait_until_finished()
    steps = list(mngr.all_steps())
    restored = mngr.restore(mngr.latest_step())
  restored = restored['state'] if 'state' in restored else restored
  return steps, restored, state, calls


def _pathways_dirs(root):
  return sorted(os.path.relpath(d, root) for d, _, _ in os.walk(root) if d.endswith('_pathways'))


def _assert_same(restored, state):
  for k, v in state.items():
    np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(v))
    assert restored[k].sharding.is_equivalent_to(v.sharding, v.ndim)


def test_single_slice_emergency_manager_uses_our_handler(tmp_path, monkeypatch):
  steps, restored, state, calls = _run(tmp_path, monkeypatch, slices=1)
  assert steps == [0, 2]
  _assert_same(restored, state)
  assert 'serialize' in calls and 'deserialize' in calls
  assert _pathways_dirs(tmp_path / 'persistent') == ['0/state/_pathways', '2/state/_pathways']


def test_multislice_emergency_manager_uses_orbax_handler_not_ours(tmp_path, monkeypatch):
  steps, restored, state, calls = _run(tmp_path, monkeypatch, slices=2)
  assert steps == [0, 2]
  _assert_same(restored, state)
  assert calls == []  # explicit registries: Orbax's ArrayHandler wrote and read everything
  assert _pathways_dirs(tmp_path) == []


# ----------------------------------------------------------------------------------------------
# Several processes.


def _run_workers(mode, processes, devices, tmp_path, env=None):
  return run_processes(WORKER, processes, devices_per_process=devices, args=[mode],
                       shared_dir=str(tmp_path), timeout=LIMIT_S, fail_fast_grace=30,
                       env={'DUMP_S': str(LIMIT_S - 20), 'ORBAX_PATHWAYS_EMERGENCY': 'orbax',
                            **(env or {})})


@pytest.mark.multiprocess
@pytest.mark.parametrize('processes,devices,service', [(2, 4, 'true'), (4, 2, 'false')])
def test_emergency_manager_built_as_maxtext_saves_lists_and_restores(tmp_path, processes,
                                                                     devices, service):
  """Local every step, persistent every 2: steps 0..3 leave 0 and 2 in persistent and 3 (the
  local manager keeps one) in each local directory of the second slice; a data iterator's
  state goes with them into the non-replicated directory (a manager of every process, whose
  processes ran different numbers of saves before: the local slice saves every step). Step 3
  restores from local, step 2 from persistent (with the iterator's state), and after this
  node's local copies are gone a fresh manager restores the newest step from persistent. JAX's
  preemption service on (MaxText's default) on 2 x 4; off on 4 x 2, where our own preemption
  agreement runs in each slice's manager."""
  results = _run_workers('emergency', processes, devices, tmp_path,
                         env={'JAX_ENABLE_PREEMPTION_SERVICE': service})
  per_slice = processes // 2
  for r in results:
    out, me = r.result, r.process_id
    assert out is not None, r.stderr_tail
    primary_slice = me < per_slice
    assert out['in_primary_slice'] == primary_slice
    assert out['saved'] == [True] * 4 and out['steps'] == [0, 2, 3] and out['latest'] == 3, out
    assert out['restored_3'] and out['restored_2'], out  # equal values, every shard
    assert out['restored_2_with_dataset'] and out['dataset_2'] == {'process': 0, 'step': 2}, out
    assert out['fresh_latest'] == 2 and out['fresh_restored'], out
    # The writer lease of each directory was held while saving (the persistent and the
    # non-replicated ones by process 0; each local one by its own process), released at close.
    want = (['non_replicated', 'persistent'] if me == 0 else [] if primary_slice else
            [f'local/{me}'])
    assert out['held'] == want and out['held_after_close'] == [], out
    assert out['local_steps'] == ([] if primary_slice else [3]), out
  for name in ('persistent', 'non_replicated'):  # no lease left behind
    assert sorted(os.listdir(tmp_path / name)) == ['0', '2'], name


@pytest.mark.multiprocess
def test_managers_that_some_processes_never_call(tmp_path):
  """Process 0 calls no manager; processes 1 and 2 save (our preemption agreement on: JAX's
  service off) and restore through a manager with ``active_processes={1, 2}`` and
  ``primary_host=1`` on one directory, and through one with ``primary_host=None`` and a
  directory per process. Neither waits for process 0; each process holds the lease of the
  directories it writes."""
  results = _run_workers('subset', 3, 2, tmp_path, env={'JAX_ENABLE_PREEMPTION_SERVICE': 'false'})
  assert results[0].result == {'calls': False, 'preemption_service': False}
  for r in results[1:]:
    out, me = r.result, r.process_id
    assert out['shared_steps'] == [0, 1] and out['per_process_steps'] == [0, 1], out
    assert out['shared_restored'] and out['per_process_restored'], out
    assert out['shared_held'] == (['shared'] if me == 1 else []), out
    assert out['per_process_held'] == [f'own_{me}'], out
  assert not (tmp_path / 'shared' / lease.LEASE_FILE).exists()
