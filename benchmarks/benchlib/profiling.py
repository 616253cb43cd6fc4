"""``--profile METRIC``: one more iteration of one metric of one handler, with py-spy attached.

Called by ``bench.py`` after the reps, in the main process. ``profile_metric`` selects the
handler (``--profile-impl``), starts ``py-spy record --pid <this process>`` (250 Hz, raw collapsed
stacks; ``--nonblocking`` unless ``--profile-native``, which py-spy only allows blocking), runs
the one save / commit / restore under it, and reduces the raw file to the top-15 frames by self
and by inclusive samples. py-spy comes from ``.venv/bin/pip install py-spy``.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from benchlib import REPO
from benchlib.handlers import use_handler
from benchlib.measure import timed_restore
from benchlib.workloads import abstract


def find_py_spy() -> str | None:
  """py-spy next to this interpreter (the venv), else on PATH."""
  cand = os.path.join(os.path.dirname(sys.executable), 'py-spy')
  return cand if os.path.exists(cand) else shutil.which('py-spy')


@contextlib.contextmanager
def py_spy(out_path: str, native: bool):
  exe = find_py_spy()
  if exe is None:
    raise RuntimeError('py-spy not found: `.venv/bin/pip install py-spy`')
  cmd = [exe, 'record', '--pid', str(os.getpid()), '--rate', '250', '--format', 'raw',
         '--output', out_path]
  # --native needs to pause the process to unwind C++ stacks; py-spy refuses it with
  # --nonblocking, which we use otherwise so sampling does not slow the measured code.
  cmd.append('--native' if native else '--nonblocking')
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  time.sleep(1.5)  # attach
  if proc.poll() is not None:
    raise RuntimeError(f'py-spy exited: {proc.stderr.read()}')
  try:
    yield
  finally:
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    try:
      proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()


def _short(frame: str) -> str:
  # "func (path/to/file.py:123)" -> "func (file.py:123)" but keep package for site-packages
  if '(' not in frame:
    return frame
  fn, loc = frame.rsplit(' (', 1)
  loc = loc.rstrip(')')
  for marker in ('site-packages/', f'{REPO}/'):
    if marker in loc:
      loc = loc.split(marker, 1)[1]
  return f'{fn} ({loc})'


def top_frames(raw_path: str, k: int = 15) -> dict:
  """Top-k by self samples and by inclusive samples from py-spy raw (collapsed) output."""
  self_c, incl_c, total = collections.Counter(), collections.Counter(), 0
  with open(raw_path) as f:
    for line in f:
      line = line.rstrip('\n')
      if not line.strip():
        continue
      stack, _, cnt = line.rpartition(' ')
      try:
        n = int(cnt)
      except ValueError:
        continue
      frames = [_short(x) for x in stack.split(';') if x]
      # drop the per-thread root ("process ..."/"thread ...") if present
      frames = [x for x in frames if not x.startswith(('process ', 'thread '))]
      if not frames:
        continue
      total += n
      self_c[frames[-1]] += n
      for fr in set(frames):
        incl_c[fr] += n
  return {'total_samples': total,
          'self': [(f, c, c / max(total, 1)) for f, c in self_c.most_common(k)],
          'inclusive': [(f, c, c / max(total, 1)) for f, c in incl_c.most_common(k)]}


def profile_metric(metric, impl, state, mesh, half, tiny, storage, native) -> dict:
  """The top frames of one iteration of ``metric`` under ``impl``, with its wall time and the
  path of the raw py-spy output (kept)."""
  del mesh  # the same-mesh restore targets the saved shardings
  import orbax.checkpoint as ocp
  use_handler(impl)
  raw = os.path.join(tempfile.mkdtemp(prefix='bench-pyspy-'), f'{impl}-{metric}.txt')
  is_tiny = metric.startswith('tiny')
  tree = tiny if is_tiny else state
  path = storage.new_dir(f'profile-{impl}')
  wall = None
  try:
    with ocp.CheckpointManager(path) as mngr:
      if metric in ('save', 'commit', 'tiny_save'):
        with py_spy(raw, native):
          t0 = time.perf_counter()
          mngr.save(1, args=ocp.args.StandardSave(tree))
          if metric != 'save':
            mngr.wait_until_finished()
          wall = time.perf_counter() - t0
        mngr.wait_until_finished()
      else:
        mngr.save(1, args=ocp.args.StandardSave(tree))
        mngr.wait_until_finished()
        target = abstract(tree, half if metric == 'restore_fewer' else None)
        gc.collect()
        with py_spy(raw, native):
          out, wall = timed_restore(mngr, 1, target)
        del out
  finally:
    storage.remove(path)
  top = top_frames(raw)
  top.update({'metric': metric, 'impl': impl, 'wall_s': wall, 'raw': raw, 'native': native})
  return top
