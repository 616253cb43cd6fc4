"""A save that one process makes alone, beside the job's asynchronous storage saves
(``_compat/orbax_process_local.py``): two real ``jax.distributed`` processes x 2 CPU devices;
worker: ``tests/support/workers/process_alone_worker.py``."""

from __future__ import annotations

import os

import pytest

from support import workers
from support.mp_harness import run_processes

pytestmark = pytest.mark.multiprocess
WORKER = os.path.join(os.path.dirname(workers.__file__), 'process_alone_worker.py')


def test_saves_alone_on_each_process_leave_the_jobs_storage_saves_whole(tmp_path):
  """Saves of each process alone into its own directory (process 0 every step, process 1
  every other step), interleaved with the job's storage saves of every third step: every
  storage step commits, no process waits for another's save alone, and each directory restores
  its newest step exactly, and the job's Orbax operation ids stay the same on both processes
  at every storage save. Orbax names a save's key-value signals after that id: without the
  namespace each save alone advances its own process's counter only (process 0 entered storage
  step 3 with id 5, process 1 with 4), so one process waits on a key the other never sets, or
  is answered by the signal of an unrelated save alone."""
  results = run_processes(WORKER, 2, devices_per_process=2, shared_dir=str(tmp_path),
                          timeout=170, env={'DUMP_S': '150'})
  for r in results:
    out = r.result
    assert out is not None, r.stderr_tail
    assert out['errors'] == [], out
    assert out['storage_steps'] == [0, 3, 6, 9], out
    assert out['own_steps'] == ([8, 9] if r.process_id == 0 else [6, 8]), out
    assert out['storage_restored'] and out['own_restored'], out
    assert out['patched_after'], out
  assert results[0].result['op_ids'] == results[1].result['op_ids']
  assert sorted(os.listdir(tmp_path)) == ['node_0', 'node_1', 'storage']
  assert sorted(os.listdir(tmp_path / 'node_0')) == ['8', '9']
  assert sorted(os.listdir(tmp_path / 'node_1')) == ['6', '8']
