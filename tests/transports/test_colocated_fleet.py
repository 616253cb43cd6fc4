"""A colocated save over 256 simulated workers, restored in a fresh process.

Two fresh interpreters (``support/workers/colocated_fleet_worker.py``) with 256 virtual CPU
devices (``XLA_FLAGS``), the colocated transport chosen by ``ORBAX_PATHWAYS_TRANSPORT=colocated``,
the node-local tier on (a directory of the test's own): one saves a state, the other restores it with a target and checks every value.
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

from support import procs
from support.workers import colocated_fleet_worker as worker

N = 256


def test_colocated_restore_over_256_workers_in_a_fresh_process(tmp_path):
  path, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  env = {'ORBAX_PATHWAYS_TRANSPORT': 'colocated', 'ORBAX_PATHWAYS_TIER_DIR': tier}
  saved = procs.worker_json(worker, 'save', path, N, env=env, devices=N, timeout=240)
  assert saved == {'transport': 'colocated', 'writers': N}, saved
  # A 10 s peer timeout: the call's deadline, which the restore ran past before (~13 s of
  # manifest reads here, unloaded); a restore that keeps making progress never reaches it.
  got = procs.worker_json(worker, 'restore', path, N, devices=N, timeout=240,
                          env={**env, 'ORBAX_PATHWAYS_PEER_TIMEOUT_S': 10})
  print(f'\n[256 colocated workers] {got}')
  assert got['equal'] == {'r': True, 'v': True, 'w': True}, got
  assert got['transport'] == 'colocated' and got['readers'] == N, got
  # Every byte from this node's tier ('r', replicated, is read by every simulated host).
  assert got['bytes'] == got['nbytes'] and got['by_source'].get('storage', 0) == 0, got
  # One manifest read per entry for the whole restore, not one per entry per simulated host.
  assert got['entries'] == N and got['opened']['manifest'] == N, got
  assert os.path.isdir(tier)
