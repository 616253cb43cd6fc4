"""Local-only steps (``docs/multi_tier.md``): with
``ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS``, an unchanged ``CheckpointManager`` whose policy saves
every 100 steps also saves every 10th step with Orbax's files and our records in storage and the
array bytes in the writer hosts' node-local tiers only; ``preemption.resume`` restores the newest
step the live processes can complete, onto whatever processes there are now.

Real ``jax.distributed`` processes, one tier directory per simulated node. Three processes (nodes
0, 1, 2; two devices each) save steps 0..25 once; each test copies the tiers as its case says
and resumes. Every case checks bit-exact values of the step resumed and the bytes by source.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from support import procs
from support.mp_harness import run_processes
from support.workers import local_preempt_worker
from support.workers import local_steps_worker
from support.workers import stock_read_worker
from orbax_pathways.tier import store as tier_store

pytestmark = pytest.mark.multiprocess

WORKER = local_steps_worker.__file__
LOCAL = {'ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS': '10', 'ORBAX_PATHWAYS_LOCAL_STEPS_IN': 'storage'}


def _save(base, layout, env=None):
  root, tiers = base / 'ckpt', [base / f'node{i}' for i in range(3)]
  res = run_processes(WORKER, 3, 2, args=['save', str(root), layout], timeout=400,
                      env={**LOCAL, **(env or {})},
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers])
  assert [r.results for r in res] == [[{'steps': [0]}]] * 3  # Orbax's listing: storage steps
  return root, tiers


@pytest.fixture(scope='module')
def sharded(tmp_path_factory):
  return _save(tmp_path_factory.mktemp('local_sharded'), 'sharded')


def _resume(root, tiers, layout, tmp_path):
  """Resumes from copies of ``tiers``; returns (step, bytes by source, log tail) per process
  and the local-only steps left in storage after it. A resume deletes local-only steps newer
  than the one it chose, so ``root`` is put back as it was afterwards (the tiers name it by
  its path: it cannot be resumed from a copy elsewhere)."""
  copies = []
  for i, t in enumerate(tiers):
    dst = tmp_path / f'copy{i}'
    shutil.copytree(t, dst)
    copies.append(dst)
  backup = tmp_path / 'ckpt_before'
  shutil.copytree(root, backup)
  try:
    res = run_processes(WORKER, len(copies), 2, args=['resume', str(root), layout], timeout=400,
                        env={**LOCAL, 'ORBAX_PATHWAYS_TIER_PEER_TIMEOUT_S': '5'},
                        per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in copies])
    left = sorted(os.listdir(root / '.orbax-pathways-local'))
  finally:
    shutil.rmtree(root)
    shutil.copytree(backup, root)
  out = []
  for r in res:
    (one,) = r.results
    assert one['exact'] and one['storage_steps'] == [0], one
    out.append((one['step'], one['bytes_by_source'], r.stderr_tail))
  return out, left


def test_the_local_only_step_holds_no_array_bytes_in_storage(sharded):
  root, _ = sharded
  local = root / '.orbax-pathways-local'
  assert sorted(os.listdir(local)) == ['20']  # step 10 dropped once 20 committed (tier_keep 1)
  item = local / '20' / 'default'
  sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(item) for f in fs]
  # Orbax's files, our records, the numpy leaf and one empty chunk marker per array: no chunk
  # of 'w' (24 KiB) or 'r'.
  assert sum(sizes) < 16 << 10, sorted(sizes)
  assert (item / '_pathways' / 'index.msgpack').exists()


def test_a_restart_on_the_same_nodes_resumes_from_the_local_only_step(sharded, tmp_path):
  root, tiers = sharded
  out, left = _resume(root, tiers, 'sharded', tmp_path)
  for step, by_source, _ in out:
    assert step == 20 and by_source.get('storage', 0) == 0, (step, by_source)
    assert by_source.get('local', 0) > 0
  assert left == ['20']


def test_a_loop_that_donates_its_state_right_after_save_resumes_the_values_saved(tmp_path):
  """The local-only save runs in the background from the snapshot ``save()`` took: the loop
  donating the arrays and overwriting the numpy leaf right after ``save()`` changes nothing in
  the step (the resume checks every shard and the numpy leaf against step 20's values)."""
  root, tiers = _save(tmp_path, 'sharded', env={'DONATE': '1'})
  out, left = _resume(root, tiers, 'sharded', tmp_path)
  for step, by_source, _ in out:
    assert step == 20 and by_source.get('storage', 0) == 0, (step, by_source)
  assert left == ['20']


def test_a_lost_node_of_sharded_state_passes_the_local_step_over_for_storage(sharded, tmp_path):
  """Node 2 is gone: its rows of 'w' of step 20 are in no survivor's tier. The restart on two
  processes passes step 20 over (one log line naming it and the missing chunk) and resumes
  from storage's step 0; nothing of step 20 is returned."""
  root, tiers = sharded
  out, left = _resume(root, tiers[:2], 'sharded', tmp_path)
  assert [step for step, _, _ in out] == [0, 0]
  logs = ''.join(tail for _, _, tail in out)
  assert 'local-only step 20 cannot be restored' in logs, logs[-3000:]
  # The process that lacks node 2's rows names the chunk; the other, the agreement.
  assert "LocalStepIncompleteError: chunk [64, 0] of array 'w'" in logs, logs[-3000:]
  assert 'another process of this job could not complete it' in logs, logs[-3000:]
  # Training goes on from step 0: the step of the run it rolls back is gone, so step 20 can be
  # saved again and is never resumed from.
  assert left == []


def test_replicated_state_survives_a_lost_node_from_the_local_only_step(tmp_path):
  """'w' split over one slice's devices only (every slice holds all of it): each host keeps what
  its devices hold, so after node 2 is lost the two survivors resume step 20 from their tiers,
  reading nothing from storage."""
  root, tiers = _save(tmp_path / 'save', 'replicated')
  out, _ = _resume(root, tiers[:2], 'replicated', tmp_path)
  for step, by_source, _ in out:
    assert step == 20 and by_source.get('storage', 0) == 0, (step, by_source)


def test_a_flipped_byte_in_a_local_only_chunk_passes_the_step_over(sharded, tmp_path):
  """A tier copy of node 1's rows of 'w' damaged after the save (its crc32c no longer the
  committed record's) has no other copy, in a tier or in storage: the step is passed over,
  never returned with the bad byte."""
  root, tiers = sharded
  damaged = tmp_path / 'damaged'
  shutil.copytree(tiers[1], damaged)
  (entry,) = [e for e in tier_store.entries(str(damaged)) if e.step == 20]
  (w,) = [a for a in entry.manifest.arrays if a.name == 'w']  # one copy in the job: no replica
  with open(os.path.join(entry.path, w.files[0]), 'r+b') as f:
    b = f.read(1)
    f.seek(0)
    f.write(bytes([b[0] ^ 0x40]))
  out, _ = _resume(root, [tiers[0], damaged, tiers[2]], 'sharded', tmp_path / 'run')
  assert [step for step, _, _ in out] == [0, 0, 0]


@pytest.fixture(scope='module')
def copied(tmp_path_factory):
  """The sharded save with ``ORBAX_PATHWAYS_LOCAL_COPIES=2``: each process (its own slice) also
  sends its share of a local-only step to the next one (p0 -> p1 -> p2 -> p0)."""
  return _save(tmp_path_factory.mktemp('local_copied'), 'sharded',
               {'ORBAX_PATHWAYS_LOCAL_COPIES': '2'})


def _writers(tier, step):
  return sorted((e.writer, e.committed) for e in tier_store.entries(str(tier)) if e.step == step)


def test_each_node_keeps_its_partners_share_of_a_local_only_step(copied):
  root, tiers = copied
  assert sorted(os.listdir(root / '.orbax-pathways-local')) == ['20']
  # Node i holds its own entry and node i-1's copy, both committed with the step; the copies of
  # step 10 went with it (tier_keep 1).
  assert [_writers(t, 20) for t in tiers] == [
      [('p0', True), ('p2', True)], [('p0', True), ('p1', True)], [('p1', True), ('p2', True)]]
  assert [_writers(t, 10) for t in tiers] == [[], [], []]
  for i, t in enumerate(tiers):  # the copy is the sender's entry, file for file
    (mine,) = [e for e in tier_store.entries(str(tiers[i])) if e.step == 20 and e.writer == f'p{i}']
    nxt = tiers[(i + 1) % 3]
    (copy,) = [e for e in tier_store.entries(str(nxt)) if e.step == 20 and e.writer == f'p{i}']
    assert copy.manifest == mine.manifest
    for a in mine.manifest.arrays:
      for f in a.files:
        with open(os.path.join(mine.path, f), 'rb') as x, open(os.path.join(copy.path, f), 'rb') as y:
          assert x.read() == y.read()
        assert os.stat(os.path.join(copy.path, f)).st_mode & 0o777 == 0o600


def test_with_partner_copies_a_lost_node_of_sharded_state_resumes_the_local_only_step(
    copied, tmp_path):
  """Node 2 is gone; its share of step 20 survives on node 0 (its partner): the two survivors
  resume step 20 from their tiers, reading nothing from storage (without the copy they resume
  step 0: ``test_a_lost_node_of_sharded_state_passes_the_local_step_over_for_storage``)."""
  root, tiers = copied
  out, left = _resume(root, tiers[:2], 'sharded', tmp_path)
  for step, by_source, _ in out:
    assert step == 20 and by_source.get('storage', 0) == 0, (step, by_source)
  assert left == ['20']


def test_with_partner_copies_a_flipped_byte_is_read_from_the_partners_copy(copied, tmp_path):
  """Node 1's copy of its rows of 'w' is damaged; node 2 holds the other copy: step 20 is
  resumed all the same, the damaged chunk taken from node 2, nothing from storage."""
  root, tiers = copied
  damaged = tmp_path / 'damaged'
  shutil.copytree(tiers[1], damaged)
  (entry,) = [e for e in tier_store.entries(str(damaged)) if e.step == 20 and e.writer == 'p1']
  (w,) = [a for a in entry.manifest.arrays if a.name == 'w']
  with open(os.path.join(entry.path, w.files[0]), 'r+b') as f:
    b = f.read(1)
    f.seek(0)
    f.write(bytes([b[0] ^ 0x40]))
  out, _ = _resume(root, [tiers[0], damaged, tiers[2]], 'sharded', tmp_path / 'run')
  for step, by_source, _ in out:
    assert step == 20 and by_source.get('storage', 0) == 0, (step, by_source)
  assert out[1][1].get('peer', 0) > 0, out[1]


def test_a_partner_that_is_gone_costs_the_copy_not_the_step(tmp_path):
  """Node 1's server is gone before it publishes its address: node 0's copies to it fail (one
  warning naming the partner, within the deadline), the step still commits everywhere with
  node 0's share in one copy, and the other copies land."""
  base = tmp_path / 'save'
  root, tiers = base / 'ckpt', [base / f'node{i}' for i in range(3)]
  res = run_processes(WORKER, 3, 2, args=['save', str(root), 'sharded'], timeout=400,
                      env={**LOCAL, 'ORBAX_PATHWAYS_LOCAL_COPIES': '2',
                           'ORBAX_PATHWAYS_TIER_PEER_TIMEOUT_S': '5'},
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t),
                                        **({'PARTNER_GONE': '1'} if i == 1 else {})}
                                       for i, t in enumerate(tiers)])
  assert [r.results for r in res] == [[{'steps': [0]}]] * 3
  assert sorted(os.listdir(root / '.orbax-pathways-local')) == ['20']
  assert 'the partner copy of' in res[0].stderr_tail and 'partner process 1' in res[0].stderr_tail
  assert [_writers(t, 20) for t in tiers] == [
      [('p0', True), ('p2', True)], [('p1', True)], [('p1', True), ('p2', True)]]


