"""SIGTERM in a multi-controller job running the README loop.

Real ``jax.distributed`` processes on 127.0.0.1 (CPU, gloo), each running the unchanged README
loop (``support/workers/readme_loop_worker.py``: ``mngr.save(step, ...)``; ``if
mngr.reached_preemption(step): exit_after_commit(mngr)``, ``save_interval_steps=50``). The test
sends SIGTERM to one process or to all of them, with JAX's preemption service on (the default:
its sync point decides) and off (our notice reaches every process through the coordination
service). Every process must save the same preemption step and exit 0, as stock Orbax does. The
bug: the manager replaced JAX's native SIGTERM notifier, so the sync point never heard the
signal, nothing was saved and the processes trained on until the grace period killed them. A
hang shows as the test's timeout; no test asserts a duration.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from subprocess import DEVNULL

import pytest

from support import mp_worker
from support.procs import free_port, started, worker_argv
from support.workers import readme_loop_worker

HANG = 240  # seconds after which a run counts as hung (the bug ran until the 120 s grace period)


def _progress(shared: str, i: int) -> int:
  try:
    with open(os.path.join(shared, f'progress_{i}')) as f:
      return int(f.read() or -1)
  except (OSError, ValueError):
    return -1


def _results(results_dir: str, i: int) -> list[dict]:
  import json  # pylint: disable=g-import-not-at-top
  path = os.path.join(results_dir, f'process_{i}.jsonl')
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _run_and_preempt(tmp_path, n: int, targets: str, service: bool):
  """Starts ``n`` workers running the README loop, SIGTERMs ``targets`` ('one': the last
  process, 'all': every process) once every process has passed step 60, and waits for all to
  exit. Returns (returncodes, emitted results, step at signal, stderr tails)."""
  ckpt = tmp_path / 'ckpt'
  work = tempfile.mkdtemp(prefix='preempt_mp_', dir=tmp_path)
  shared = os.path.join(work, 'shared')
  results_dir = os.path.join(work, 'results')
  os.makedirs(shared)
  os.makedirs(results_dir)
  coordinator = f'127.0.0.1:{free_port()}'
  procs, logs = [], []
  with contextlib.ExitStack() as stack:  # at its end, every worker is killed and reaped
    for i in range(n):
      env = {
          'JAX_CPU_COLLECTIVES_IMPLEMENTATION': 'gloo', 'PYTHONUNBUFFERED': '1',
          'JAX_ENABLE_PREEMPTION_SERVICE': 'true' if service else 'false',
          mp_worker.ENV_COORDINATOR: coordinator, mp_worker.ENV_NUM_PROCESSES: str(n),
          mp_worker.ENV_PROCESS_ID: str(i), mp_worker.ENV_DEVICES_PER_PROCESS: '2',
          mp_worker.ENV_RESULTS_DIR: results_dir, mp_worker.ENV_SHARED_DIR: shared,
          mp_worker.ENV_PARENT_PID: str(os.getpid()),
      }
      out, err = os.path.join(work, f'{i}.out'), os.path.join(work, f'{i}.err')
      logs.append(err)
      with open(out, 'wb') as o, open(err, 'wb') as e:
        procs.append(stack.enter_context(started(
            worker_argv(readme_loop_worker, ckpt), env=env, devices=2,
            unset=('ORBAX_PATHWAYS_NO_SIGTERM', 'ORBAX_PATHWAYS_SIGTERM_GRACE_S'),
            stdin=DEVNULL, stdout=o, stderr=e, start_new_session=True)))
    deadline = time.monotonic() + HANG
    while min(_progress(shared, i) for i in range(n)) < 60:
      assert time.monotonic() < deadline, 'the workers never reached step 60: ' + _tails(logs)
      assert all(p.poll() is None for p in procs), ([p.poll() for p in procs], _tails(logs))
      time.sleep(0.1)
    at_signal = max(_progress(shared, i) for i in range(n))
    for p in (procs if targets == 'all' else procs[-1:]):
      p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + HANG
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      time.sleep(0.1)
    codes = [p.poll() for p in procs]
  tails = [_tail(err) for err in logs]
  return codes, [_results(results_dir, i) for i in range(n)], at_signal, tails, ckpt


def _tail(path: str) -> str:
  with open(path, errors='replace') as f:
    return f.read()[-4000:]


def _tails(paths) -> str:
  return '\n'.join(f'--- process {i} ---\n{_tail(p)}' for i, p in enumerate(paths))


@pytest.mark.multiprocess
@pytest.mark.parametrize('service', [True, False], ids=['service_on', 'service_off'])
@pytest.mark.parametrize('targets,n', [('one', 2), ('all', 2), ('one', 3)])
def test_sigterm_saves_one_agreed_step_on_every_process_and_exits_zero(tmp_path, service,
                                                                       targets, n):
  codes, results, at_signal, tails, ckpt = _run_and_preempt(tmp_path, n, targets, service)
  detail = '\n'.join(f'--- process {i} (rc {c}) ---\n{t}' for i, (c, t) in
                     enumerate(zip(codes, tails)))
  assert codes == [0] * n, detail
  steps = [r[-1]['preempted_at'] if r else None for r in results]
  assert len(set(steps)) == 1 and steps[0] is not None, (steps, detail)
  step = steps[0]
  assert step >= at_signal, (step, at_signal)
  # On storage: the preemption step, committed, besides the periodic ones before it.
  on_disk = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  assert on_disk == sorted({s for s in range(0, step + 1, 50)} | {step}), (on_disk, detail)
  assert not [p.name for p in ckpt.iterdir() if 'tmp' in p.name]
  assert (ckpt / str(step) / '_CHECKPOINT_METADATA').exists()
