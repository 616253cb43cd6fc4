"""A process that dies mid-save: the others raise, naming it, and exit.

Real ``jax.distributed`` processes (``tests/support/mp_harness.py``), real Orbax
CheckpointManager, real tensorstore on a shared local directory (the worker:
``support/workers/liveness_worker.py``). Every process saves step 1 (committed), then step 2;
the last process's writes of step 2 never finish (its background commit never reports), and it ``os._exit``s once the others are past ``save(2)``. Stock Orbax
(and orbax-pathways before the liveness round): the others wait in Orbax's ``async_write_complete`` barrier until jax's heartbeat timeout
(100 s), then jax aborts them with SIGABRT and no Python error. Now: each survivor's
``wait_until_finished`` raises ``PeerLostError`` (a ``SaveError``) naming the dead process
within the liveness deadline (``ORBAX_PATHWAYS_PEER_TIMEOUT_S``, small here), step 2 is never
listed, and every survivor exits 0 on its own. No test asserts a duration: a hang shows as the
harness's timeout.
"""

from __future__ import annotations

import os

import pytest

from support.mp_harness import run_processes
from support.workers import liveness_worker

pytestmark = pytest.mark.multiprocess

@pytest.mark.parametrize('num_processes', [2, 3])
def test_process_dying_mid_save_is_named_and_nobody_hangs(tmp_path, num_processes):
  ckpt = tmp_path / 'ckpt'
  results = run_processes(liveness_worker.__file__, num_processes, devices_per_process=2, args=[str(ckpt)],
                          shared_dir=str(tmp_path), timeout=420, check=False,
                          fail_fast_grace=400, env={'ORBAX_PATHWAYS_PEER_TIMEOUT_S': '5'})
  dead = num_processes - 1
  survivors = [r for r in results if r.process_id != dead]
  for r in survivors:
    print(f'\n[p{r.process_id}] rc={r.returncode} {r.duration_s:.1f}s {r.results}')
    stderr = '\n'.join(l for l in r.stderr_tail.splitlines() if not l.lstrip().startswith('@'))
    assert r.returncode == 0, f'rc={r.returncode} results={r.results}\n{stderr[-8000:]}'
    raised = r.results[1 if r.process_id == 0 else 0]
    assert raised['raised'] is not None, r.results
    assert raised['save_error'], raised
    assert raised['missing'] == [dead], raised
    assert f'process {dead}' in raised['raised'], raised
    assert 'Step 2' in raised['raised'] and 'not committed' in raised['raised'], raised
    assert r.results[-1] == {'steps': [1]}, r.results
  assert results[0].results[0] == {'keys_left': []}, results[0].results
  assert '2' not in os.listdir(ckpt), os.listdir(ckpt)  # never committed (only its tmp dir)