def test_every_process_killed_during_a_local_only_commit_never_uses_that_step(tmp_path):
  """Every process SIGKILLs itself once its share of local-only step 20 is in its tier: the
  step's commit never finishes, so the restart never restores it (its entries are there, its
  records are not committed) and resumes from local-only step 10, from the tiers."""
  base = tmp_path / 'save'
  root, tiers = base / 'ckpt', [base / f'node{i}' for i in range(3)]
  res = run_processes(WORKER, 3, 2, args=['save', str(root), 'sharded'], timeout=400,
                      env={**LOCAL, 'KILL_AT': '20'}, check=False,
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers])
  assert [r.returncode for r in res] == [-9] * 3, [(r.returncode, r.stderr_tail[-2000:]) for r in res]
  assert all(any(e.step == 20 for e in tier_store.entries(str(t))) for t in tiers)
  assert '20' not in os.listdir(root / '.orbax-pathways-local')  # never committed
  out, _ = _resume(root, tiers, 'sharded', tmp_path / 'run')
  for step, by_source, _ in out:
    assert step == 10 and by_source.get('storage', 0) == 0, (step, by_source)


def test_one_node_whose_tier_cannot_take_the_step_costs_the_local_saves_not_a_hang(tmp_path):
  """Node 1's tier directory cannot be made (a file is in its way): its every local-only save
  fails on its own host while the other processes wait in Orbax's barriers. Each save still
  ends on every process within the peer deadline, not at Orbax's 20-minute barrier timeout
  (the run's limit is 300 s), every process logs the failure naming process 1, no local-only
  step is committed, training goes on, and the restart resumes storage's step 0."""
  base = tmp_path / 'save'
  root, tiers = base / 'ckpt', [base / f'node{i}' for i in range(3)]
  (base / 'a_file').parent.mkdir(parents=True)
  (base / 'a_file').write_text('not a directory')
  tiers[1] = base / 'a_file' / 'tier'
  res = run_processes(WORKER, 3, 2, args=['save', str(root), 'sharded'], timeout=300,
                      env=LOCAL, per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)}
                                                  for t in tiers])
  assert [r.results for r in res] == [[{'steps': [0]}]] * 3
  for i, r in enumerate(res):
    named = 'process 1 failed its writes' if i != 1 else 'host p1 could not write its share'
    assert 'Step 20 (' in r.stderr_tail and 'was not committed' in r.stderr_tail, (
        i, r.stderr_tail[-3000:])
    assert named in r.stderr_tail, (
        i, r.stderr_tail[-3000:])
  assert not [n for n in os.listdir(root / '.orbax-pathways-local') if n.isdigit()]
  tiers[1] = base / 'node1'  # the restart's node 1 has an empty tier
  tiers[1].mkdir(mode=0o700)
  out, _ = _resume(root, tiers, 'sharded', tmp_path / 'run')
  assert [step for step, _, _ in out] == [0, 0, 0], out  # values checked exact by the worker


