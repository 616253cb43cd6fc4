"""A process whose writer lease cannot be released at exit still exits: the writer
lease thread and the package's other background threads do not keep a failed process alive at
exit.

Real Orbax CheckpointManager in a fresh interpreter, fake-gcs-server behind the project's fault
proxy, which holds every request deleting the lease object open (storage that accepts and never
answers). Before: the exit waited for the delete, through tensorstore's stall timeout and its
retries (all held), many minutes. Now: at most ``lease.EXIT_RELEASE_S`` per lease, and no longer
than the lease timeout (3 s here, so that the test waits 3 s rather than 10), a warning naming
the lease, exit status 0. No duration is asserted beyond a generous hang limit.
"""

from __future__ import annotations

from subprocess import PIPE, TimeoutExpired
from urllib.parse import unquote

import pytest

from support import procs
from support.workers import lease_exit_worker

from orbax_pathways.manager import lease

pytestmark = pytest.mark.gcs

HANG_S = 150  # far above EXIT_RELEASE_S plus the save; the bug waited through every retry
LEASE_TIMEOUT_S = 3  # the child's lease timeout, which bounds its wait for the held delete


def test_exit_with_a_lease_delete_that_never_answers(faulty_gcs):
  path = faulty_gcs.path('ckpt')
  try:
    with procs.started(procs.worker_argv(lease_exit_worker, path),
                       env={lease.TIMEOUT_ENV: LEASE_TIMEOUT_S}, stdin=PIPE, stdout=PIPE,
                       stderr=PIPE, text=True) as proc:
      assert proc.stdout.readline().strip() == 'SAVED', proc.stderr.read()[-3000:]
      faulty_gcs.proxy.hold(lambda method, target: method == 'DELETE'
                            and 'orbax-pathways-lease.json' in unquote(target), count=10_000)
      proc.stdin.write('\n')
      proc.stdin.flush()
      try:
        out, err = proc.communicate(timeout=HANG_S)
      except TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f'the process did not exit within {HANG_S}s while its lease delete hung '
                    f'(held {faulty_gcs.proxy.held()}); stderr tail: {err[-2000:]}')
  finally:
    faulty_gcs.proxy.release()  # after the child is gone (``started`` killed and reaped it)
  assert proc.returncode == 0, err[-3000:]
  assert 'MAIN DONE' in out, out
  assert faulty_gcs.proxy.held(), 'the lease delete was never attempted'
  assert 'orbax-pathways-lease.json' in err and 'stale' in err, err[-3000:]
