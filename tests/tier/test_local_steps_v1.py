"""Local-only steps under Orbax v1's ``training.Checkpointer`` (what MaxText saves with): with
``Options.local_save_interval_steps``, a step v1's policy declines but that falls on the local
interval is saved to the node-local tier only, and ``preemption.resume`` takes a v1 Checkpointer
and restores the newest step the tiers can complete, else storage's.

v1 replaces its manager's checkpointer before each save with one whose handlers know v1's
arguments; the hidden manager of local-only steps saves the same arguments through a
checkpointer of that kind (``_compat/orbax_v1_training.py``). Without it
every local-only save failed ("Unable to find registered CheckpointHandler"). Its saves run in
the background from the snapshot, as v0's do (``test_local_busy.py`` shows ``save()`` not
waiting for the previous local save's commit). One process, real
Orbax v1, real tier directories; multi-process local-only steps: ``test_local_steps.py``.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways import preemption
from orbax_pathways import stats
from support.arrays import mesh
from support.mp_harness import run_processes
from support.workers import local_steps_v1_worker

WORKER = local_steps_v1_worker.__file__

v1 = ocp.v1


def _state(step: int, sharding) -> dict:
  w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step
  return {'w': jax.device_put(w, sharding), 'n': np.full((3,), step, np.int64)}


def _abstract(sharding) -> dict:
  return {'w': jax.ShapeDtypeStruct((64, 32), np.float32, sharding=sharding),
          'n': np.zeros((3,), np.int64)}


def _save_run(root, tier, caplog) -> jax.sharding.Sharding:
  """Steps 0..7 through a v1 Checkpointer saving to storage every 10 steps, with local-only
  steps every 2 (the newest 2 kept)."""
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), local_steps_in='storage', local_save_interval_steps=2,
                                                tier_keep=2))
  sharding = jax.sharding.NamedSharding(mesh(), jax.sharding.PartitionSpec('data', 'model'))
  policy = v1.training.save_decision_policies.FixedIntervalPolicy(10)
  caplog.set_level(logging.WARNING, logger='orbax_pathways')
  with v1.training.Checkpointer(root, save_decision_policy=policy) as ckptr:
    for step in range(8):
      ckptr.save(step, _state(step, sharding))
    ckptr.wait()
    assert [c.step for c in ckptr.checkpoints] == [0]  # v1's listing: storage steps only
  failed = [r.getMessage() for r in caplog.records if 'local-only' in r.getMessage()]
  assert not failed, failed
  return sharding


def test_a_v1_checkpointer_saves_local_only_steps_and_resumes_the_newest(tmp_path, caplog):
  root, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  sharding = _save_run(root, tier, caplog)
  local = root / '.orbax-pathways-local'
  assert sorted(os.listdir(local)) == ['4', '6']  # committed (no temporary name), 2 kept
  (item,) = [p for p in (local / '6').iterdir() if p.is_dir()]  # v1's one checkpointable
  sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(item) for f in fs]
  assert sum(sizes) < 16 << 10, sorted(sizes)  # Orbax's files and ours: no chunk of 'w' (8 KiB)
  assert (item / '_pathways' / 'index.msgpack').exists()

  with v1.training.Checkpointer(root) as ckptr:
    step, got = preemption.resume(ckptr, lambda: None, abstract_state=_abstract(sharding))
  want = _state(6, sharding)
  assert step == 6
  np.testing.assert_array_equal(np.asarray(got['w']), np.asarray(want['w']))
  np.testing.assert_array_equal(got['n'], want['n'])
  by_source = stats.last_restore().bytes_by_source
  assert by_source.get('storage', 0) == 0 and by_source.get('local', 0) > 0, by_source


def test_a_v1_checkpointer_keeps_local_only_steps_on_the_node_and_resumes_from_it(tmp_path,
                                                                                 caplog):
  """``local_steps_in='nodes'``: v1's declined steps on the local interval are node steps (its
  checkpointable ``state`` in Orbax's format in the node, its ``custom_metadata`` with it),
  nothing of them in storage; ``preemption.resume`` of a v1 Checkpointer restores the newest
  from the node, exact, and v1 goes on saving."""
  root, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), local_save_interval_steps=2,
                                                tier_keep=2, local_steps_in='nodes'))
  sharding = jax.sharding.NamedSharding(mesh(), jax.sharding.PartitionSpec('data', 'model'))
  policy = v1.training.save_decision_policies.FixedIntervalPolicy(10)
  caplog.set_level(logging.WARNING, logger='orbax_pathways')
  with v1.training.Checkpointer(root, save_decision_policy=policy) as ckptr:
    for step in range(8):
      ckptr.save(step, _state(step, sharding), custom_metadata={'step': step})
    ckptr.wait()
    assert [c.step for c in ckptr.checkpoints] == [0]  # v1's listing: storage steps only
  assert not [r.getMessage() for r in caplog.records if 'local-only' in r.getMessage()]
  assert sorted(os.listdir(root)) == ['0']  # no hidden directory: nothing of them in storage
  (node,) = (tier / '.node-steps').iterdir()
  assert sorted(os.listdir(node)) == ['4', '6'] and os.listdir(node / '6') != []
  assert (node / '6' / 'state' / '_METADATA').exists()
  assert '"step": 6' in (node / '6' / '_CHECKPOINT_METADATA').read_text()

  with v1.training.Checkpointer(root, save_decision_policy=policy) as ckptr:
    step, got = preemption.resume(ckptr, lambda: None, abstract_state=_abstract(sharding))
    assert step == 6
    np.testing.assert_array_equal(np.asarray(got['w']), np.asarray(_state(6, sharding)['w']))
    np.testing.assert_array_equal(got['n'], _state(6, sharding)['n'])
    assert stats.last_restore().bytes_by_source == {'node': 64 * 32 * 4}
    for step in (7, 8, 10):
      ckptr.save(step, _state(step, sharding))
    ckptr.wait()
    assert [c.step for c in ckptr.checkpoints] == [0, 10]
  # Storage step 10 is on the local interval: the node keeps it too.
  assert sorted(os.listdir(node), key=int) == ['8', '10']


def test_a_v1_checkpointer_whose_tier_is_gone_resumes_storage_s_step(tmp_path, caplog):
  """The node's tier is lost (a restart on a new node: an empty tier): local-only steps 6 and 4
  cannot be completed, each passed over with one log line naming it, and storage's step 0 is
  resumed, exact."""
  root, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  sharding = _save_run(root, tier, caplog)
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tmp_path / 'new_tier'),
                                                local_steps_in='storage', local_save_interval_steps=2, tier_keep=2))
  caplog.clear()
  with v1.training.Checkpointer(root) as ckptr:
    step, got = preemption.resume(ckptr, lambda: None, abstract_state=_abstract(sharding))
  assert step == 0
  np.testing.assert_array_equal(np.asarray(got['w']), np.asarray(_state(0, sharding)['w']))
  np.testing.assert_array_equal(got['n'], _state(0, sharding)['n'])
  passed = [r.getMessage() for r in caplog.records if 'cannot be restored' in r.getMessage()]
  assert [m.split('local-only step ')[1].split(' ')[0] for m in passed] == ['6', '4'], passed


def test_a_v1_loop_that_donates_its_state_right_after_save_resumes_the_values_saved(tmp_path):
  """v1's local-only saves run in the background from the snapshot ``save()`` took: the loop
  donates its arrays to the next step and overwrites its numpy leaf in place as soon as
  ``save()`` returns, and the resume still reads step 6's values."""
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tmp_path / 'tier'),
                                                local_steps_in='storage', local_save_interval_steps=2, tier_keep=2))
  sharding = jax.sharding.NamedSharding(mesh(), jax.sharding.PartitionSpec('data', 'model'))
  own = jax.jit(lambda t: jax.tree.map(lambda x: x + 0, t))  # buffers jax owns, donatable
  spoil = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 1, t), donate_argnums=0)
  policy = v1.training.save_decision_policies.FixedIntervalPolicy(10)
  with v1.training.Checkpointer(tmp_path / 'ckpt', save_decision_policy=policy) as ckptr:
    for step in range(7):
      state = _state(step, sharding)
      state['w'] = own(state['w'])
      ckptr.save(step, state)
      spoil({'w': state['w']})
      state['n'][...] = -1
    ckptr.wait()
  with v1.training.Checkpointer(tmp_path / 'ckpt') as ckptr:
    step, got = preemption.resume(ckptr, lambda: None, abstract_state=_abstract(sharding))
  assert step == 6
  np.testing.assert_array_equal(np.asarray(got['w']), np.asarray(_state(6, sharding)['w']))
  np.testing.assert_array_equal(got['n'], _state(6, sharding)['n'])
  assert stats.last_restore().bytes_by_source.get('storage', 0) == 0