def test_stock_orbax_fails_loudly_on_a_local_only_step_instead_of_reading_zeros(sharded):
  root, _ = sharded
  item = root / '.orbax-pathways-local' / '20' / 'default'
  got = procs.worker_json(stock_read_worker, item, env={'ORBAX_PATHWAYS_DISABLE': '1'},
                          devices=1, timeout=300)
  assert 'error' in got, got  # never {'nonzero': ...}: a silent read of zeros or a marker


def test_the_tier_command_lists_and_checks_a_local_only_steps_entries(sharded):
  root, tiers = sharded
  out = procs.run_cli('tier', tiers[1], '--json', timeout=120)
  doc = json.loads(out.stdout)
  local = [e for e in doc['entries'] if '.orbax-pathways-local' in e['root']]
  assert out.returncode == 0 and local, out.stdout[-3000:]
  assert all(e['status'] == 'ok' for e in local), local


def test_verify_of_a_local_only_step_checks_storage_s_part_and_names_the_tiers(sharded, tmp_path):
  """``orbax-pathways verify`` of a local-only step: its records, Orbax's metadata and the numpy
  leaf are checked; the jax.Array chunks, which storage does not hold, are ``unchecked`` (exit
  3) with the command that checks them, never read errors. A writer record lost from it is
  still a failure."""
  root, _ = sharded
  step = root / '.orbax-pathways-local' / '20'
  out = procs.run_cli('verify', step, '--json', timeout=120)
  doc = json.loads(out.stdout)
  assert out.returncode == 3 and doc['verdict'] == 'unchecked', out.stdout[-3000:]
  assert doc['problems'] == [], doc['problems']
  assert sorted(u['key'] for u in doc['unchecked']) == ['r', 'w'], doc['unchecked']
  assert all('orbax-pathways tier' in u['reason'] for u in doc['unchecked']), doc['unchecked']
  assert doc['chunks_checksummed'] >= 1  # the numpy leaf 'n', from storage
  text = procs.run_cli('verify', step, timeout=120).stdout
  assert 'UNCHECKED: no damage found, but 2 arrays in node-local tiers only' in text, text

  copy = tmp_path / 'ckpt' / '.orbax-pathways-local' / '20'
  shutil.copytree(step, copy)
  records = sorted((copy / 'default' / '_pathways').glob('p*.msgpack'))
  assert len(records) == 3, records
  records[1].unlink()
  (copy / 'default' / '_pathways' / 'index.msgpack').unlink()
  out = procs.run_cli('verify', copy, '--json', timeout=120)
  doc = json.loads(out.stdout)
  assert out.returncode == 1 and doc['verdict'] == 'failed', out.stdout[-3000:]
  assert any(p['kind'] == 'missing_record' and p['array'] == 'w' for p in doc['problems']), doc


