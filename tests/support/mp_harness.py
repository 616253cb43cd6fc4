"""Multi-process JAX test harness: N local ``jax.distributed`` processes on the CPU backend.

Usage (parent, e.g. inside a pytest test)::

    from support.mp_harness import run_processes
    from support.workers import fleet_worker
    results = run_processes(fleet_worker.__file__, num_processes=2, devices_per_process=4,
                            shared_dir=tmp_path, timeout=60)
    assert results[0].result == results[1].result

Worker scripts are modules of ``support/workers/``. The harness builds on ``support.procs`` (the
one helper that sets a child's environment) rather than merging with it: ``procs`` runs one
child and waits for it; this module's job is N processes of one ``jax.distributed`` job (a
coordinator port, fail-fast when one dies, every process group killed), which no single-child
call needs. Each worker is ``sys.executable <script> *args`` in its own process group
(session), with ``procs.child_env``'s environment:

* ``JAX_PLATFORMS=cpu``
* ``XLA_FLAGS=--xla_force_host_platform_device_count=<devices_per_process>`` (other flags
  already in ``XLA_FLAGS`` are kept; an existing device-count flag is replaced)
* ``PYTHONPATH`` = ``tests/`` + the repository root + the caller's PYTHONPATH, so a worker
  script anywhere does ``from support import mp_worker``
* ``NO_GCE_CHECK=true`` and ``ORBAX_PATHWAYS_TIER_DIR=off`` (the tier off unless ``env`` or
  ``per_process_env`` sets it)

plus the harness's own:

* ``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo`` (``mp_worker.init`` also does
  ``jax.config.update('jax_cpu_collectives_implementation', 'gloo')``)
* ``MP_*`` variables (coordinator ``127.0.0.1:<free port>``, N, id, results dir, shared dir)
  read by ``mp_worker.init()`` / ``emit()`` / ``shared_dir()``

The worker's stdout/stderr go to files (no pipe can fill up and block a worker). The parent
polls; when every worker has exited it returns one ``ProcessResult`` per process. If a worker
fails, the others get ``fail_fast_grace`` seconds to finish and are then killed (a dead peer
otherwise leaves them blocked in a barrier until jax's own timeouts). On timeout, on failure,
on KeyboardInterrupt, on any exception in the parent: every process group is SIGKILLed and
reaped, so no worker (or anything a worker spawned) outlives ``run_processes``. Workers also
set ``PR_SET_PDEATHSIG=SIGKILL`` when they import ``mp_worker`` (Linux), so they die if the
parent itself is SIGKILLed (a preexec_fn would do it earlier but is unsafe in a threaded parent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any, Mapping, Sequence

from support import REPO
from support import mp_worker as _w
from support.procs import child_env, free_port
from support import zygote


@dataclasses.dataclass
class ProcessResult:
  process_id: int
  returncode: int | None  # None: killed by the harness before it exited on its own
  results: list[Any]  # every object the worker emit()ted, in order
  stdout_tail: str
  stderr_tail: str
  duration_s: float

  @property
  def result(self) -> Any:
    """The last emitted object (None if the worker emitted nothing)."""
    return self.results[-1] if self.results else None

  @property
  def ok(self) -> bool:
    return self.returncode == 0


class MultiProcessError(RuntimeError):
  """A worker failed, or the run timed out. ``.results`` has every process's ProcessResult."""

  def __init__(self, message: str, results: list[ProcessResult]):
    self.results = results
    parts = [message]
    for r in results:
      parts.append(
          f'\n===== process {r.process_id}: returncode={r.returncode} '
          f'({r.duration_s:.1f}s), emitted {len(r.results)} result(s) ====='
      )
      if r.stdout_tail.strip():
        parts.append(f'--- stdout tail ---\n{r.stdout_tail.rstrip()}')
      parts.append(f'--- stderr tail ---\n{r.stderr_tail.rstrip()}')
    super().__init__('\n'.join(parts))


def _tail(path: str, max_chars: int) -> str:
  try:
    with open(path, 'rb') as f:
      f.seek(0, os.SEEK_END)
      size = f.tell()
      f.seek(max(0, size - max_chars))
      data = f.read()
  except OSError:
    return ''
  text = data.decode('utf-8', errors='replace')
  return ('...' + text) if size > max_chars else text


