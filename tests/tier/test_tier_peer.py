"""Survivor-first restore: a chunk this node's tier lacks comes from another
process's tier over the peer channel (``peer/client.py``) before storage.

Real ``jax.distributed`` processes, one tier directory per simulated node, an unchanged
``ocp.CheckpointManager``. Three processes (nodes 0, 1, 2; two devices each) save steps 1 and 2
once (``tier_keep`` 2); each test copies the tiers, damages them as its case says, and restores
step 2 onto two processes (nodes 0 and 1): node 2 is lost. The failure matrix:

- a node lost, restore onto fewer processes: the lost node's chunks from storage, the rest
  from the survivors (each process's own from its tier, the other survivor's over the channel);
- a flipped byte in a peer's chunk: that chunk from storage;
- a node lost during a save (its tier holds step 1, storage's newest is 2): never used;
- a tier directory that cannot be written (save): the save goes on, its chunks from storage;
- ``tier_scope='held'``: replicated state comes wholly from each survivor's own tier;
- replicated state with the default scope: the lost node's part of it is read from storage
  once, by one survivor, and passed to the other (``fleet/relay.py``); a relay that fails
  costs the asker its own storage read;
- a peer that accepts and never answers, one that refuses connections (its process gone) and
  one that dies in the middle of sending a chunk: that peer's chunks from storage within the
  deadline, one log line naming it.

Every case checks bit-exact values and the bytes by source; nothing may hang (generous harness
timeouts, no timing assertions).
"""

from __future__ import annotations

import os
import shutil

import pytest

from support.mp_harness import run_processes
from support.workers import tier_peer_worker
from orbax_pathways.tier import store as tier_store

pytestmark = pytest.mark.multiprocess

WORKER = tier_peer_worker.__file__

# Save: 3 processes, mesh (3, 2): process i writes rows 32i..32i+32 of 'w' (one 32x64 chunk,
# 8 KiB) and 'b'[32i:32i+32] (128 B); process 0 writes the replicated 'r' (160 B). Restore onto
# 2 processes, mesh (2, 2): process 0 needs rows 0..48 (the chunks at rows 0 and 32), process 1
# rows 48..96 (chunks at rows 32 and 64).
W_CHUNK, B_CHUNK, R = 32 * 64 * 4, 32 * 4, 40 * 4
OWN = W_CHUNK + B_CHUNK  # what each node wrote of 'w' and 'b'


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  base = tmp_path_factory.mktemp('peer')
  root, tiers = base / 'ckpt', [base / f'node{i}' for i in range(3)]
  res = run_processes(WORKER, 3, 2, args=['save', str(root), 'none'], timeout=400,
                      env={'ORBAX_PATHWAYS_TIER_KEEP': '2'},
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers])
  assert [r.results for r in res] == [[{'saved': True}]] * 3
  return root, tiers


def _nodes(saved, tmp_path):
  """Copies of nodes 0 and 1 (node 2 is lost)."""
  root, tiers = saved
  out = [tmp_path / f'node{i}' for i in range(2)]
  for src, dst in zip(tiers, out):
    shutil.copytree(src, dst)
  return root, out


def _restore(root, tiers, faults=('none', 'none'), timeout_s=5, env=None):
  res = run_processes(WORKER, 2, 2, args=['restore', str(root)], timeout=400,
                      per_process_args=[[f] for f in faults],
                      env={'ORBAX_PATHWAYS_TIER_PEER_TIMEOUT_S': str(timeout_s), **(env or {})},
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers])
  out = []
  for r in res:
    (one,) = r.results
    assert one['exact'] and one['step'] == 2, one
    out.append((one['bytes_by_source'], r.stderr_tail))
  _restore.lookups = [r.results[0]['lookups'] for r in res]
  return out


def _entry(tier, step, writer):
  (e,) = [e for e in tier_store.entries(str(tier)) if e.step == step and e.writer == writer]
  return e


def test_lost_node_restore_onto_fewer_processes_reads_survivors_first(saved, tmp_path):
  root, tiers = _nodes(saved, tmp_path)
  # Process 0 looks only once process 1 has published (the usual case in a fleet that starts
  # together; left to chance, it is the next test's). The deadline only bounds a late peer.
  (p0, _), (p1, _) = _restore(root, tiers, faults=('after:1', 'none'), timeout_s=60)
  # Process 0: its own chunks (and 'r') from its tier, node 1's chunks at row 32 from node 1.
  assert p0 == {'local': OWN + R, 'peer': OWN, 'storage': 0}, p0
  # Process 1: its own from its tier, 'r' from node 0, only the lost node's chunks from storage.
  assert p1 == {'local': OWN, 'peer': R, 'storage': OWN}, p1
  # Who was asked (the index's writer column): process 0 lacks only writer p1's chunks, so it
  # read p1's holder key (one) and asked node 1 alone for its list, never reading every
  # process's key. Process 1 lacks p0's ('r') and the lost p2's: one list (node 0's); p2 has
  # no holder, which only every process's key (read once) can tell, and p0's holder key, if
  # process 1 looked before process 0 published, is read again after it: three holder reads.
  l0, l1 = _restore.lookups
  assert (l0.get('gathers', 0), l0['holder_reads'], l0['lists'], l0['keys_read']) == (0, 1, 1, 1), l0
  assert (l1['gathers'], l1['holder_reads'], l1['lists']) == (1, 3, 1), l1


