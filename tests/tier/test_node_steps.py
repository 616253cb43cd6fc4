"""Local-only steps on the nodes alone (``Options.local_steps_in='nodes'``,
``multitier/node_steps.py``): four real ``jax.distributed`` processes x 2 CPU devices, each a node
with a tier directory of its own; worker: ``tests/support/workers/node_steps_worker.py``."""

from __future__ import annotations

import os
import shutil

import pytest

from support import workers
from support.mp_harness import run_processes

pytestmark = pytest.mark.multiprocess
WORKER = os.path.join(os.path.dirname(workers.__file__), 'node_steps_worker.py')


def _run(tmp_path, mode, last, processes=4, devices=2):
  nodes = [tmp_path / f'node{i}' for i in range(processes)]
  return run_processes(
      WORKER, processes, devices_per_process=devices, shared_dir=str(tmp_path),
      args=[mode, tmp_path / 'ckpt', last], timeout=170,
      env={'ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS': 1, 'ORBAX_PATHWAYS_TIER_KEEP': 2,
           'ORBAX_PATHWAYS_LOCAL_STEPS_IN': 'nodes', 'DUMP_S': 150},
      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': n} for n in nodes])


@pytest.fixture
def saved(tmp_path):
  """Steps 0..9, storage every 4: storage holds 0, 4, 8; every node holds 7 and 9."""
  results = _run(tmp_path, 'save', 9)
  for r in results:
    assert r.result is not None, r.stderr_tail
  return tmp_path, results


def test_local_only_steps_live_on_the_nodes_alone_and_resume_from_them(saved):
  """Storage holds its own steps and nothing of a local-only step (no hidden directory, no
  record), and local-only saves ask nothing of jax's key-value store; each node holds its
  newest two local-only steps in Orbax's format; a restart on the
  same processes resumes step 9 from the nodes, each process its own part, with the values
  saved, and goes on saving."""
  tmp_path, results = saved
  for r in results:
    assert r.result['storage_steps'] == [0, 4, 8], r.result
    # Local-only steps 5-7, saved and committed: not one call of jax's coordination-service
    # client on any process (no barrier, no key).
    assert r.result['kv_calls'] == {}, r.result
    assert r.result['node_steps'] == [7, 9], r.result
    node_dir = r.result['node_dir']
    assert node_dir.startswith(str(tmp_path / f'node{r.process_id}')), node_dir
    assert oct(os.stat(node_dir).st_mode & 0o777) == '0o700'
    assert {'_CHECKPOINT_METADATA', 'default'} <= set(os.listdir(os.path.join(node_dir, '9')))
  assert sorted(os.listdir(tmp_path / 'ckpt')) == ['0', '4', '8']
  resumed = _run(tmp_path, 'resume', 10)
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 9 and r.result['equal'], r.result
    assert r.result['sources'].get('storage', 0) == 0 and r.result['sources']['node'] > 0
    assert r.result['node_steps'] == [9, 10], r.result
  # Two rounds (the steps every node holds, then the step restored): a member publishes its
  # value and reads the verdict in each; the leader reads the others' (a directory read, then
  # per wave of arrivals a blocking read, a directory read and its progress mark: at most one
  # wave per member) and publishes the verdict.
  leader, *members = (r.result['resume_kv_calls'] for r in resumed)
  for calls in members:
    assert calls == {'key_value_set': 2, 'blocking_key_value_get': 2}, calls
  assert sum(leader.values()) <= 2 * (3 + 3 * len(members)) and 'key_value_try_get' not in leader, \
      leader


def test_a_step_one_node_never_finished_is_never_chosen(saved):
  """Node 2 lacks step 9 (its process died while saving it): the restart resumes storage
  step 8, never a step some process cannot restore, and every node drops 9 (a rolled-back run's
  step)."""
  tmp_path, results = saved
  shutil.rmtree(os.path.join(results[2].result['node_dir'], '9'))
  resumed = _run(tmp_path, 'resume', 8)
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 8 and r.result['equal'], r.result
    assert 9 not in r.result['node_steps'], r.result


def test_a_restart_on_fewer_processes_passes_node_steps_over(saved):
  """Two processes now (a mesh half as wide): a node's step holds the shards its process held
  before, not what it holds now; the restart resumes storage step 8 with the right values."""
  tmp_path, _ = saved
  resumed = _run(tmp_path, 'resume', 8, processes=2, devices=4)
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 8 and r.result['equal'], r.result


def test_a_flipped_byte_in_one_nodes_step_is_caught_and_passed_over(saved):
  """A bit of node 1's step 9 flipped (its OCDBT data files): that process's restore fails its
  checksum, no process uses step 9, and the restart resumes storage step 8 with the right
  values."""
  tmp_path, results = saved
  data = [p for p in (tmp_path / 'node1').rglob('*') if p.is_file() and '/9/default/' in str(p)
          and '/d/' in str(p)]
  assert data, 'no OCDBT data file in node 1\'s step 9'
  biggest = max(data, key=lambda p: p.stat().st_size)
  raw = bytearray(biggest.read_bytes())
  raw[len(raw) // 2] ^= 0x10
  biggest.write_bytes(bytes(raw))
  resumed = _run(tmp_path, 'resume', 8)
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 8 and r.result['equal'], r.result
  assert 'node step 9 cannot be restored' in resumed[1].stderr_tail
