"""A process whose writer lease cannot be released at exit still exits (issue 21, item 1: "the
writer lease thread and our other background threads do not keep a failed process alive at
exit").

Real Orbax CheckpointManager in a fresh interpreter, fake-gcs-server behind the project's fault
proxy, which holds every request deleting the lease object open (storage that accepts and never
answers). Before: the exit waited for the delete, through tensorstore's stall timeout and its
retries (all held), many minutes. Now: at most ``lease.EXIT_RELEASE_S`` per lease, and no longer
than the lease timeout (3 s here, so that the test waits 3 s rather than 10), a warning naming
the lease, exit status 0. No duration is asserted beyond a generous hang limit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from urllib.parse import unquote

import pytest

from support import REPO
from support.procs import child_env

from orbax_pathways.manager import lease

pytestmark = pytest.mark.gcs

HANG_S = 150  # far above EXIT_RELEASE_S plus the save; the bug waited through every retry
LEASE_TIMEOUT_S = 3  # the child's lease timeout, which bounds its wait for the held delete


def test_exit_with_a_lease_delete_that_never_answers(faulty_gcs):
  path = faulty_gcs.path('ckpt')
  code = textwrap.dedent(f"""
      import sys
      import orbax.checkpoint as ocp
      import orbax_pathways
      from support.arrays import mesh, random_state
      state = random_state(mesh())
      mngr = ocp.CheckpointManager({path!r})
      mngr.save(0, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()
      print('SAVED', flush=True)
      sys.stdin.readline()
      print('MAIN DONE', flush=True)  # no close(): the lease is released at exit
  """)
  proc = subprocess.Popen([sys.executable, '-c', code],
                          env=child_env({lease.TIMEOUT_ENV: LEASE_TIMEOUT_S}), cwd=REPO,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  try:
    assert proc.stdout.readline().strip() == 'SAVED', proc.stderr.read()[-3000:]
    faulty_gcs.proxy.hold(lambda method, target: method == 'DELETE'
                          and 'orbax-pathways-lease.json' in unquote(target), count=10_000)
    proc.stdin.write('\n')
    proc.stdin.flush()
    try:
      out, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
      proc.kill()
      out, err = proc.communicate()
      pytest.fail(f'the process did not exit within {HANG_S}s while its lease delete hung '
                  f'(held {faulty_gcs.proxy.held()}); stderr tail: {err[-2000:]}')
  finally:
    if proc.poll() is None:
      proc.kill()
    faulty_gcs.proxy.release()
  assert proc.returncode == 0, err[-3000:]
  assert 'MAIN DONE' in out, out
  assert faulty_gcs.proxy.held(), 'the lease delete was never attempted'
  assert 'orbax-pathways-lease.json' in err and 'stale' in err, err[-3000:]
