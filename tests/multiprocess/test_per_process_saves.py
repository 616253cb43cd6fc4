"""Orbax's "every host its own storage" settings (``primary_host=None``, ``replica_id=None``, as
Orbax's local managers build their array handler): each process saves alone into a directory of
its own, and that save is complete for what the process holds. Two real ``jax.distributed``
processes x 2 CPU devices; worker: ``tests/support/workers/per_process_save_worker.py``."""

from __future__ import annotations

import os

import pytest

from support.mp_harness import run_processes
from support import workers

pytestmark = pytest.mark.multiprocess
WORKER = os.path.join(os.path.dirname(workers.__file__), 'per_process_save_worker.py')


def test_each_process_saves_every_array_it_holds_into_its_own_directory(tmp_path):
  """A replicated array and a sharded one, saved by each process alone: every process's
  directory restores every shard it holds, with Orbax's ``ArrayHandler`` and with ours (which
  used to write a replicated array from one process of the job only, so the other process's
  directory lacked it: "1/3 params are missing in checkpoint"), and stock Orbax reads ours."""
  results = run_processes(WORKER, 2, devices_per_process=2, shared_dir=str(tmp_path),
                          timeout=150, env={'DUMP_S': '130'})
  for r in results:
    out = r.result
    assert out is not None, r.stderr_tail
    stock, ours = out['ArrayHandler'], out['ProxyArrayHandler']
    assert stock['restored'] and stock['arrays'] == ['b', 's', 'w'], (r.process_id, out)
    assert ours['arrays'] == stock['arrays'], (r.process_id, out)
    assert ours['restored'] and ours['stock_reads_ours'], (r.process_id, out)
    assert ours['wrote'] == 3, (r.process_id, out)
  for cls in ('ArrayHandler', 'ProxyArrayHandler'):
    assert sorted(p.name for p in (tmp_path / cls).iterdir()) == ['process_0', 'process_1']
