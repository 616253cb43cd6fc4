"""Child processes of the tests: the one helper that starts a child and sets its environment.

Every Python program a test runs in a child process is a module in ``support/workers/`` (a
``main()`` and a docstring naming its test), or the package's CLI, an example, a tool. A test
starts one child through this module (on the host that runs pytest), N ``jax.distributed``
processes through ``mp_harness``, which builds on it: its workers get ``child_env`` too, plus
the harness's own variables (its job is the N-process run: one coordinator, fail-fast, every
process group killed; one child's run is this module's).

What every child gets (``child_env``), whoever starts it:

- ``JAX_PLATFORMS=cpu`` and ``devices`` virtual CPU devices (``XLA_FLAGS``; other flags kept;
  None: no device-count flag, one device), set before the child imports jax;
- ``PYTHONPATH`` = ``tests/`` + the repository root (+ the caller's), so that a worker imports
  ``support`` and the working tree's ``orbax_pathways``;
- ``NO_GCE_CHECK=true`` (google-auth and gcsfs never probe a metadata server);
- ``ORBAX_PATHWAYS_TIER_DIR=off``: the node-local tier off, as in the test process
  (``tests/conftest.py``), unless the caller asks for one (``extra`` sets it);
- then the caller's ``extra`` (which wins), minus the names in ``unset``.

A Python child is forked from a zygote that has imported jax, Orbax and tensorstore already
(``support/zygote.py``: about 2.3 CPU-s saved per child), unless it asks for a ``fresh``
interpreter (a test of what importing does).

Every run is bounded (``timeout``: killed past it) and fails the test with the tails of the
child's stdout and stderr when it exits non-zero (``check``) or runs past its time.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import types
from typing import Iterator, Mapping, Sequence

from support import REPO, TESTS
from support import zygote

_DEVICE_COUNT_FLAG = re.compile(r'--xla_force_host_platform_device_count=\S*')
TIER_ENV = 'ORBAX_PATHWAYS_TIER_DIR'


def child_env(extra: Mapping[str, object] | None = None, *, devices: int | None = 8,
              base: Mapping[str, str] | None = None, unset: Sequence[str] = ()) -> dict[str, str]:
  """``base`` (default ``os.environ``) for a child interpreter, as the module docstring says:
  CPU backend, ``devices`` virtual CPU devices (None: no device-count flag), ``PYTHONPATH``
  reaching ``support``, no metadata-server probe, the tier off; then ``extra`` (values turned
  into strings), which wins; then the names in ``unset`` removed. The child's modules are
  byte-compiled first (``byte_compile``)."""
  byte_compile()
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
  env['NO_GCE_CHECK'] = 'true'
  env[TIER_ENV] = 'off'
  env.update({k: str(v) for k, v in (extra or {}).items()})
  for name in unset:
    env.pop(name, None)
  return env


def _text(data) -> str:
  if isinstance(data, bytes):
    return data.decode('utf-8', errors='replace')
  return data or ''


def output_tails(stdout, stderr) -> str:
  """The last 3000 characters of a child's stdout and 6000 of its stderr, for a failure."""
  return (f'--- stdout tail ---\n{_text(stdout)[-3000:]}\n'
          f'--- stderr tail ---\n{_text(stderr)[-6000:]}')


def run(argv: Sequence[object], *, env: Mapping[str, object] | None = None,
        devices: int | None = 8, base: Mapping[str, str] | None = None,
        unset: Sequence[str] = (), timeout: float = 180, check: bool = True,
        cwd: object = REPO, input: str | None = None,
        fresh: bool = False) -> subprocess.CompletedProcess:
  """Runs ``argv`` with ``child_env(env, devices=..., base=..., unset=...)`` in ``cwd`` (the
  repository root), its output captured as text. Past ``timeout`` s the child is killed and
  the test fails with its output tails; so does a non-zero exit when ``check``. A Python child
  is forked from a zygote that imported jax, Orbax and tensorstore already
  (``support/zygote.py``) unless ``fresh``: a child whose test is about what importing does
  (the modules it loads, import order, logging set up at import) gets a new interpreter."""
  argv = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in argv]
  try:
    runner = subprocess.run if fresh else zygote.run
    proc = runner(argv, env=child_env(env, devices=devices, base=base, unset=unset),
                  cwd=os.fspath(cwd), capture_output=True, text=True, timeout=timeout,
                  input=input, check=False)
  except subprocess.TimeoutExpired as e:
    raise AssertionError(f'{argv} did not finish within {timeout} s (killed)\n'
                         f'{output_tails(e.stdout, e.stderr)}') from None
  if check and proc.returncode != 0:
    raise AssertionError(f'{argv} failed (exit {proc.returncode})\n'
                         f'{output_tails(proc.stdout, proc.stderr)}')
  return proc