def test_ls_names_the_local_only_steps_beside_the_storage_steps(sharded):
  root, _ = sharded
  out = procs.run_cli('ls', root, '--json', timeout=120)
  doc = json.loads(out.stdout)
  assert out.returncode == 0 and [s['step'] for s in doc['steps']] == [0], out.stdout[-3000:]
  assert doc['local_only_steps'] == [20], doc
  text = procs.run_cli('ls', root, timeout=120).stdout
  assert ('local-only steps (array bytes in node-local tiers): 20; `orbax-pathways ls '
          f'{root}/.orbax-pathways-local` lists them') in text, text
  out = procs.run_cli('show', root, '--step', '20', timeout=120)
  assert out.returncode == 2 and (
      f'Step 20 is a local-only step (array bytes in node-local tiers): '
      f'{root}/.orbax-pathways-local/20.') in out.stderr, out.stderr


def test_diff_against_a_local_only_step_compares_its_arrays_by_their_checksums(sharded):
  """``orbax-pathways diff`` of storage's step 0 and local-only step 20, with and without
  ``--values``: the jax.Arrays of step 20 (no bytes on storage) are compared by their recorded
  crc32c, never reported unreadable; the numpy leaf is read with ``--values``."""
  root, _ = sharded
  a, b = root / '0', root / '.orbax-pathways-local' / '20'
  for flags in ((), ('--values',)):
    out = procs.run_cli('diff', a, b, '--json', *flags, timeout=120)
    doc = json.loads(out.stdout)
    assert out.returncode == 1, out.stdout[-3000:]  # values differ between steps 0 and 20
    changed = {e['key']: e for e in doc['changed']}
    assert set(changed) == {'w', 'r', 'n'}, doc['changed']
    for key in ('w', 'r'):
      assert changed[key]['changes'] == {'values': 'differ'}, changed[key]
      assert changed[key]['values_basis'] == 'crc32c', changed[key]
    assert doc['compared']['values_not_compared'] == [], doc['compared']
    assert changed['n']['values_basis'] == ('read' if flags else 'crc32c'), changed['n']
  text = procs.run_cli('diff', a, b, '--values', timeout=120).stdout
  assert 'unreadable' not in text, text
  assert 'of 2 arrays of a local-only step by recorded crc32c' in text, text


