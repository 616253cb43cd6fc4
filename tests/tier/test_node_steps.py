"""Local-only steps on the nodes alone (``Options.local_steps_in='nodes'``,
``multitier/node_steps.py``): four real ``jax.distributed`` processes x 2 CPU devices, each a node
with a tier directory of its own; worker: ``tests/support/workers/node_steps_worker.py``."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest

from support import damage
from support import workers
from support.mp_harness import run_processes

pytestmark = pytest.mark.multiprocess
WORKER = os.path.join(os.path.dirname(workers.__file__), 'node_steps_worker.py')


def _run(tmp_path, mode, last, processes=4, devices=2, nodes=None, layout='', keep=2):
  """``nodes``: the node (tier directory) number of each process, in process order (default:
  process i on node i); ``layout``: the worker's ``LAYOUT``; ``keep``: ``tier_keep`` (None:
  the default)."""
  nodes = [tmp_path / f'node{i}' for i in (nodes or range(processes))]
  env = {'ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS': 1, 'ORBAX_PATHWAYS_LOCAL_STEPS_IN': 'nodes',
         'ORBAX_PATHWAYS_LOCAL_COPIES': 2, 'DUMP_S': 150, 'LAYOUT': layout}
  if keep is not None:
    env['ORBAX_PATHWAYS_TIER_KEEP'] = keep
  return run_processes(
      WORKER, processes, devices_per_process=devices, shared_dir=str(tmp_path),
      args=[mode, tmp_path / 'ckpt', last], timeout=170, env=env,
      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': n} for n in nodes])


def _own(tmp_path, process, step):
  """Where process ``process``'s node keeps its own node step ``step``."""
  digests = [n for n in os.listdir(tmp_path / f'node{process}' / '.node-steps')
             if not n.endswith('.copies')]
  assert len(digests) == 1, digests
  return tmp_path / f'node{process}' / '.node-steps' / digests[0] / str(step)


def _copy(tmp_path, process, step):
  """Where process ``process``'s partner (the next process: one slice each) keeps its copy of
  node step ``step``."""
  digests = [n for n in os.listdir(tmp_path / f'node{process}' / '.node-steps')
             if not n.endswith('.copies')]
  assert len(digests) == 1, digests
  return (tmp_path / f'node{(process + 1) % 4}' / '.node-steps' / f'{digests[0]}.copies'
          / f'p{process}' / str(step))


def _resumes_9_on_eight(tmp_path):
  """The job restarted on eight processes of one device each; asserts that every process
  resumed node step 9 with the values saved and no byte from storage; returns the results."""
  resumed = _run(tmp_path, 'resume', 10, processes=8, devices=1)
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 9 and r.result['equal'], r.stderr_tail[-6000:]
    assert r.result['sources'].get('storage', 0) == 0, r.result
  return resumed


@pytest.fixture(scope='module')
def _saved_once(tmp_path_factory):
  """Steps 0..9, storage every 4: storage holds 0, 4, 8; every node holds 8 (a storage step on
  the local interval is saved there too) and 9, and a copy of its partner's
  (``local_copies=2``). Saved once per module; kept aside whole."""
  base = tmp_path_factory.mktemp('node_steps')
  results = _run(base, 'save', 9)
  for r in results:
    assert r.result is not None, r.stderr_tail
  shutil.copytree(base, f'{base}.saved', symlinks=True)
  return base, results


@pytest.fixture
def saved(_saved_once):
  """``_saved_once``'s directory as the save left it (nodes and storage restored at the same
  path: node steps are named after the checkpoint directory's path), and its results."""
  base, results = _saved_once
  shutil.rmtree(base)
  shutil.copytree(f'{base}.saved', base, symlinks=True)
  return base, results