@pytest.mark.multiprocess
def test_three_processes_save_through_v1_and_resume_from_the_tiers_then_on_two(tmp_path):
  """Three ``jax.distributed`` processes (nodes 0..2, two devices each) save steps 0..25 through
  v1 Checkpointers (storage every 100, local-only every 10; the loop donates and overwrites its
  state right after each ``save()``): only storage's step 0 is v1's, local-only step 20 is
  committed. A restart on the same three nodes resumes step 20 from the tiers alone, exact. A
  later restart on nodes 0 and 1 only (node 2 gone, with its tier) cannot complete step 20 ('w'
  is split over every device: node 2's rows are nowhere else). Process 1, whose devices now
  need them, fails that read; process 0 reads its part and waits in the barrier that ends v1's
  ``load``, which process 1 joins before it raises (without that, process 0 waited there until
  v1's timeout). Every process passes step 20 over, storage's step 0 is resumed, and step 20,
  newer than the step resumed from, is deleted."""
  root, tiers = tmp_path / 'ckpt', [tmp_path / f'node{i}' for i in range(3)]
  env = {'ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS': '10', 'ORBAX_PATHWAYS_LOCAL_STEPS_IN': 'storage',
         'ORBAX_PATHWAYS_TIER_PEER_TIMEOUT_S': '5'}
  res = run_processes(WORKER, 3, 2, args=['save', str(root)], timeout=400, env=env,
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers])
  assert [r.results for r in res] == [[{'steps': [0]}]] * 3
  assert sorted(os.listdir(root / '.orbax-pathways-local')) == ['20']
  res = run_processes(WORKER, 3, 2, args=['resume', str(root)], timeout=400, env=env,
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers])
  for r in res:
    (one,) = r.results
    assert one['step'] == 20 and one['exact'], one
    assert one['bytes_by_source'].get('storage', 0) == 0, one
  res = run_processes(WORKER, 2, 2, args=['resume', str(root)], timeout=400, env=env,
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers[:2]])
  for r in res:
    (one,) = r.results
    assert one['step'] == 0 and one['exact'], one
  assert not [n for n in os.listdir(root / '.orbax-pathways-local') if n.isdigit()]