def test_a_holder_that_publishes_after_the_reader_looked_is_still_asked(saved, tmp_path):
  """Process 0 looks for p1's holder before process 1 has published (process 1 waits for that):
  no holder key yet, so process 0 reads every process's key once (lost, or late?), waiting for
  process 1's, then p1's holder key again, and takes node 1's chunks from node 1, not storage."""
  root, tiers = _nodes(saved, tmp_path)
  (p0, _), (p1, _) = _restore(root, tiers, faults=('tell_empty', 'after_empty'), timeout_s=60)
  assert p0 == {'local': OWN + R, 'peer': OWN, 'storage': 0}, p0
  assert p1 == {'local': OWN, 'peer': R, 'storage': OWN}, p1
  l0, _ = _restore.lookups
  assert (l0['gathers'], l0['holder_reads'], l0['lists'], l0['keys_read']) == (1, 2, 1, 2), l0


def test_flipped_byte_in_a_peers_chunk_is_read_from_storage(saved, tmp_path):
  root, tiers = _nodes(saved, tmp_path)
  e = _entry(tiers[1], 2, 'p1')
  (w,) = [a for a in e.manifest.arrays if a.name == 'w']
  path = os.path.join(e.path, w.files[0])
  data = bytearray(open(path, 'rb').read())
  data[7] ^= 0x10
  open(path, 'wb').write(bytes(data))
  (p0, err0), (p1, _) = _restore(root, tiers)
  assert p0 == {'local': OWN + R, 'peer': B_CHUNK, 'storage': W_CHUNK}, (p0, err0[-3000:])
  assert "is damaged" in err0 and "peer" in err0, err0[-4000:]
  assert p1 == {'local': B_CHUNK, 'peer': R, 'storage': OWN + W_CHUNK}, p1  # its own copy too


def test_a_peers_copy_of_another_dtype_is_not_used(saved, tmp_path):
  """Process 1's list says int32 for the float32 'w' (same bytes, so the crc32c would match):
  process 0 takes that chunk from storage, never the bytes converted as int32 values."""
  root, tiers = _nodes(saved, tmp_path)
  (p0, err0), (p1, _) = _restore(root, tiers, faults=('none', 'dtype'))
  assert p0 == {'local': OWN + R, 'peer': B_CHUNK, 'storage': W_CHUNK}, (p0, err0[-3000:])
  assert 'as int32; the committed record says float32' in err0, err0[-3000:]
  assert p1 == {'local': OWN, 'peer': R, 'storage': OWN}, p1


def test_node_lost_during_a_save_holds_an_older_step_never_used(saved, tmp_path):
  root, tiers = _nodes(saved, tmp_path)
  shutil.rmtree(_entry(tiers[1], 2, 'p1').path)  # node 1 died before step 2 reached its tier
  (p0, _), (p1, _) = _restore(root, tiers)
  _lost_own_and_node2(p0, p1)


def _lost_own_and_node2(p0, p1):
  """Node 1's chunks (rows 32..64) are in no tier: both processes need them, and one storage
  read of each serves both (``fleet/relay.py``: which of the two reads which is a hash pick);
  process 1 alone needs node 2's (rows 64..96) and reads them itself."""
  assert p0['local'] == OWN + R and 'peer' not in p0, p0
  assert p0.get('storage', 0) + p0.get('relay', 0) == OWN, p0
  assert p1['peer'] == R and 'local' not in p1, p1
  assert p1.get('storage', 0) + p1.get('relay', 0) == 2 * OWN, p1
  assert p0.get('storage', 0) + p1.get('storage', 0) == 2 * OWN, (p0, p1)  # not 3 * OWN


@pytest.mark.parametrize('fault', ['stall', 'refuse', 'die_mid_chunk', 'tib'])
def test_a_peer_failing_during_the_restore_falls_back_to_storage(saved, tmp_path, fault):
  """'tib': a peer whose answer claims 1 TiB costs a PeerError and its
  chunks from storage, never a MemoryError that fails the restore."""
  root, tiers = _nodes(saved, tmp_path)
  (p0, err0), (p1, _) = _restore(root, tiers, faults=('none', fault), timeout_s=3)
  assert p0 == {'local': OWN + R, 'storage': OWN}, p0
  assert 'peer process 1' in err0, err0[-3000:]
  assert p1 == {'local': OWN, 'peer': R, 'storage': OWN}, p1


