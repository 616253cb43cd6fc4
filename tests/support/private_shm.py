"""Runs a worker (a module of ``support/workers/``) as root in a private mount namespace whose ``/dev/shm`` is a fresh tmpfs,
so a test can use the node-local tier's default directory (``/dev/shm/orbax-pathways-<uid>``)
and let a second uid (a forked child that calls ``os.setuid``) plant things there, with nothing
reaching the machine's real ``/dev/shm``. Where that cannot be done (not root, no ``unshare``,
a container that forbids mount namespaces), the test is skipped with the reason.

Used by ``tests/tier/test_tier_fsafe.py`` (another user's tier directory) and ``tests/tier/test_tier.py``
(the tier's default), with ``workers/tier_attack_worker.py`` and ``workers/default_tier_worker.py``.
The worker gets its parameters as JSON in ``sys.argv[1]`` and prints one JSON line starting with
``RESULT `` for the test to read. Started through ``procs.run`` (the suite's environment, the
time bound, the output on failure).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from typing import Any, Mapping

import pytest

from support import procs

SHM_SIZE = '256m'


def skip_unless_possible() -> None:
  """Skips the calling test (with the reason) unless a private /dev/shm can be mounted."""
  if os.geteuid() != 0:
    pytest.skip('needs root: a private mount namespace with its own /dev/shm, and a second uid')
  if shutil.which('unshare') is None:
    pytest.skip('needs unshare(1) for a private mount namespace')
  probe = procs.run(['unshare', '-m', '--propagation', 'private', 'sh', '-c',
                     'mount -t tmpfs -o size=1m tmpfs /dev/shm'], check=False, timeout=60)
  if probe.returncode:
    pytest.skip('cannot mount a tmpfs on /dev/shm in a private mount namespace here: '
                f'{probe.stderr.strip() or probe.returncode}')


def run(worker: types.ModuleType, params: dict[str, Any], *,
        env: Mapping[str, object] | None = None, timeout: float = 300) -> dict[str, Any]:
  """Runs ``worker`` with ``params`` in the private namespace, in a fresh interpreter with the
  suite's environment (``procs.child_env``) plus ``env``; returns the JSON it printed after
  ``RESULT `` (fails the test, with the output, if it failed, ran past ``timeout`` or printed
  none)."""
  skip_unless_possible()
  shell = (f'mount -t tmpfs -o size={SHM_SIZE},mode=1777 tmpfs /dev/shm && '
           'exec "$0" -m "$1" "$2"')
  r = procs.run(['unshare', '-m', '--propagation', 'private', 'sh', '-c', shell,
                 sys.executable, procs.worker_name(worker), json.dumps(params)],
                env=env, timeout=timeout, check=False)
  lines = [l for l in r.stdout.splitlines() if l.startswith('RESULT ')]
  if r.returncode or not lines:
    pytest.fail(f'the worker failed (exit {r.returncode})\n'
                f'{procs.output_tails(r.stdout, r.stderr)}')
  return json.loads(lines[-1][len('RESULT '):])