def _read_results(path: str) -> list[Any]:
  out = []
  try:
    with open(path, encoding='utf-8') as f:
      for line in f:
        line = line.strip()
        if line:
          try:
            out.append(json.loads(line))
          except json.JSONDecodeError:  # a torn last line from a killed worker
            pass
  except FileNotFoundError:
    pass
  return out


def _kill_group(proc: subprocess.Popen) -> None:
  # start_new_session=True made the worker a session/group leader: pgid == pid.
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(proc.pid, signal.SIGKILL)
  with contextlib.suppress(ProcessLookupError):
    proc.kill()


def worker_env(
    base: Mapping[str, str],
    extra: Mapping[str, str] | None,
    *,
    pid: int,
    num_processes: int,
    devices_per_process: int,
    coordinator: str,
    results_dir: str,
    shared_dir: str,
    init_timeout: float | None,
) -> dict[str, str]:
  """Process ``pid``'s environment, as the module docstring lists it (also for a caller that
  starts and signals the processes itself: ``integration/chaos.py``)."""
  env = child_env(base=base, devices=devices_per_process)
  env['JAX_CPU_COLLECTIVES_IMPLEMENTATION'] = 'gloo'
  env['PYTHONUNBUFFERED'] = '1'
  env[_w.ENV_COORDINATOR] = coordinator
  env[_w.ENV_NUM_PROCESSES] = str(num_processes)
  env[_w.ENV_PROCESS_ID] = str(pid)
  env[_w.ENV_DEVICES_PER_PROCESS] = str(devices_per_process)
  env[_w.ENV_RESULTS_DIR] = results_dir
  env[_w.ENV_PARENT_PID] = str(os.getpid())
  env[_w.ENV_SHARED_DIR] = shared_dir
  if init_timeout is not None:
    env[_w.ENV_INIT_TIMEOUT] = str(int(init_timeout))
  if extra:
    env.update({k: str(v) for k, v in extra.items()})
  return env