@pytest.mark.parametrize('steps_in', ['storage', 'nodes'])
def test_the_preemption_save_is_local_committed_before_its_storage_save(tmp_path, steps_in):
  """After a notice, the preemption step's local-only copy commits before Orbax's storage save
  of it begins (``save()`` returns with it listed; with node steps, in the node and nothing of
  it beside the storage steps); a job killed before that storage save committed (here: its step
  directory gone) resumes from it."""
  root, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  env = {**LOCAL, 'ORBAX_PATHWAYS_TIER_DIR': tier, 'ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS': '5',
         'ORBAX_PATHWAYS_NO_SIGTERM': '1', 'ORBAX_PATHWAYS_LOCAL_STEPS_IN': steps_in}
  got = procs.worker_json(local_preempt_worker, 'save', root, env=env, timeout=300)
  # 5 dropped by tier_keep 1 in storage's records; a node keeps the step before its newest too.
  local = [5, 8] if steps_in == 'nodes' else [8]
  assert got == {'local_at_save_return': local, 'storage': [0, 8]}, got
  if steps_in == 'nodes':
    assert sorted(os.listdir(root)) == ['0', '8'], os.listdir(root)
  shutil.rmtree(root / '8')  # the storage save that the grace period cut off
  got = procs.worker_json(local_preempt_worker, 'resume', root, env=env, timeout=300)
  assert got == {'step': 8, 'exact': True}, got