def test_local_only_steps_live_on_the_nodes_alone_and_resume_from_them(saved):
  """Storage holds its own steps and nothing of a local-only step (no hidden directory, no
  record), and local-only saves ask nothing of jax's key-value store; each node holds its
  newest two steps on the local interval in Orbax's format; a restart on the
  same processes resumes step 9 from the nodes, each process its own part, with the values
  saved, and goes on saving."""
  tmp_path, results = saved
  for r in results:
    assert r.result['storage_steps'] == [0, 4, 8], r.result
    # Local-only steps 5-7, saved and committed: not one call of jax's coordination-service
    # client on any process (no barrier, no key).
    assert r.result['kv_calls'] == {}, r.result
    assert r.result['node_steps'] == [8, 9], r.result
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
  # Two rounds (the steps every node can restore, then the step restored): a member publishes
  # its value and reads the verdict in each; the leader reads the others' (a directory read,
  # then per wave of arrivals a blocking read, a directory read and its progress mark: at most
  # one wave per member) and publishes the verdict. A node keeping a partner's copy also
  # starts its server: the server's address published, and the job's secret read (one
  # request; or a write by the first process there; or a write refused and a blocking read).
  leader, *members = (r.result['resume_kv_calls'] for r in resumed)
  for calls in members:
    assert set(calls) == {'key_value_set', 'key_value_try_get', 'blocking_key_value_get'}, calls
    assert calls['key_value_try_get'] == 1 and 3 <= calls['key_value_set'] <= 4, calls
    assert 2 <= calls['blocking_key_value_get'] <= 3 and sum(calls.values()) <= 8, calls
  assert sum(leader.values()) <= 2 * (3 + 3 * len(members)) + 3, leader
  assert leader.get('key_value_try_get', 0) <= 1, leader  # the secret's; no polling


def test_a_storage_step_whose_commit_was_lost_resumes_from_its_node_step(saved):
  """Storage step 8 never committed (the job was killed in its commit: storage lists 0 and 4)
  and node 2 lacks node step 9 (nor did its copy land): the restart resumes step 8 from the
  nodes, which saved it too as it is on the local interval, with no byte from storage."""
  tmp_path, results = saved
  shutil.rmtree(tmp_path / 'ckpt' / '8')
  shutil.rmtree(os.path.join(results[2].result['node_dir'], '9'))
  shutil.rmtree(_copy(tmp_path, 2, 9))
  resumed = _run(tmp_path, 'resume', 9)
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 8 and r.result['equal'], r.result
    assert r.result['sources'].get('storage', 0) == 0 and r.result['sources']['node'] > 0


def test_a_damaged_storage_step_is_resumed_from_its_node_step(saved):
  """Storage step 8's metadata is damaged and node 2 lacks node step 9 (nor did its copy
  land): storage's step 8 fails to restore, and the restart resumes step 8 from the nodes (a
  storage step on the local interval is a node step too) instead of storage's step 4, with no
  byte from storage and the damaged step named."""
  tmp_path, results = saved
  (tmp_path / 'ckpt' / '8' / 'default' / '_METADATA').write_bytes(b'{damaged')
  shutil.rmtree(os.path.join(results[2].result['node_dir'], '9'))
  shutil.rmtree(_copy(tmp_path, 2, 9))
  resumed = _run(tmp_path, 'resume', 9)
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 8 and r.result['equal'], r.stderr_tail[-6000:]
    assert r.result['sources'].get('storage', 0) == 0 and r.result['sources']['node'] > 0
  assert ("is DAMAGED and was skipped" in resumed[0].stderr_tail
          and "Resuming step 8 from the nodes' copy of it" in resumed[0].stderr_tail), (
              resumed[0].stderr_tail[-6000:])


def test_a_step_one_node_never_finished_is_never_chosen(saved):
  """Node 2 lacks step 9 (its process died while saving it): the restart resumes storage
  step 8, never a step some process cannot restore, and every node drops 9 (a rolled-back run's
  step)."""
  tmp_path, results = saved
  shutil.rmtree(os.path.join(results[2].result['node_dir'], '9'))
  shutil.rmtree(_copy(tmp_path, 2, 9))  # nor did its copy land
  resumed = _run(tmp_path, 'resume', 8)
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 8 and r.result['equal'], r.result
    assert 9 not in r.result['node_steps'], r.result


def test_a_kill_before_one_process_committed_the_newest_step_costs_that_step_only(tmp_path):
  """The default retention (one local-only step): each node still holds the step before its
  newest, and so does each partner's copy. Process 2 had not committed step 11 when the job
  was killed (its node lacks it, and so does its partner's copy), while every other node had
  committed 11: the restart resumes node step 10 from the nodes, not storage's step 8."""
  results = _run(tmp_path, 'save', 11, keep=None)
  for r in results:
    assert r.result is not None, r.stderr_tail
    assert r.result['storage_steps'] == [0, 4, 8], r.result
    assert r.result['node_steps'] == [10, 11], r.result
  assert sorted(os.listdir(_copy(tmp_path, 1, 11).parent)) == ['10', '11']
  shutil.rmtree(os.path.join(results[2].result['node_dir'], '11'))
  shutil.rmtree(_copy(tmp_path, 2, 11))
  resumed = _run(tmp_path, 'resume', 11, keep=None)
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 10 and r.result['equal'], r.result
    assert r.result['sources'].get('storage', 0) == 0, r.result


