"""Fresh interpreters for the tests (``python -c``), with the suite's environment.

The test process itself runs on 8 virtual CPU devices (``tests/conftest.py``); a child gets the
same environment plus ``PYTHONPATH`` = ``tests/`` + the repository root, so that it imports
``support`` modules and the working tree's ``orbax_pathways``. Used by tests on the host that runs
pytest; ``mp_harness`` builds its workers' environment with ``child_env`` too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Mapping

from support import REPO, TESTS

_DEVICE_COUNT_FLAG = re.compile(r'--xla_force_host_platform_device_count=\S*')


def child_env(extra: Mapping[str, object] | None = None, *, devices: int | None = 8,
              base: Mapping[str, str] | None = None) -> dict[str, str]:
  """``base`` (default ``os.environ``) for a child interpreter: CPU backend, ``devices`` virtual
  CPU devices (None: no device-count flag, one device), ``PYTHONPATH`` reaching ``support``;
  then ``extra`` (values turned into strings), which wins."""
  env = dict(os.environ if base is None else base)
  env['JAX_PLATFORMS'] = 'cpu'
  flags = _DEVICE_COUNT_FLAG.sub('', env.get('XLA_FLAGS', '')).strip()
  if devices is not None:
    flags = f'{flags} --xla_force_host_platform_device_count={devices}'.strip()
  if flags:
    env['XLA_FLAGS'] = flags
  else:
    env.pop('XLA_FLAGS', None)
  env['PYTHONPATH'] = os.pathsep.join(
      [TESTS, REPO] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
  env.update({k: str(v) for k, v in (extra or {}).items()})
  return env


def run_python(code: str, *, env: Mapping[str, object] | None = None, devices: int | None = 8,
               timeout: float = 180) -> subprocess.CompletedProcess:
  """Runs ``code`` (dedented) in a fresh interpreter in the repository root and fails with its
  output tails unless it exits 0."""
  proc = subprocess.run([sys.executable, '-c', textwrap.dedent(code)],
                        env=child_env(env, devices=devices), cwd=REPO, capture_output=True,
                        text=True, timeout=timeout)
  assert proc.returncode == 0, (f'subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n'
                                f'{proc.stderr[-6000:]}')
  return proc


def last_json(stdout: str):
  """The JSON object printed last (lines starting with ``{``) by a child."""
  lines = [l for l in stdout.splitlines() if l.startswith('{')]
  assert lines, f'no JSON line in the output:\n{stdout[-3000:]}'
  return json.loads(lines[-1])


def run_json(code: str, **kwargs):
  """``run_python(code, **kwargs)``; returns the JSON object the child printed last."""
  return last_json(run_python(code, **kwargs).stdout)


def free_port() -> int:
  """A TCP port free on 127.0.0.1 right now (whoever needs it binds it a moment later)."""
  with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class Background:
  """A program started now, its stdout and stderr going to files (no pipe can fill up while the
  test waits on something else); ``wait`` returns its CompletedProcess. Lets a module start
  independent long runs together and check each in its own test."""

  def __init__(self, argv, log_dir, *, env: Mapping[str, str] | None = None, cwd: str = REPO):
    os.makedirs(log_dir, exist_ok=True)
    self.argv = [str(a) for a in argv]
    self._out = os.path.join(log_dir, 'stdout')
    self._err = os.path.join(log_dir, 'stderr')
    with open(self._out, 'wb') as out, open(self._err, 'wb') as err:
      self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    env=None if env is None else dict(env), cwd=cwd)

  def wait(self, timeout: float) -> subprocess.CompletedProcess:
    """Waits for the exit (killing it after ``timeout`` s, then raising TimeoutExpired)."""
    try:
      self._proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.kill()
      raise
    with open(self._out, encoding='utf-8', errors='replace') as out, \
        open(self._err, encoding='utf-8', errors='replace') as err:
      return subprocess.CompletedProcess(self.argv, self._proc.returncode, out.read(), err.read())

  def kill(self) -> None:
    if self._proc.poll() is None:
      self._proc.kill()
      self._proc.wait()


def run_limited(fn, limit_s: float):
  """Runs ``fn`` in a daemon thread (a call that may hang); returns ``(thread, result)`` after at
  most ``limit_s``: ``thread.is_alive()`` means it hung; ``result`` holds ``value`` or ``error``
  and ``elapsed`` once it ended."""
  res: dict = {}

  def target():
    t = time.monotonic()
    try:
      res['value'] = fn()
    except BaseException as e:  # pylint: disable=broad-except  (reported by the caller)
      res['error'] = e
    finally:
      res['elapsed'] = time.monotonic() - t

  th = threading.Thread(target=target, daemon=True, name='run-limited')
  th.start()
  th.join(limit_s)
  return th, res