def run_processes(
    script_path_or_source: str | os.PathLike,
    num_processes: int,
    devices_per_process: int = 1,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    *,
    shared_dir: str | os.PathLike | None = None,
    per_process_args: Sequence[Sequence[str]] | None = None,
    per_process_env: Sequence[Mapping[str, str]] | None = None,
    check: bool = True,
    fail_fast_grace: float = 10.0,
    tail_chars: int = 6000,
    cwd: str | os.PathLike | None = None,
    init_timeout: float | None = None,
) -> list[ProcessResult]:
  """Runs ``num_processes`` jax.distributed CPU workers and returns their results.

  Args:
    script_path_or_source: path of a worker script (``support/workers/<name>.py``), or the
      worker's Python source (anything that is not an existing file path; it is dedented and
      written to a temp file). Every test's worker is a module of ``support/workers/``; source
      is for the benchmarks' own workers (``benchmarks/local_steps.py``).
    num_processes: N; worker i gets process_id i, process 0 hosts the coordinator.
    devices_per_process: forced host CPU devices per worker (global = N * this).
    args: argv for every worker (after the script path).
    env: extra environment for every worker (applied last, so it can override the harness's).
    timeout: wall-clock seconds for the whole run; then every worker is killed and
      MultiProcessError raised (regardless of ``check``).
    shared_dir: directory passed to every worker as ``mp_worker.shared_dir()``. Created if
      missing and left in place. Default: a fresh temp dir, deleted after the run.
    per_process_args / per_process_env: optional per-worker extra argv / env (length N).
    check: raise MultiProcessError if any worker exits non-zero. With check=False the results
      of failed workers are returned instead (a timeout still raises).
    fail_fast_grace: once a worker has failed, seconds the others get before being killed.
    tail_chars: how much of each worker's stdout/stderr to keep.
    cwd: worker working directory (default: the repository root).
    init_timeout: seconds for jax.distributed.initialize (default: jax's own, 300).

  Returns:
    ProcessResult per process, ordered by process id.
  """
  if num_processes < 1 or devices_per_process < 1:
    raise ValueError('num_processes and devices_per_process must be >= 1')
  for name, seq in (('per_process_args', per_process_args), ('per_process_env', per_process_env)):
    if seq is not None and len(seq) != num_processes:
      raise ValueError(f'{name} must have {num_processes} entries')

  workdir = tempfile.mkdtemp(prefix='mp_harness_')
  own_shared = shared_dir is None
  try:
    script = os.fspath(script_path_or_source)
    if not (len(script) < 4096 and '\n' not in script and os.path.isfile(script)):
      path = os.path.join(workdir, 'worker_script.py')
      with open(path, 'w', encoding='utf-8') as f:
        f.write(textwrap.dedent(script))
      script = path
    script = os.path.abspath(script)
    results_dir = os.path.join(workdir, 'results')
    os.makedirs(results_dir)
    shared = os.path.join(workdir, 'shared') if own_shared else os.fspath(shared_dir)
    os.makedirs(shared, exist_ok=True)
    coordinator = f'127.0.0.1:{free_port()}'

    procs: list[subprocess.Popen] = []
    logs: list[tuple[str, str]] = []
    start = time.monotonic()
    ended: dict[int, float] = {}
    killed: set[int] = set()
    try:
      for i in range(num_processes):
        wenv = worker_env(
            os.environ, env, pid=i, num_processes=num_processes,
            devices_per_process=devices_per_process, coordinator=coordinator,
            results_dir=results_dir, shared_dir=shared, init_timeout=init_timeout)
        if per_process_env is not None:
          wenv.update({k: str(v) for k, v in per_process_env[i].items()})
        argv = [sys.executable, script, *map(str, args)]
        if per_process_args is not None:
          argv += list(map(str, per_process_args[i]))
        out_path = os.path.join(workdir, f'process_{i}.stdout')
        err_path = os.path.join(workdir, f'process_{i}.stderr')
        logs.append((out_path, err_path))
        with open(out_path, 'wb') as out, open(err_path, 'wb') as err:
          procs.append(zygote.Popen(
              argv, env=wenv, cwd=os.fspath(cwd) if cwd else REPO,
              stdin=subprocess.DEVNULL, stdout=out, stderr=err,
              start_new_session=True))

      timed_out = False
      first_failure_at = None
      while True:
        now = time.monotonic()
        for i, p in enumerate(procs):
          if i not in ended and p.poll() is not None:
            ended[i] = now
            if p.returncode != 0 and first_failure_at is None:
              first_failure_at = now
        if len(ended) == len(procs):
          break
        if now - start > timeout:
          timed_out = True
          break
        if first_failure_at is not None and now - first_failure_at > fail_fast_grace:
          break
        time.sleep(0.05)
    finally:
      # Whatever happened: nothing survives. Also kills grandchildren left in a group by a
      # worker that has itself exited.
      for i, p in enumerate(procs):
        if p.poll() is None:
          killed.add(i)
        _kill_group(p)
      for i, p in enumerate(procs):
        with contextlib.suppress(subprocess.TimeoutExpired):
          p.wait(timeout=10)
        ended.setdefault(i, time.monotonic())

    results = []
    for i, p in enumerate(procs):
      results.append(ProcessResult(
          process_id=i,
          returncode=None if i in killed else p.returncode,
          results=_read_results(os.path.join(results_dir, f'process_{i}.jsonl')),
          stdout_tail=_tail(logs[i][0], tail_chars),
          stderr_tail=_tail(logs[i][1], tail_chars),
          duration_s=ended[i] - start,
      ))
    if timed_out:
      raise MultiProcessError(
          f'timed out after {timeout}s; killed processes {sorted(killed)}', results)
    failed = [r.process_id for r in results if not r.ok]
    if check and failed:
      raise MultiProcessError(
          f'{len(failed)}/{num_processes} process(es) failed: {failed} '
          f'(returncode None = killed after a peer failed)', results)
    return results
  finally:
    # Holds the script, logs, results and (when not given) the shared dir; a caller-supplied
    # shared_dir lives elsewhere and is left alone.
    shutil.rmtree(workdir, ignore_errors=True)
