"""Runs a Python script as root in a private mount namespace whose ``/dev/shm`` is a fresh tmpfs,
so a test can use the node-local tier's default directory (``/dev/shm/orbax-pathways-<uid>``)
and let a second uid (a forked child that calls ``os.setuid``) plant things there, with nothing
reaching the machine's real ``/dev/shm``. Where that cannot be done (not root, no ``unshare``,
a container that forbids mount namespaces), the test is skipped with the reason.

Used by ``tests/test_tier_fsafe.py`` (another user's tier directory) and ``tests/test_tier.py``
(the tier's default). The script gets its parameters as JSON in ``sys.argv[1]`` and prints one
JSON line starting with ``RESULT `` for the test to read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any, Mapping

import pytest

from support import REPO
from support import procs

SHM_SIZE = '256m'


def skip_unless_possible() -> None:
  """Skips the calling test (with the reason) unless a private /dev/shm can be mounted."""
  if os.geteuid() != 0:
    pytest.skip('needs root: a private mount namespace with its own /dev/shm, and a second uid')
  if shutil.which('unshare') is None:
    pytest.skip('needs unshare(1) for a private mount namespace')
  probe = subprocess.run(['unshare', '-m', '--propagation', 'private', 'sh', '-c',
                          'mount -t tmpfs -o size=1m tmpfs /dev/shm'],
                         capture_output=True, text=True, check=False)
  if probe.returncode:
    pytest.skip('cannot mount a tmpfs on /dev/shm in a private mount namespace here: '
                f'{probe.stderr.strip() or probe.returncode}')


def run(script: str, params: dict[str, Any], *, env: Mapping[str, object] | None = None,
        timeout: float = 300) -> dict[str, Any]:
  """Runs ``script`` (Python source) with ``params`` in the private namespace, in a fresh
  interpreter with the suite's environment (``procs.child_env``) plus ``env``; returns the
  JSON it printed after ``RESULT `` (fails the test, with the output, if it printed none)."""
  skip_unless_possible()
  shell = (f'mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm && '
           'exec "$0" -c "$1" "$2"')
  try:
    r = subprocess.run(['unshare', '-m', '--propagation', 'private', 'sh', '-c', shell,
                        sys.executable, textwrap.dedent(script), json.dumps(params)],
                       capture_output=True, text=True, timeout=timeout,
                       env=procs.child_env(env), cwd=REPO, check=False)
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b'').decode() if isinstance(e.stdout, bytes) else (e.stdout or '')
    err = (e.stderr or b'').decode() if isinstance(e.stderr, bytes) else (e.stderr or '')
    pytest.fail(f'the script did not finish within {timeout} s (blocked?)\n{out[-3000:]}\n'
                f'{err[-3000:]}')
  lines = [l for l in r.stdout.splitlines() if l.startswith('RESULT ')]
  if r.returncode or not lines:
    pytest.fail(f'the script failed (exit {r.returncode})\n{r.stdout[-4000:]}\n'
                f'{r.stderr[-6000:]}')
  return json.loads(lines[-1][len('RESULT '):])