def test_a_tier_that_cannot_be_written_costs_only_its_chunks(tmp_path):
  root = tmp_path / 'ckpt'
  blocker = tmp_path / 'a_file'
  blocker.write_text('not a directory')
  tiers = [tmp_path / 'node0', blocker / 'node1', tmp_path / 'node2']
  res = run_processes(WORKER, 3, 2, args=['save', str(root), 'none'], timeout=400,
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers])
  assert [r.results for r in res] == [[{'saved': True}]] * 3
  assert 'node-local tier skipped' in res[1].stderr_tail
  (p0, _), (p1, _) = _restore(root, tiers[:2])
  _lost_own_and_node2(p0, p1)


def test_held_scope_keeps_replicas_so_replicated_state_survives_a_lost_node(tmp_path):
  """``Options.tier_scope='held'``: each node also keeps the whole chunks of replicas other
  hosts write. 'm' (replicated across the 3 slices, its writing split over them) then comes
  wholly from each survivor's own tier; with 'written' the lost node's part of it would be read
  from storage by both survivors."""
  root = tmp_path / 'ckpt'
  tiers = [tmp_path / f'node{i}' for i in range(3)]
  held = {'ORBAX_PATHWAYS_TIER_SCOPE': 'held'}
  res = run_processes(WORKER, 3, 2, args=['save', str(root), 'none'], timeout=400, env=held,
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers])
  assert [r.results for r in res] == [[{'saved': True}]] * 3
  m = 96 * 64 * 4
  (p0, _), (p1, _) = _restore(root, tiers[:2], env=held)
  assert p0 == {'local': OWN + R + m, 'peer': OWN, 'storage': 0}, p0
  assert p1 == {'local': OWN + R + m, 'storage': OWN}, p1


def _save_replicated(tmp_path):
  root = tmp_path / 'ckpt'
  tiers = [tmp_path / f'node{i}' for i in range(3)]
  res = run_processes(WORKER, 3, 2, args=['save', str(root), 'none'], timeout=400,
                      # 64 KiB chunks: the lost third of 'm' is 32 chunks, so each survivor
                      # is the fetcher of some of them (a hash pick) and asks the other for
                      # the rest.
                      env={'WITH_M': '1', 'ORBAX_PATHWAYS_MAX_CHUNK_BYTES': str(64 << 10)},
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers])
  assert [r.results for r in res] == [[{'saved': True}]] * 3
  return root, tiers


M = 768 * 2048 * 4  # 'm' with WITH_M: replicated across slices; each node wrote a third of it


def test_replicated_state_lost_part_is_read_from_storage_once_for_all_survivors(tmp_path):
  """Default scope ('written'): node 2's third of 'm' is in no survivor's tier, and both
  survivors need it. Each of its chunks is read from storage by one of them (the same pick on
  both) and passed to the other: storage bytes for it = what the lost node held, not twice."""
  root, tiers = _save_replicated(tmp_path)
  (p0, err0), (p1, err1) = _restore(root, tiers[:2], env={'WITH_M': '1'})
  lost_m = M // 3
  # Everything but the lost third of 'm' as before (sharded arrays: their owner reads them).
  assert p0['local'] == OWN + R + M // 3 and p0['peer'] == OWN + M // 3, p0
  assert p1['local'] == OWN + M // 3 and p1['peer'] == R + M // 3, p1
  # The lost third of 'm': once from storage in all, the rest of it relayed.
  m_storage = p0.get('storage', 0) + p1.get('storage', 0) - OWN  # p1 reads node 2's 'w'/'b'
  assert m_storage == lost_m, (p0, p1)
  assert p0.get('relay', 0) + p1.get('relay', 0) == lost_m, (p0, p1)
  assert p0.get('relay', 0) and p1.get('relay', 0), (p0, p1)  # each fetched some for the other
  assert 'not usable' not in err0 + err1, (err0[-3000:], err1[-3000:])


def test_a_relay_whose_fetcher_fails_falls_back_to_the_askers_own_storage_read(tmp_path):
  """Process 1 answers every relay request with an error: process 0 reads the chunks
  process 1 was to fetch from storage itself (one log line), values bit-exact."""
  root, tiers = _save_replicated(tmp_path)
  (p0, err0), (p1, _) = _restore(root, tiers[:2], faults=('none', 'no_relay'),
                                 env={'WITH_M': '1'})
  lost_m = M // 3
  assert p0.get('relay', 0) == 0, p0
  assert p0['storage'] == lost_m, p0  # all of the lost third, itself
  assert 'relay' in err0 and 'not usable' in err0, err0[-3000:]
  assert p1.get('storage', 0) + p1.get('relay', 0) == OWN + lost_m, p1