@pytest.mark.parametrize('transport', ['in_process', 'colocated'])
def test_one_process_and_pathways_workers_save_and_resume_a_local_only_step(tmp_path, transport):
  """In one process: the in-process transport, and the colocated transport (Pathways: each simulated
  worker host writes its chunks to its node's tier inside its colocated call, the controller
  writes the index; in the CPU simulation every worker runs here). Step 10 is local-only:
  no array chunk in storage; resume takes it, every chunk from the tier."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax_pathways import preemption, stats  # pylint: disable=g-import-not-at-top

  root, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), transport=transport,
                                                local_steps_in='storage', local_save_interval_steps=10))
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('x', 'y'))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x', 'y'))
  base = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)
  options = ocp.CheckpointManagerOptions(save_interval_steps=100)
  with ocp.CheckpointManager(root, options=options) as m:
    for step in range(13):
      m.save(step, args=ocp.args.StandardSave({'w': jax.device_put(base + step, sharding)}))
    m.wait_until_finished()
    assert m.all_steps() == [0]
  # What the loop's save() spent on step 10: with the in-process transport the save ran in the
  # background and the loop took only the host copy (reported apart from the serialize, which
  # ran on the background thread); in the loop's thread (colocated), the serialize is all of it.
  (local,) = stats.saves_for_step(10, str(root / '.orbax-pathways-local'))
  (first,) = stats.saves_for_step(0, str(root))
  assert first.loop_snapshot_s is None
  if transport == 'in_process':
    assert local.loop_snapshot_s is not None and 0 < local.loop_snapshot_s < local.commit_s
  else:
    assert local.loop_snapshot_s is None and local.blocking_s > 0
  item = root / '.orbax-pathways-local' / '10' / 'default'
  assert sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(item) for f in fs) < 8192
  with ocp.CheckpointManager(root, options=options) as m:
    target = {'w': jax.ShapeDtypeStruct(base.shape, base.dtype, sharding=sharding)}
    step, got = preemption.resume(m, lambda: None, abstract_state=target)
  assert step == 10
  np.testing.assert_array_equal(np.asarray(got['w']), base + 10)
  st = stats.last_restore()
  assert st.transport == transport and st.bytes_by_source.get('storage', 0) == 0, st


def test_under_pathways_a_storage_step_is_not_saved_again_as_a_local_only_step(tmp_path):
  """The colocated transport (Pathways) with node steps asked for (the default): its local-only
  steps keep storage's records (node steps are saved on the background thread only), and a
  storage step on the local interval is saved once, in storage: no local-only copy of it."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top

  root, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), transport='colocated',
                                                local_steps_in='nodes', local_save_interval_steps=5))
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('x', 'y'))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x', 'y'))
  base = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
  with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(
      save_interval_steps=10)) as m:
    for step in range(13):
      m.save(step, args=ocp.args.StandardSave({'w': jax.device_put(base + step, sharding)}))
    m.wait_until_finished()
    assert m.all_steps() == [0, 10]
  local = sorted(n for n in os.listdir(root / '.orbax-pathways-local') if n.isdigit())
  assert local == ['5'], local
  assert not (tier / '.node-steps').exists()


def test_a_tier_that_cannot_take_the_step_costs_the_local_save_only(tmp_path, caplog):
  """The tier directory cannot be made (a file is in its way): the local-only save of step 10
  fails with one warning naming the step, training goes on, nothing of step 10 is listed or
  left in storage, and resume takes storage's step 0."""
  import logging  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax_pathways import preemption  # pylint: disable=g-import-not-at-top

  root, blocker = tmp_path / 'ckpt', tmp_path / 'a_file'
  blocker.write_text('not a directory')
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(blocker / 'tier'),
                                                local_steps_in='storage', local_save_interval_steps=10))
  x = jax.device_put(np.arange(64, dtype=np.float32))
  options = ocp.CheckpointManagerOptions(save_interval_steps=100)
  caplog.set_level(logging.WARNING, logger='orbax_pathways')
  with ocp.CheckpointManager(root, options=options) as m:
    for step in range(12):
      m.save(step, args=ocp.args.StandardSave({'x': x + step}))
    m.wait_until_finished()
    assert m.all_steps() == [0]
  failed = [r.getMessage() for r in caplog.records if 'local-only save' in r.getMessage()]
  assert failed and 'step 10' in failed[0], [r.getMessage() for r in caplog.records]
  # Nothing of step 10 is left in storage either: its unfinished directory
  # (10.orbax-checkpoint-tmp) is removed once the save failed, not left for every failed step.
  local = root / '.orbax-pathways-local'
  assert not local.exists() or not [n for n in os.listdir(local) if n[0].isdigit()], (
      os.listdir(local))
  with ocp.CheckpointManager(root, options=options) as m:
    step, got = preemption.resume(m, lambda: None)
  assert step == 0 and np.array_equal(np.asarray(got['x']), np.arange(64, dtype=np.float32))


