"""Runs integration/chaos.py's smoke: 10 faults of a fixed seed's schedule against a 4-process
multi-tier job on fake-gcs-server, once per place local-only steps go (the long soak runs on
demand: benchmarks/README.md)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from support.procs import Background

HERE = os.path.dirname(os.path.abspath(__file__))
CHAOS = os.path.join(HERE, 'chaos.py')


@pytest.mark.multiprocess
@pytest.mark.gcs
@pytest.mark.timeout(1200)
@pytest.mark.parametrize('mode,seed', [('nodes', 1), ('storage', 0)])
def test_ten_faults_all_recovered_with_the_right_values(tmp_path, mode, seed):
  """Local-only steps on the nodes (the default) and in storage (``local_steps_in='storage'``:
  data iterators, Pathways), each under a fixed seed's schedule; the two schedules strike the
  job in 8 kinds of ways each."""
  out = tmp_path / 'chaos.json'
  # --fast-start: the jobs' processes skip importing jax and Orbax (CI time; the recoveries
  # and values checked are the same).
  run = Background([sys.executable, CHAOS, '--faults', '10', '--seed', seed, '--json-out', out,
                    '--local-steps-in', mode, '--fast-start'],
                   tmp_path / 'log')
  try:
    r = run.wait(timeout=1100)
  finally:
    run.kill()
  lines = r.stdout.splitlines()
  report = '\n'.join(l for l in lines if l.startswith(('fault', 'FAIL', 'chaos:')))
  assert r.returncode == 0, report + '\n' + r.stderr[-3000:]
  assert lines[-1].startswith('chaos: 10/10 recovered, 0 wrong values, 0 hangs'), report
  faults = json.loads(out.read_text())['faults']
  # Every restart resumed a step whose values every process checked; the schedule struck
  # the job in several ways, not one.
  assert len(faults) == 10 and all(f['recovered'] for f in faults), report
  assert len({f['kind'] for f in faults}) >= 8, report
  assert all(f['resumed_step'] is not None for f in faults[1:]), report
