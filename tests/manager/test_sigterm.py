"""SIGTERM stays able to stop every process (issue 15, items 1 and 5).

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
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from support import REPO
from support.gcs_server import hermetic_env
from support.procs import child_env, free_port, last_json

PY = sys.executable
HANG = 180  # seconds after which a subprocess counts as hung (the bug made them run forever)


def _env(**extra) -> dict:
  env = child_env(devices=None)  # one CPU device is enough here
  for k in ('ORBAX_PATHWAYS_NO_SIGTERM', 'ORBAX_PATHWAYS_SIGTERM_GRACE_S'):
    env.pop(k, None)
  env.update({k: str(v) for k, v in extra.items()})
  return env


def _script(tmp_path, name: str, code: str) -> str:
  path = tmp_path / name
  path.write_text(textwrap.dedent(code))
  return str(path)


# ----------------------------------------------------------------------------------------------
# Where the notice handler is installed.

_WHERE = '''
    import json, signal, sys, threading
    import orbax_pathways
    import orbax.checkpoint as ocp
    def name(h):
      return {signal.SIG_DFL: 'default', signal.SIG_IGN: 'ignore', None: 'native'}.get(
          h, getattr(h, '__qualname__', str(h)))
    out = {'after_import': name(signal.getsignal(signal.SIGTERM))}
    t = threading.Thread(target=lambda: ocp.CheckpointManager(sys.argv[1] + '/thread').close())
    t.start(); t.join()
    out['after_manager_off_main_thread'] = name(signal.getsignal(signal.SIGTERM))
    ocp.CheckpointManager(sys.argv[1] + '/main').close()
    out['after_manager'] = name(signal.getsignal(signal.SIGTERM))
    print(json.dumps(out))
'''


def _run_together(*runs: tuple[list, dict]) -> list[subprocess.CompletedProcess]:
  """Runs independent programs ((argv, env) each) at the same time: their results, in order."""
  with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
    return list(pool.map(lambda run: subprocess.run(run[0], capture_output=True, text=True,
                                                    env=run[1], timeout=HANG, cwd=REPO), runs))


def test_import_and_cli_leave_sigterm_alone_manager_in_main_thread_takes_it(tmp_path):
  where = [PY, _script(tmp_path, 'where.py', _WHERE)]
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
# it (issue 21, item 0). With JAX's, JAX's sync point then decides the preemption step.

_NATIVE = '''
    import ctypes, json, os, signal, sys, time
    import orbax_pathways
    import orbax.checkpoint as ocp
    from orbax_pathways import preemption
    mode, directory = sys.argv[1], sys.argv[2]

    def kernel_disposition():  # sigaction(SIGTERM, NULL, &old): the handler is its first field
      old = ctypes.create_string_buffer(512)
      assert ctypes.CDLL(None).sigaction(int(signal.SIGTERM), None, old) == 0
      return ctypes.c_void_p.from_buffer(old).value or 0

    if mode == 'jax':
      import jax
      jax.distributed.initialize('127.0.0.1:' + sys.argv[3], num_processes=1, process_id=0)
    else:
      libc = ctypes.CDLL(None)
      libc.signal.restype = ctypes.c_void_p
      libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
      # A harmless native handler, installed behind Python's back.
      libc.signal(int(signal.SIGTERM), ctypes.cast(libc.getpid, ctypes.c_void_p))
    before = kernel_disposition()
    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        save_interval_steps=50))
    out = {'python_sees_default': signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
           'native_before': before not in (0, 1),
           'kept': kernel_disposition() == before}
    print(json.dumps(out), flush=True)
    if mode == 'jax':  # the README loop: SIGTERM reaches JAX's notifier, its sync point decides
      import jax.numpy as jnp
      for step in range(10**6):
        if step == 30:
          os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        mngr.save(step, args=ocp.args.StandardSave({'w': jnp.full(8, step)}))
        if mngr.reached_preemption(step):
          print(json.dumps(dict(out, preempted_at=step)), flush=True)
          preemption.exit_after_commit(mngr)
'''


@pytest.mark.parametrize('mode', ['jax', 'other'])
def test_a_native_sigterm_handler_is_not_replaced(tmp_path, mode):
  script = _script(tmp_path, 'native.py', _NATIVE)
  r = subprocess.run([PY, script, mode, str(tmp_path / 'ckpt'), str(free_port())],
                     capture_output=True, text=True, env=_env(), timeout=HANG, cwd=REPO)
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

_MP = '''
    import json, multiprocessing as mp, os, signal, sys, time
    import orbax_pathways
    import orbax.checkpoint as ocp

    def child_manager(directory):
      # A child that builds its own manager: still not a training loop's main process.
      ocp.CheckpointManager(os.path.join(directory, f'c{os.getpid()}')).close()
      return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

    def sleeper(directory, ready):
      child_manager(directory)
      ready.set()
      time.sleep(600)

    def work(x):
      time.sleep(600)

    if __name__ == '__main__':
      method, directory, case = sys.argv[1], sys.argv[2], sys.argv[3]
      mp.set_start_method(method)
      # The parent is a training job: its manager makes SIGTERM a notice here.
      mngr = ocp.CheckpointManager(os.path.join(directory, 'parent'))
      assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
      if case == 'pool_exception':
        try:
          with mp.Pool(2) as pool:
            assert all(pool.map(child_manager, [directory] * 2))
            pool.map_async(work, range(2))
            time.sleep(1)
            raise RuntimeError('boom in the pool block')
        except RuntimeError as e:
          print(json.dumps({'raised': str(e)}), flush=True)
      elif case == 'pool_terminate':
        pool = mp.Pool(2)
        pool.map_async(work, range(2))
        time.sleep(1)
        pool.terminate()
        pool.join()
        print(json.dumps({'terminated': True}), flush=True)
      else:
        ready = mp.Event()
        p = mp.Process(target=sleeper, args=(directory, ready))
        p.start()
        assert ready.wait(120)
        p.terminate()
        p.join(120)
        print(json.dumps({'exitcode': p.exitcode}), flush=True)
'''


@pytest.mark.parametrize('method', ['fork', 'spawn'])
@pytest.mark.parametrize('case', ['pool_exception', 'pool_terminate', 'process_terminate'])
def test_multiprocessing_children_stop_on_sigterm(tmp_path, method, case):
  script = _script(tmp_path, 'mp_case.py', _MP)
  r = subprocess.run([PY, script, method, str(tmp_path), case], capture_output=True, text=True,
                     env=_env(), timeout=HANG, cwd=REPO)
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

_LOOP = '''
    import json, os, sys, time
    import jax.numpy as jnp
    import orbax_pathways
    import orbax.checkpoint as ocp
    directory, mode = sys.argv[1], sys.argv[2]
    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        save_interval_steps=10, max_to_keep=3))
    saved, preempted = [], []
    print('READY', flush=True)
    for step in range(60 if mode == 'self' else 1):
      if mode == 'self' and step == 21:
        os.kill(os.getpid(), 15)  # a stray notice; this loop does not stop for it
        time.sleep(0.1)
      if mngr.save(step, args=ocp.args.StandardSave({'w': jnp.full(8, step)})):
        saved.append(step)
      if mngr.reached_preemption(step):
        preempted.append(step)
    mngr.wait_until_finished()
    print(json.dumps({'saved': saved, 'kept': mngr.all_steps(), 'preempted': preempted}),
          flush=True)
    if mode == 'stuck':
      import ctypes, signal
      os.kill(os.getpid(), 15)
      time.sleep(0.2)  # the handler runs (notice, grace clock) in the main thread
      # Then the main thread blocks in native code that SIGTERM does not interrupt (as in a hung
      # collective): it cannot run Python signal handlers any more.
      signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
      print('STUCK', flush=True)
      ctypes.CDLL(None).sleep(600)
    print('IDLE', flush=True)
    while True:  # never acts on the notice: SIGTERM's default action must end this
      time.sleep(0.05)
'''


def test_stray_notice_costs_one_save_then_the_grace_period_ends_the_process(tmp_path):
  script = _script(tmp_path, 'loop.py', _LOOP)
  r = subprocess.run([PY, script, str(tmp_path / 'ckpt'), 'self'], capture_output=True,
                     text=True, env=_env(ORBAX_PATHWAYS_SIGTERM_GRACE_S=6), timeout=HANG,
                     cwd=REPO)
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
  script = _script(tmp_path, 'loop.py', _LOOP)
  proc = subprocess.Popen([PY, script, str(tmp_path / 'ckpt'), 'idle'], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=REPO,
                          env=_env(ORBAX_PATHWAYS_SIGTERM_GRACE_S='inf'))
  try:
    for line in proc.stdout:
      if line.startswith('IDLE'):
        break
    proc.send_signal(signal.SIGTERM)  # a notice: the process lives on (grace is infinite)
    time.sleep(2)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG)
  finally:
    proc.kill()
    proc.wait()
  assert proc.returncode == -signal.SIGTERM, err[-3000:]
  assert 'a second SIGTERM' in err


def test_timeout_stops_a_program_with_a_checkpoint_manager(tmp_path):
  script = _script(tmp_path, 'loop.py', _LOOP)
  r = subprocess.run(['timeout', '12', PY, script, str(tmp_path / 'ckpt'), 'idle'],
                     capture_output=True, text=True, timeout=HANG, cwd=REPO,
                     env=_env(ORBAX_PATHWAYS_SIGTERM_GRACE_S=2))
  assert r.returncode == 124, (r.returncode, r.stderr[-3000:])  # timeout's "it timed out"
  assert 'IDLE' in r.stdout and "applying SIGTERM's default action" in r.stderr


def test_main_thread_stuck_in_native_code_is_still_terminated(tmp_path):
  script = _script(tmp_path, 'loop.py', _LOOP)
  r = subprocess.run([PY, script, str(tmp_path / 'ckpt'), 'stuck'], capture_output=True,
                     text=True, timeout=HANG, cwd=REPO, env=_env(ORBAX_PATHWAYS_SIGTERM_GRACE_S=1))
  assert r.returncode == -signal.SIGTERM, (r.returncode, r.stderr[-3000:])
  assert 'STUCK' in r.stdout
  assert 'the main thread did not handle SIGTERM' in r.stderr


# ----------------------------------------------------------------------------------------------
# v1 training.Checkpointer (issue 21, item 6): the notice leads to a save where the save decision
# policy saves for preemption; with FixedIntervalPolicy alone SIGTERM keeps its default action.

_V1 = '''
    import json, sys, time
    import jax.numpy as jnp
    import orbax_pathways
    import orbax.checkpoint as ocp
    v1 = ocp.v1
    directory, mode = sys.argv[1], sys.argv[2]
    p = v1.training.save_decision_policies
    policy = (p.FixedIntervalPolicy(50) if mode == 'fixed' else
              p.AnySavePolicy([p.FixedIntervalPolicy(50), p.PreemptionCheckpointingPolicy()]))
    ckpt = v1.training.Checkpointer(directory, save_decision_policy=policy)
    for step in range(10**6):
      time.sleep(0.01)  # the training step
      if step == 60:
        print('READY', flush=True)
      if ckpt.should_save(step):
        ckpt.save(step, {'w': jnp.full(8, step)})
        if step % 50:  # not an interval step: the preemption save
          ckpt.wait()
          print(json.dumps({'preemption_save': step, 'steps': [c.step for c in ckpt.checkpoints]}),
                flush=True)
          ckpt.close()
          sys.exit(0)
'''


@pytest.mark.parametrize('mode', ['fixed', 'with_preemption_policy'])
def test_v1_training_checkpointer_sigterm_saves_or_keeps_the_default_action(tmp_path, mode):
  script = _script(tmp_path, 'v1_loop.py', _V1)
  proc = subprocess.Popen([PY, script, str(tmp_path / 'ckpt'), mode], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env())
  try:
    for line in proc.stdout:
      if line.startswith('READY'):
        break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=HANG)
  finally:
    proc.kill()
    proc.wait()
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
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
    try:
      conn, _ = hole.accept()  # the CLI reached storage
      with conn:
        conn.settimeout(HANG)
        assert conn.recv(1), 'the CLI connected but sent no request'
        time.sleep(1)  # its request is in flight and unanswered
        assert proc.poll() is None, proc.communicate()[1][-3000:]  # stalled, as intended
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG)
    finally:
      proc.kill()
      proc.wait()
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    assert 'preemption notice' not in err
    r = subprocess.run(['timeout', '5'] + cmd[:3] + ['verify', 'gs://bucket/ckpt/1'],
                       capture_output=True, text=True, env=env, timeout=HANG, cwd=REPO)
    assert r.returncode == 124, (r.returncode, r.stderr[-3000:])