def _busy_run(root, tiers, env):
  res = run_processes(WORKER, 3, 2, args=['save', str(root), 'sharded'], timeout=400,
                      env={'ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS': '5', 'ORBAX_PATHWAYS_LOCAL_STEPS_IN': 'storage',
                           'ORBAX_PATHWAYS_TIER_KEEP': '10',
                           'ORBAX_PATHWAYS_LOCAL_SAVE_WHEN_BUSY': 'skip', **env},
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers])
  return [r.results for r in res], [r.stderr_tail[-1500:] for r in res]


def test_every_process_skips_the_same_busy_local_steps(tmp_path):
  """``ORBAX_PATHWAYS_LOCAL_SAVE_WHEN_BUSY=skip``, local-only saves every 5 steps: the primary
  host is slow to commit step 5 (its index merge waits until its step-10 ``save()`` returned),
  so its save of step 5 still runs when step 10 is due. Its answer is every process's: all three
  skip step 10, save 15, 20 and 25, and the resume takes step 25 from the tiers."""
  root, tiers = tmp_path / 'ckpt', [tmp_path / f'node{i}' for i in range(3)]
  results, tails = _busy_run(root, tiers, {'BUSY_AT': '5'})
  assert results == [[{'steps': [0], 'local_steps': [5, 15, 20, 25]}]] * 3, (results, tails)
  out, left = _resume(root, tiers, 'sharded', tmp_path / 'run')
  for step, by_source, _ in out:
    assert step == 25 and by_source.get('storage', 0) == 0, (step, by_source)
  assert left == ['15', '20', '25', '5'], left  # nothing newer than step 25 to delete


def test_a_busy_process_that_is_not_the_primary_waits_instead_of_skipping(tmp_path):
  """The same with process 1 slow to finish its save of step 5 after the commit (its thread
  still runs at step 10) and the other processes' saves done: the primary host says go, so
  process 1 waits for its save and saves step 10 with the others. Deciding alone, it would skip
  step 10 and leave the other two waiting in the hidden manager's barriers (checked: the run
  then hangs there)."""
  root, tiers = tmp_path / 'ckpt', [tmp_path / f'node{i}' for i in range(3)]
  results, tails = _busy_run(root, tiers, {'SLOW_AFTER': '5'})
  assert results == [[{'steps': [0], 'local_steps': [5, 10, 15, 20, 25]}]] * 3, (results, tails)


def test_after_wait_until_finished_no_process_lists_a_step_the_primary_host_still_deletes(
    tmp_path):
  """Local-only saves every 5 steps, the newest 2 kept; the primary host's retention takes 2 s
  a deletion (its own thread, after each commit). Once ``wait_until_finished()`` returned,
  every process lists the same local-only steps, the kept ones only, as after stock Orbax's
  save (its deletion comes before the save's closing barrier). Before, the other processes
  returned at once and listed steps the primary host was still deleting (a resume's listing
  then failed on a step gone under it: CI of 2026-12-05)."""
  root, tiers = tmp_path / 'ckpt', [tmp_path / f'node{i}' for i in range(3)]
  res = run_processes(WORKER, 3, 2, args=['save', str(root), 'sharded'], timeout=400,
                      env={'ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS': '5', 'ORBAX_PATHWAYS_LOCAL_STEPS_IN': 'storage',
                           'ORBAX_PATHWAYS_TIER_KEEP': '2', 'SLOW_RETENTION': '1'},
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers])
  results = [r.results for r in res]
  assert results == [[{'steps': [0], 'local_steps': [20, 25]}]] * 3, (
      results, [r.stderr_tail[-1500:] for r in res])