def test_a_lost_node_is_resumed_from_its_partners_copy(saved):
  """Node 2 is gone (its whole tier directory; a new node takes its place): the restart on four
  processes still resumes node step 9, process 2 fetching its part from the copy its partner
  (process 3, another slice) keeps, with the values saved and no byte from storage."""
  tmp_path, results = saved
  copy = _copy(tmp_path, 2, 9)
  assert copy.is_dir() and oct(copy.stat().st_mode & 0o777) == '0o700', copy
  files = [p for p in copy.rglob('*') if p.is_file()]
  assert files and {oct(p.stat().st_mode & 0o777) for p in files} == {'0o600'}
  shutil.rmtree(tmp_path / 'node2')
  resumed = _run(tmp_path, 'resume', 10)
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 9 and r.result['equal'], r.result
    assert r.result['sources'].get('storage', 0) == 0, r.result
  # Node 2 holds step 9 again: the copy's files, byte for byte.
  assert resumed[2].result['node_steps'] == [9, 10], resumed[2].result
  fetched = pathlib.Path(resumed[2].result['node_dir']) / '9'
  assert ({p.relative_to(fetched): p.read_bytes() for p in fetched.rglob('*') if p.is_file()}
          == {p.relative_to(copy): p.read_bytes() for p in files})


def test_a_restart_on_fewer_processes_resumes_the_sharded_state_from_the_nodes(saved):
  """Nodes 1 and 3 are lost and the job restarts on two processes of 4 devices each, on nodes
  0 and 2 (a state sharded over every device): process 0's devices now hold what processes 0
  and 1 saved, process 1's what processes 2 and 3 saved. Node 0 holds its own part and the copy
  of process 3's, node 2 its own and the copy of process 1's. The restart resumes node step 9
  with the values saved and no byte from storage (each process fetches the part it lacks from
  the other's node), and goes on saving; nothing of the parts it joined is left on a node
  beside its node steps and copies."""
  tmp_path, _ = saved
  shutil.rmtree(tmp_path / 'node1')
  shutil.rmtree(tmp_path / 'node3')
  resumed = _run(tmp_path, 'resume', 10, processes=2, devices=4, nodes=[0, 2])
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 9 and r.result['equal'], r.stderr_tail[-6000:]
    assert r.result['sources'].get('storage', 0) == 0 and r.result['sources']['node'] > 0
    assert 10 in r.result['node_steps'], r.result
  for node in ('node0', 'node2'):
    names = os.listdir(tmp_path / node / '.node-steps')
    assert len(names) == 2 and sum(n.endswith('.copies') for n in names) == 1, names


def test_a_restart_on_more_processes_resumes_from_the_nodes_new_nodes_included(saved):
  """Eight processes of one device each (a repair: four new nodes, empty): process i's device
  now holds rows 8i..8i+8, which process i // 2 saved. The restart resumes node step 9 with the
  values saved and no byte from storage: the processes on new nodes fetch the step's metadata
  and then the part they need from the nodes holding them."""
  tmp_path, _ = saved
  for r in _resumes_9_on_eight(tmp_path):
    assert r.result['sources']['node'] > 0, r.result


def test_a_flipped_byte_in_a_part_restored_onto_another_layout_is_taken_from_its_copy(saved):
  """A bit of each data file of node 0's own step 9 flipped, and the job restarts on eight
  processes of one device each (as above): process 0's device needs half of the part node 0
  saved, which fails its checksum; it fetches that part from the copy process 1's node keeps
  and joins the step again. Every process resumes node step 9 with the values saved, no byte
  from storage."""
  tmp_path, _ = saved
  data = damage.node_data_files(_own(tmp_path, 0, 9))
  assert data, 'no data file in node 0\'s step 9'
  damage.flip_middle_bit(data)  # a bit of each
  resumed = _resumes_9_on_eight(tmp_path)
  assert "fetching process 0's part from process 1" in resumed[0].stderr_tail, (
      resumed[0].stderr_tail[-6000:])


