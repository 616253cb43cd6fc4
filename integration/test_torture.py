"""Runs integration/torture.py: 20 SIGKILL rounds against a local directory (about 1 minute)."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_torture_20_rounds_local(tmp_path):
  r = subprocess.run(
      [sys.executable, os.path.join(HERE, 'torture.py'), '--rounds', '20', '--seed', '0',
       '--dir', str(tmp_path / 'ckpt')],
      capture_output=True, text=True, timeout=600, cwd=os.path.dirname(HERE))
  summary = [l for l in r.stdout.splitlines() if l.startswith(('torture:', 'FAIL'))]
  print('\n'.join(summary))
  assert r.returncode == 0, '\n'.join(summary) + '\n' + r.stderr[-3000:]
  assert 'failures=0' in summary[-1]


def test_torture_rounds_on_fake_gcs():
  """The same kills against fake-gcs-server (object store: commit marker, no rename)."""
  r = subprocess.run(
      [sys.executable, os.path.join(HERE, 'torture.py'), '--rounds', '6', '--seed', '1',
       '--fake-gcs', '--dir', '-', '--mib', '8', '--min-delay', '1.0', '--max-delay', '4.0'],
      capture_output=True, text=True, timeout=600, cwd=os.path.dirname(HERE))
  summary = [l for l in r.stdout.splitlines() if l.startswith(('torture:', 'FAIL'))]
  print('\n'.join(summary))
  assert r.returncode == 0, '\n'.join(summary) + '\n' + r.stderr[-3000:]
  assert 'failures=0' in summary[-1] and 'dir=gs://' in summary[-1]
