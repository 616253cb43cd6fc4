"""README command 1's job, shortened: train, SIGTERM, resume on fewer slices (subprocesses)."""

import os
import sys

from support import REPO
from support import procs


def test_main_job_is_preempted_and_resumes_on_fewer_slices(tmp_path):
  # No device-count flag: the example sets its own slices' devices.
  r = procs.run([sys.executable, os.path.join(REPO, 'examples', 'train.py'),
                 '--dir', tmp_path / 'ckpt', '--steps', '32', '--preempt-at', '12'],
                devices=None, timeout=300, check=False)
  out = r.stdout
  assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
  assert '== driver: sending SIGTERM (preemption notice) after step 15' in out
  preempted = [l for l in out.splitlines() if 'preemption notice: checkpoint of step' in l]
  assert preempted, out
  step = int(preempted[0].split('checkpoint of step ')[1].split()[0])
  assert f'[3 slices] resumed step {step} ' in out
  assert "over mesh {'data': 3, 'model': 2}" in out
  assert '[3 slices] finished 32 steps' in out