@pytest.mark.multiprocess
def test_two_processes_save_a_v1_data_iterator_into_their_nodes_and_resume_from_them(tmp_path):
  """Two ``jax.distributed`` processes (two devices each) save the state and a v1 data iterator
  through v1 Checkpointers (storage every 100, local-only every 10, node steps; the iterator
  moves on right after each ``save()``): nothing of the local-only steps is in storage, each
  node's step 20 holds its own process's iterator file at that process's position at the
  save, and a restart resumes step 20 from the nodes alone, its state exact and each process's
  iterator at its own position (``preemption.resume(..., args=...)``)."""
  root, tiers = tmp_path / 'ckpt', [tmp_path / f'node{i}' for i in range(2)]
  env = {'ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS': '10', 'ORBAX_PATHWAYS_LOCAL_STEPS_IN': 'nodes',
         'V1_ITERATOR': '1'}
  per_process = [{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers]
  res = run_processes(WORKER, 2, 2, args=['save', str(root)], timeout=400, env=env,
                      per_process_env=per_process)
  assert [r.results for r in res] == [[{'steps': [0]}]] * 2
  assert sorted(os.listdir(root)) == ['0']
  for i, t in enumerate(tiers):
    (node,) = (t / '.node-steps').iterdir()
    assert sorted(os.listdir(node), key=int) == ['10', '20']
    assert [n for n in os.listdir(node / '20' / 'iter') if n.startswith('process_')] == [
        f'process_{i}-of-2.json']  # its own process's alone
    assert json.loads((node / '20' / 'iter' / f'process_{i}-of-2.json').read_text()) == {
        'pos': 2000 + i}
  res = run_processes(WORKER, 2, 2, args=['resume', str(root)], timeout=400, env=env,
                      per_process_env=per_process)
  for r in res:
    (one,) = r.results
    assert one['step'] == 20 and one['exact'], one
    assert one['bytes_by_source'].get('storage', 0) == 0, one
  assert [r.results[0]['pos'] for r in res] == [2000, 2001]


def test_a_v1_preemption_save_is_local_committed_before_its_storage_save(tmp_path, caplog):
  """On the notice, v1's preemption step goes to memory first (``docs/multi_tier.md`` piece 6):
  its local-only copy commits (one log line says so) before v1's storage save of the same step
  begins; both are then there, and the resume reads it (the storage step, the newest)."""
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tmp_path / 'tier'),
                                                local_steps_in='storage', local_save_interval_steps=10))
  sharding = jax.sharding.NamedSharding(mesh(), jax.sharding.PartitionSpec('data', 'model'))
  policies = v1.training.save_decision_policies
  policy = policies.AnySavePolicy([policies.FixedIntervalPolicy(100),
                                   policies.PreemptionCheckpointingPolicy()])
  root = tmp_path / 'ckpt'
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  try:
    with v1.training.Checkpointer(root, save_decision_policy=policy) as ckptr:
      for step in range(14):
        if step == 13:
          preemption.notify_preemption('test')
        if ckptr.should_save(step):
          ckptr.save(step, _state(step, sharding))
      ckptr.wait()
      assert [c.step for c in ckptr.checkpoints] == [0, 13]
  finally:
    preemption.clear_notice()
  said = [r.getMessage() for r in caplog.records]
  assert any('preemption step 13 is local-committed' in m for m in said), said
  assert sorted(os.listdir(root / '.orbax-pathways-local')) == ['13']
  with v1.training.Checkpointer(root) as ckptr:
    step, got = preemption.resume(ckptr, lambda: None, abstract_state=_abstract(sharding))
  assert step == 13
  np.testing.assert_array_equal(np.asarray(got['w']), np.asarray(_state(13, sharding)['w']))
