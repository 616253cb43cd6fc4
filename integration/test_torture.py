"""Runs integration/torture.py: 20 SIGKILL rounds against a local directory and 6 against
fake-gcs-server. The two runs are independent subprocesses (each kills and checks its own
training loop, round after round), so both start together, at the first test of this module;
each test then checks its own."""

from __future__ import annotations

import os
import sys

import pytest

from support.procs import Background

HERE = os.path.dirname(os.path.abspath(__file__))
TORTURE = os.path.join(HERE, 'torture.py')


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  base = tmp_path_factory.mktemp('torture')
  started = {
      'local': Background([sys.executable, TORTURE, '--rounds', '20', '--seed', '0',
                           '--dir', base / 'ckpt'], base / 'local'),
      # The same kills against fake-gcs-server (object store: commit marker, no rename).
      'gcs': Background([sys.executable, TORTURE, '--rounds', '6', '--seed', '1', '--fake-gcs',
                         '--dir', '-', '--mib', '8', '--min-delay', '1.0', '--max-delay', '4.0'],
                        base / 'gcs'),
  }
  yield started
  for run in started.values():
    run.kill()


def _summary(run: Background):
  r = run.wait(timeout=600)
  summary = [l for l in r.stdout.splitlines() if l.startswith(('torture:', 'FAIL'))]
  print('\n'.join(summary))
  assert r.returncode == 0, '\n'.join(summary) + '\n' + r.stderr[-3000:]
  return summary


def test_torture_20_rounds_local(runs):
  summary = _summary(runs['local'])
  assert 'failures=0' in summary[-1]


def test_torture_rounds_on_fake_gcs(runs):
  """The same kills against fake-gcs-server (object store: commit marker, no rename)."""
  summary = _summary(runs['gcs'])
  assert 'failures=0' in summary[-1] and 'dir=gs://' in summary[-1]