def test_a_flipped_byte_in_a_partners_copy_restored_onto_another_layout_is_taken_from_the_saver(
    saved):
  """A bit of each data file of the copy node 2 keeps of process 1's step 9 flipped (process
  1's own step 9 whole), and the job restarts on eight processes of one device each: process 2
  joins the copy its node holds, which fails its checksum, fetches process 1's part from node
  1, and joins again. Every process resumes node step 9 with the values saved, no byte from
  storage."""
  tmp_path, _ = saved
  data = damage.node_data_files(_copy(tmp_path, 1, 9))
  assert data, 'no data file in the copy of process 1\'s step 9'
  damage.flip_middle_bit(data)
  resumed = _resumes_9_on_eight(tmp_path)
  assert "fetching process 1's part from process 1" in resumed[2].stderr_tail, (
      resumed[2].stderr_tail[-6000:])


def test_a_part_whose_layout_file_was_never_written_is_still_gathered_onto_another_layout(
    saved):
  """Node 1's step 9 lacks ``_node_processes.msgpack`` (its process was killed between the
  step's commit and that write, before its partner copy landed: node 2 holds no copy of it;
  nor does node 1 hold process 0's copy, so nothing on node 1 says the layout), and the job
  restarts on eight processes of one device each: the other parts say the step's layout, node
  1 still offers its part, and every process resumes node step 9 with the values saved, no
  byte from storage."""
  tmp_path, _ = saved
  (_own(tmp_path, 1, 9) / '_node_processes.msgpack').unlink()
  shutil.rmtree(_copy(tmp_path, 1, 9))
  shutil.rmtree(_copy(tmp_path, 0, 9))
  _resumes_9_on_eight(tmp_path)


def test_state_whole_in_every_slice_resumes_from_the_survivors_nodes_on_fewer_processes(
    tmp_path):
  """Three processes, a slice each, the state whole in every slice; node 0 is lost and the job
  restarts on two processes, on nodes 1 and 2: each process now runs on a node another process
  saved, which holds the part its devices need. The restart resumes node step 9 with the values
  saved, no byte from storage, and goes on saving."""
  saved = _run(tmp_path, 'save', 9, processes=3, layout='slices')
  for r in saved:
    assert r.result is not None, r.stderr_tail
    assert r.result['storage_steps'] == [0, 4, 8] and r.result['node_steps'] == [8, 9], r.result
  shutil.rmtree(tmp_path / 'node0')
  resumed = _run(tmp_path, 'resume', 10, processes=2, nodes=[1, 2], layout='slices')
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 9 and r.result['equal'], r.result
    assert r.result['sources'].get('storage', 0) == 0 and r.result['sources']['node'] > 0
    assert r.result['node_steps'] == [9, 10], r.result


def test_a_flipped_byte_in_one_nodes_step_is_caught_and_restored_from_the_partners_copy(saved):
  """A bit of node 1's step 9 flipped (its biggest data file, not the copies it keeps): that
  process's restore fails its checksum, it fetches its part of step 9 from the copy its
  partner (process 2) keeps, and every process resumes step 9 with the values saved, no byte
  from storage."""
  tmp_path, results = saved
  data = damage.node_data_files(_own(tmp_path, 1, 9))
  assert data, 'no data file in node 1\'s step 9'
  damage.flip_middle_bit([max(data, key=lambda p: p.stat().st_size)])
  resumed = _run(tmp_path, 'resume', 10)
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 9 and r.result['equal'], r.result
    assert r.result['sources'].get('storage', 0) == 0, r.result
  assert 'restored from the copy process 2 keeps' in resumed[1].stderr_tail


def test_a_flipped_byte_in_a_partners_copy_is_caught_and_passed_over(saved):
  """Node 2 is gone and a bit of the copy its partner keeps of step 9 flipped: process 2's
  restore of the fetched step fails its checksum, no process uses step 9, and the restart
  resumes storage step 8 with the right values."""
  tmp_path, _ = saved
  data = damage.node_data_files(_copy(tmp_path, 2, 9))
  assert data, 'no data file in the copy of process 2\'s step 9'
  damage.flip_middle_bit(data)  # a bit of each
  shutil.rmtree(tmp_path / 'node2')
  resumed = _run(tmp_path, 'resume', 8)
  for r in resumed:
    assert r.result is not None, r.stderr_tail
    assert r.result['resumed'] == 8 and r.result['equal'], r.result
  assert 'node step 9 cannot be restored' in resumed[2].stderr_tail
