"""A save that fails on a read-only directory: the error is raised, and the process exits
promptly (issue 21, item 8). Stock Orbax leaves its commit threads waiting ~300 s for a
directory-creation signal that never comes, and the interpreter waits for them at exit."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from support import REPO
from support.procs import child_env

# Stock Orbax's waiters give up after the coordination timeout (300 s); a prompt exit is far below.
EXIT_LIMIT_S = 120


@contextlib.contextmanager
def read_only_dir(path):
  """``path`` as a directory nobody can create entries in (root included: immutable)."""
  path.mkdir()
  if os.geteuid() == 0:
    if shutil.which('chattr') is None or subprocess.run(
        ['chattr', '+i', str(path)], capture_output=True).returncode != 0:
      pytest.skip('running as root and cannot make a directory immutable (chattr +i)')
    undo = ['chattr', '-i', str(path)]
  else:
    path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    undo = None
  try:
    yield path
  finally:
    if undo:
      subprocess.run(undo, check=False)
    else:
      path.chmod(stat.S_IRWXU)


def test_failed_save_on_read_only_directory_raises_and_exits_promptly(tmp_path):
  code = textwrap.dedent(f"""
      import orbax.checkpoint as ocp
      import orbax_pathways
      from support.arrays import mesh, random_state
      state = random_state(mesh())
      try:
        with ocp.CheckpointManager({str(tmp_path / 'ro')!r}) as mngr:
          mngr.save(0, args=ocp.args.StandardSave(state))
          mngr.wait_until_finished()
        print('SAVED', flush=True)
      except Exception as e:
        print('ERROR', type(e).__name__, e, flush=True)
      print('MAIN DONE', flush=True)
  """)
  with read_only_dir(tmp_path / 'ro'):
    t0 = time.monotonic()
    try:
      proc = subprocess.run([sys.executable, '-c', code], env=child_env(), cwd=REPO,
                            capture_output=True, text=True, timeout=EXIT_LIMIT_S)
    except subprocess.TimeoutExpired as e:
      out = (e.stdout or b'').decode(errors='replace') if isinstance(e.stdout, bytes) else e.stdout
      pytest.fail(f'the process did not exit within {EXIT_LIMIT_S}s after its save failed on a '
                  f'read-only directory; stdout: {out!r}')
    elapsed = time.monotonic() - t0
  print(f'\n[read-only] exited {proc.returncode} after {elapsed:.1f}s')
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert 'MAIN DONE' in proc.stdout and 'SAVED' not in proc.stdout, proc.stdout
  error = next(l for l in proc.stdout.splitlines() if l.startswith('ERROR'))
  assert 'SaveError' in error and str(tmp_path / 'ro') in error, error
  assert 'Permission' in error or 'not permitted' in error, error
