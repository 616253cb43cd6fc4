"""The node-local tier under real multi-controller JAX: each process is one simulated node with
its own tier directory (``ORBAX_PATHWAYS_TIER_DIR``), real ``jax.distributed`` processes, an
unchanged ``ocp.CheckpointManager``.

1. Two processes save steps 1 and 2, then every process SIGKILLs itself right after the commit.
2. Restarted on the same topology, they restore the latest step from their tiers: 0 bytes from
   storage (a replicated array another node wrote comes from that node's tier), bit-exact (one node's "committed" markers removed first: a kill between the commit
   and the marker must not matter, storage's save ids decide).
3. One process with half the devices restores it from the first node's tier: what that tier
   holds comes from it, the rest (the lost node's chunks) from storage.
"""

from __future__ import annotations

import os

import pytest

from support.mp_harness import run_processes
from support.workers import tier_kill_worker
from orbax_pathways.tier import manifest as tier_layout
from orbax_pathways.tier import store as tier_store

pytestmark = pytest.mark.multiprocess

WORKER = tier_kill_worker.__file__


def _tiers(tmp_path, n):
  return [tmp_path / f'node{i}' for i in range(n)]


def test_sigkill_after_commit_then_restore_from_tiers(tmp_path):
  root = tmp_path / 'ckpt'
  tiers = _tiers(tmp_path, 2)
  saved = run_processes(WORKER, 2, 4, args=['save', str(root)], timeout=240, check=False,
                        per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers])
  assert [r.results for r in saved] == [[{'saved': True}]] * 2, [r.stderr_tail for r in saved]
  per_node = []
  for i, t in enumerate(tiers):
    entries = tier_store.entries(str(t), str(root))
    assert [(e.step, e.writer) for e in entries] == [(2, f'p{i}')]  # step 1 dropped after 2
    per_node.append(entries[0].manifest.nbytes)
  replicated = 40 * 4
  total = 256 * 64 * 4 + 96 * 4 + replicated
  assert sum(per_node) == total  # each node holds exactly the chunks it wrote
  for e in tier_store.entries(str(tiers[1]), str(root)):  # killed before marking: still usable
    os.remove(os.path.join(e.path, tier_layout.COMMITTED))

  same = run_processes(WORKER, 2, 4, args=['restore', str(root)], timeout=240,
                       per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': str(t)} for t in tiers])
  for i, r in enumerate(same):
    (res,) = r.results
    assert res['exact'] and res['step'] == 2
    # Sharded arrays come wholly from each node's own tier. A tier keeps only the chunks its
    # host wrote (no extra device-to-host copy): the replicated 'r' (written by p0) comes to p1
    # from p0's tier over the peer channel; nothing from storage.
    assert res['bytes_by_source'] == {'local': per_node[i], 'storage': 0,
                                      **({'peer': replicated} if i else {})}, res

  fewer = run_processes(WORKER, 1, 4, args=['restore', str(root)], timeout=240,
                        env={'ORBAX_PATHWAYS_TIER_DIR': str(tiers[0])})
  (res,) = fewer[0].results
  assert res['exact'] and res['step'] == 2
  assert res['bytes_by_source'] == {'local': per_node[0], 'storage': total - per_node[0]}, res