def worker_name(worker: types.ModuleType | str) -> str:
  """The module name ``python -m`` runs for a worker (a module of ``support.workers``, or its
  name)."""
  name = worker if isinstance(worker, str) else worker.__name__
  if not name.startswith('support.workers.'):
    name = f'support.workers.{name}'
  return name


def worker_argv(worker: types.ModuleType | str, *args: object) -> list[str]:
  """``python -m support.workers.<worker> args...``."""
  return [sys.executable, '-m', worker_name(worker), *map(str, args)]


def run_worker(worker: types.ModuleType | str, *args: object,
               **kwargs) -> subprocess.CompletedProcess:
  """Runs a module of ``support/workers/`` with ``args`` in a child interpreter (``run``'s
  keywords: ``env``, ``devices``, ``timeout``, ``check``, ...)."""
  return run(worker_argv(worker, *args), **kwargs)


def worker_json(worker: types.ModuleType | str, *args: object, **kwargs):
  """``run_worker``; returns the JSON object the worker printed last."""
  return last_json(run_worker(worker, *args, **kwargs).stdout)


def run_cli(*args: object, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
  """``python -m orbax_pathways args...`` (the inspection CLI); the caller checks its exit code
  (``check=False``: the CLI answers with its exit code)."""
  return run([sys.executable, '-m', 'orbax_pathways', *args], check=check, **kwargs)


def start(argv: Sequence[object], *, env: Mapping[str, object] | None = None,
          devices: int | None = 8, unset: Sequence[str] = (), cwd: object = REPO,
          **popen) -> subprocess.Popen:
  """Starts ``argv`` with ``child_env(env, devices=..., unset=...)`` in ``cwd`` and returns its
  Popen (``popen``: Popen's pipes or files, ``text``); the caller kills and reaps it (a child
  that outlives one block: a test's job object). Within one block, ``started``."""
  return zygote.Popen([str(a) for a in argv],
                          env=child_env(env, devices=devices, unset=unset),
                          cwd=os.fspath(cwd), **popen)


@contextlib.contextmanager
def started(argv: Sequence[object], *, env: Mapping[str, object] | None = None,
            devices: int | None = 8, unset: Sequence[str] = (), cwd: object = REPO,
            **popen) -> Iterator[subprocess.Popen]:
  """A child that runs while the block talks to it (``popen``: Popen's pipes, ``text``), with
  ``child_env(env, devices=..., unset=...)``; killed and reaped at the end of the block, whatever
  happened (``start``)."""
  proc = start(argv, env=env, devices=devices, unset=unset, cwd=cwd, **popen)
  try:
    yield proc
  finally:
    proc.kill()
    proc.wait()


def last_json(stdout: str):
  """The JSON object printed last (lines starting with ``{``) by a child."""
  lines = [l for l in stdout.splitlines() if l.startswith('{')]
  assert lines, f'no JSON line in the output:\n{stdout[-3000:]}'
  return json.loads(lines[-1])


_compiled = False


def byte_compile() -> None:
  """Writes the byte-code of the package, the tests' support modules, the integration harness
  and the benchmarks (once per process), as ``pip install`` of a wheel does for an installed
  package. Where ``PYTHONDONTWRITEBYTECODE`` is set (CI's machines and this project's VMs set
  it) an editable install has none, so every child interpreter would compile every module it
  imports, about 0.2-0.3 CPU-s each, and a benchmark would charge that to the package's first
  save or restore in each process while Orbax's installed modules come compiled."""
  global _compiled
  if _compiled:
    return
  import compileall  # pylint: disable=import-outside-toplevel
  for sub in ('orbax_pathways', os.path.join('tests', 'support'), 'integration', 'benchmarks'):
    compileall.compile_dir(os.path.join(REPO, sub), quiet=2)
  _compiled = True


def _ephemeral_start() -> int:
  try:
    with open('/proc/sys/net/ipv4/ip_local_port_range') as f:
      return int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return 32768  # Linux's default


def free_port() -> int:
  """A TCP port free on 127.0.0.1 right now (whoever needs it binds it a moment later).

  Picked at random below the kernel's ephemeral range, not with ``bind(0)``: between this call
  and the bind, every outgoing connection of the suite (gloo, gRPC, HTTP to fake-gcs-server) takes
  a local port from the ephemeral range, and one of them taking this port made a coordinator's
  start fail ("Failed to start RPC server")."""
  top = _ephemeral_start()
  pick = random.SystemRandom()
  for _ in range(64):
    port = pick.randrange(max(1024, top - 12000), top)
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
      try:
        s.bind(('127.0.0.1', port))
      except OSError:
        continue
      return port
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
      self._proc = zygote.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
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
