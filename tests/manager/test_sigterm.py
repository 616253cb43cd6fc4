"""SIGTERM stays able to stop every process.

Each case runs a real program in a fresh interpreter: multiprocessing pools and processes (fork
and spawn), ``timeout``, a loop that ignores the notice, a main thread stuck in native code, the
CLI stalled on an unresponsive storage server. A hang shows as the subprocess timeout; no test
asserts a duration.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import sys
import tempfile
import time
from subprocess import PIPE, CompletedProcess

import pytest

from support.gcs_server import hermetic_env
from support.procs import free_port, last_json, run, run_worker, started, worker_argv
from support.workers import native_sigterm_worker, sigterm_loop_worker, sigterm_where_worker
from support.workers import v1_sigterm_worker

PY = sys.executable
HANG = 180  # seconds after which a subprocess counts as hung (the bug made them run forever)
_OURS = ('ORBAX_PATHWAYS_NO_SIGTERM', 'ORBAX_PATHWAYS_SIGTERM_GRACE_S')


def _env(**extra) -> dict:
  """``procs.run`` / ``procs.started`` keywords: one CPU device (enough here), the caller's own
  SIGTERM settings (``_OURS``) dropped, then ``extra``."""
  return {'env': extra, 'devices': None, 'unset': [k for k in _OURS if k not in extra]}


# ----------------------------------------------------------------------------------------------
# Where the notice handler is installed.

def _run_together(*runs: tuple[list, dict]) -> list[CompletedProcess]:
  """Runs independent programs ((argv, ``_env`` keywords) each) at the same time: their
  results, in order."""
  with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
    return list(pool.map(lambda r: run(r[0], timeout=HANG, check=False, **r[1]), runs))


def test_import_and_cli_leave_sigterm_alone_manager_in_main_thread_takes_it(tmp_path):
  where = worker_argv(sigterm_where_worker)
  # Three independent programs (each its own directory), run at the same time.
  default, opted_out, cli = _run_together(
      (where + [str(tmp_path / 'default')], _env()),
      (where + [str(tmp_path / 'opted_out')], _env(ORBAX_PATHWAYS_NO_SIGTERM='yes')),
      # The CLI module imports the package but never makes SIGTERM a notice.
      ([PY, '-c', 'import signal, orbax_pathways.cli.main as m; '
        'print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)'], _env()))
  assert default.returncode == 0, default.stderr[-3000:]
  assert last_json(default.stdout) == {'after_import': 'default',
                                        'after_manager_off_main_thread': 'default',
                                        'after_manager': '_sigterm_handler'}
  assert opted_out.returncode == 0, opted_out.stderr[-3000:]
  assert last_json(opted_out.stdout)['after_manager'] == 'default'
  assert cli.stdout.strip() == 'True', cli.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# A native SIGTERM handler (JAX's preemption notifier after jax.distributed.initialize, or any
# other) is invisible to Python's signal.getsignal, which says SIG_DFL: a manager must not replace
# it. With JAX's, JAX's sync point then decides the preemption step.

@pytest.mark.parametrize('mode', ['jax', 'other'])
def test_a_native_sigterm_handler_is_not_replaced(tmp_path, mode):
  r = run_worker(native_sigterm_worker, mode, tmp_path / 'ckpt', free_port(), timeout=HANG,
                 check=False, **_env())
  assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
  result = last_json(r.stdout)
  assert result['python_sees_default'] and result['native_before'] and result['kept'], result
  if mode == 'jax':
    step = result['preempted_at']
    assert step >= 30
    periodic = {str(s) for s in range(0, step, 50)}
    assert sorted(os.listdir(tmp_path / 'ckpt')) == sorted(periodic | {str(step)}), r.stderr[-3000:]
  assert 'preemption notice received' not in r.stderr


# ----------------------------------------------------------------------------------------------
# multiprocessing: Pool.__exit__ / terminate() and Process.terminate() stop the children.

@pytest.mark.parametrize('method', ['fork', 'spawn'])
@pytest.mark.parametrize('case', ['pool_exception', 'pool_terminate', 'process_terminate'])
def test_multiprocessing_children_stop_on_sigterm(tmp_path, method, case):
  # By name: the worker imports orbax_pathways at its top (its spawn children re-import it).
  r = run_worker('mp_sigterm_worker', method, tmp_path, case, timeout=HANG, check=False,
                 **_env())
  assert r.returncode == 0, r.stderr[-3000:]
  result = last_json(r.stdout)
  if case == 'pool_exception':
    assert result == {'raised': 'boom in the pool block'}
  elif case == 'pool_terminate':
    assert result == {'terminated': True}
  else:
    assert result == {'exitcode': -signal.SIGTERM}


# ----------------------------------------------------------------------------------------------
# A training loop: one preemption save, normal intervals after it, then the default action.

def test_stray_notice_costs_one_save_then_the_grace_period_ends_the_process(tmp_path):
  r = run_worker(sigterm_loop_worker, tmp_path / 'ckpt', 'self', timeout=HANG, check=False,
                 **_env(ORBAX_PATHWAYS_SIGTERM_GRACE_S=6))
  assert r.returncode == -signal.SIGTERM, (r.returncode, r.stderr[-3000:])
  result = last_json(r.stdout)
  # Exactly one preemption save (21); steps 22-59 follow the interval; retention keeps the
  # rollback history [30, 40, 50] (the bug saved every step and kept [57, 58, 59]).
  assert result == {'saved': [0, 10, 20, 21, 30, 40, 50], 'kept': [30, 40, 50],
                    'preempted': [21]}
  assert 'preemption notice received (signal SIGTERM)' in r.stderr
  assert "applying SIGTERM's default action" in r.stderr
  # The log says why SIGTERM's default action applies: no "second SIGTERM" was ever sent.
  assert 'the preemption notice went unanswered for 6 s' in r.stderr, r.stderr[-3000:]
  assert 'a second SIGTERM' not in r.stderr
  # Killed by SIGTERM's default action, the job could not release its writer lease: the next
  # job takes it over (its owner is gone).
  assert sorted(os.listdir(tmp_path / 'ckpt')) == ['30', '40', '50', 'orbax-pathways-lease.json']


def test_second_sigterm_is_the_default_action(tmp_path):
  with started(worker_argv(sigterm_loop_worker, tmp_path / 'ckpt', 'idle'), stdout=PIPE,
               stderr=PIPE, text=True, **_env(ORBAX_PATHWAYS_SIGTERM_GRACE_S='inf')) as proc:
    for line in proc.stdout:
      if line.startswith('IDLE'):
        break
    proc.send_signal(signal.SIGTERM)  # a notice: the process lives on (grace is infinite)
    time.sleep(2)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG)
  assert proc.returncode == -signal.SIGTERM, err[-3000:]
  assert 'a second SIGTERM' in err


def test_timeout_stops_a_program_with_a_checkpoint_manager(tmp_path):
  # 30 s: the worker's start (jax, Orbax) under a loaded machine comes before its IDLE line.
  r = run(['timeout', '30', *worker_argv(sigterm_loop_worker, tmp_path / 'ckpt', 'idle')],
          timeout=HANG, check=False, **_env(ORBAX_PATHWAYS_SIGTERM_GRACE_S=2))
  assert r.returncode == 124, (r.returncode, r.stderr[-3000:])  # timeout's "it timed out"
  # coreutils' timeout signals the program and then its own process group, the program
  # included: the second SIGTERM, when it arrives after the first was handled, ends it at once.
  assert 'IDLE' in r.stdout and ("applying SIGTERM's default action" in r.stderr
                                 or 'a second SIGTERM' in r.stderr), r.stderr[-3000:]


def test_main_thread_stuck_in_native_code_is_still_terminated(tmp_path):
  r = run_worker(sigterm_loop_worker, tmp_path / 'ckpt', 'stuck', timeout=HANG, check=False,
                 **_env(ORBAX_PATHWAYS_SIGTERM_GRACE_S=1))
  assert r.returncode == -signal.SIGTERM, (r.returncode, r.stderr[-3000:])
  assert 'STUCK' in r.stdout
  assert 'the main thread did not handle SIGTERM' in r.stderr


# ----------------------------------------------------------------------------------------------
# v1 training.Checkpointer: the notice leads to a save where the save decision
# policy saves for preemption; with FixedIntervalPolicy alone SIGTERM keeps its default action.

@pytest.mark.parametrize('mode', ['fixed', 'with_preemption_policy'])
def test_v1_training_checkpointer_sigterm_saves_or_keeps_the_default_action(tmp_path, mode):
  with started(worker_argv(v1_sigterm_worker, tmp_path / 'ckpt', mode), stdout=PIPE,
               stderr=PIPE, text=True, **_env()) as proc:
    for line in proc.stdout:
      if line.startswith('READY'):
        break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=HANG)
  if mode == 'fixed':
    # Stock: FixedIntervalPolicy never saves for preemption, so SIGTERM ends the process at once;
    # no notice promising a save that never comes, no grace period.
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, err[-3000:])
    assert 'preemption notice' not in err and 'SIGTERM' not in err, err[-3000:]
    assert sorted(os.listdir(tmp_path / 'ckpt')) == ['0', '50', 'orbax-pathways-lease.json']  # killed: not released
  else:
    assert proc.returncode == 0, (proc.returncode, err[-3000:])
    result = last_json(out)
    step = result['preemption_save']
    assert step >= 60 and result['steps'] == [0, 50, step]
    assert 'preemption notice received (signal SIGTERM)' in err
    assert sorted(os.listdir(tmp_path / 'ckpt')) == ['0', '50', str(step)]


# ----------------------------------------------------------------------------------------------
# The CLI, stalled on a storage server that accepts connections and never answers.


def test_cli_stalled_on_storage_dies_on_sigterm_and_under_timeout(tmp_path):
  with socket.socket() as hole:
    hole.bind(('127.0.0.1', 0))
    hole.listen(64)  # accepts, never answers
    hole.settimeout(HANG)
    url = f'http://127.0.0.1:{hole.getsockname()[1]}'
    env = _env(**hermetic_env(url, tempfile.mkdtemp(prefix='gcloud-')))
    cmd = [PY, '-m', 'orbax_pathways', 'show', 'gs://bucket/ckpt', '--step', '1']
    with started(cmd, stdout=PIPE, stderr=PIPE, text=True, **env) as proc:
      conn, _ = hole.accept()  # the CLI reached storage
      with conn:
        conn.settimeout(HANG)
        assert conn.recv(1), 'the CLI connected but sent no request'
        time.sleep(1)  # its request is in flight and unanswered
        assert proc.poll() is None, proc.communicate()[1][-3000:]  # stalled, as intended
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG)
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    assert 'preemption notice' not in err
    r = run(['timeout', '5'] + cmd[:3] + ['verify', 'gs://bucket/ckpt/1'], timeout=HANG,
            check=False, **env)
    assert r.returncode == 124, (r.returncode, r.stderr[-3000:])
