"""A save that fails on a read-only directory: the error is raised, and the process exits
promptly. Stock Orbax leaves its commit threads waiting ~300 s for a
directory-creation signal that never comes, and the interpreter waits for them at exit."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time

import pytest

from support import procs
from support.workers import readonly_save_worker

# Stock Orbax's waiters give up after the coordination timeout (300 s); a prompt exit is far below.
EXIT_LIMIT_S = 120


@contextlib.contextmanager
def read_only_dir(path):
  """``path`` as a directory nobody can create entries in (root included: immutable)."""
  path.mkdir()
  if os.geteuid() == 0:
    if shutil.which('chattr') is None or procs.run(
        ['chattr', '+i', path], check=False, timeout=60).returncode != 0:
      pytest.skip('running as root and cannot make a directory immutable (chattr +i)')
    undo = ['chattr', '-i', str(path)]
  else:
    path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    undo = None
  try:
    yield path
  finally:
    if undo:
      procs.run(undo, check=False, timeout=60)
    else:
      path.chmod(stat.S_IRWXU)


def test_failed_save_on_read_only_directory_raises_and_exits_promptly(tmp_path):
  with read_only_dir(tmp_path / 'ro'):
    t0 = time.monotonic()
    # Past EXIT_LIMIT_S the process is killed and the test fails with its output.
    proc = procs.run_worker(readonly_save_worker, tmp_path / 'ro', timeout=EXIT_LIMIT_S,
                            check=False)
    elapsed = time.monotonic() - t0
  print(f'\n[read-only] exited {proc.returncode} after {elapsed:.1f}s')
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert 'MAIN DONE' in proc.stdout and 'SAVED' not in proc.stdout, proc.stdout
  error = next(l for l in proc.stdout.splitlines() if l.startswith('ERROR'))
  assert 'SaveError' in error and str(tmp_path / 'ro') in error, error
  assert 'Permission' in error or 'not permitted' in error, error
