"""Preemption notice, save-at-notice through unchanged CheckpointManager code, and resume()."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from subprocess import PIPE

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from orbax_pathways._compat import orbax_policies
from orbax_pathways import preemption
from orbax_pathways.manager import retention
from support import damage
from support.mp_harness import run_processes
from support.procs import free_port, run_worker, started, worker_argv
from support.workers import kv_agreement_worker, mp_resume_worker, preemption_loop_worker


@pytest.fixture
def installed():
  preemption.clear_notice()
  preemption.install()
  yield
  preemption.uninstall()
  preemption.clear_notice()


def test_notice_makes_should_save_and_reached_preemption_true(tmp_path, installed):
  mngr = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(
      save_interval_steps=100))
  mngr.save(0, args=ocp.args.StandardSave({'a': jax.numpy.ones(4)}))
  mngr.wait_until_finished()
  assert not mngr.should_save(7) and not mngr.reached_preemption(7)
  preemption.notify_preemption('test')
  assert preemption.preemption_noticed()
  # Step 7 was already answered (False) before the notice: latched, so the loop's own
  # reached_preemption(7) after save(7) cannot claim a save that did not happen.
  assert not mngr.reached_preemption(7)
  assert mngr.should_save(8) and mngr.reached_preemption(8)
  assert mngr.save(8, args=ocp.args.StandardSave({'a': jax.numpy.ones(4)}))
  assert mngr.reached_preemption(8)
  mngr.wait_until_finished()
  assert mngr.all_steps() == [0, 8]
  assert not mngr.should_save(8)  # never re-saves an existing step
  # One preemption save per notice: later steps follow the save interval again.
  assert not mngr.should_save(9) and not mngr.reached_preemption(9)
  assert preemption.preemption_noticed() and not preemption.preemption_pending()
  preemption.notify_preemption('again')  # ignored until clear_notice(): no save storm
  assert not mngr.should_save(10)
  preemption.clear_notice()
  assert not mngr.should_save(10)
  preemption.notify_preemption('a new notice')
  assert mngr.should_save(11) and mngr.reached_preemption(11)
  preemption.clear_notice()
  # Stock behaviour once uninstalled, even with a notice.
  preemption.uninstall()
  preemption.notify_preemption('test')
  assert not mngr.should_save(12) and not mngr.reached_preemption(12)
  mngr.close()


def test_a_new_run_in_the_same_process_saves_on_the_notice_at_a_step_an_old_run_answered(
    tmp_path, installed):
  """A single controller latches its answer per step and per manager: a second manager of the
  process (a new run in a notebook, an evaluator's loop) gets fresh answers, not the first's."""
  state = {'a': jax.numpy.ones(4)}
  with ocp.CheckpointManager(tmp_path / 'first', options=ocp.CheckpointManagerOptions(
      save_interval_steps=100)) as first:
    for step in range(20):
      if first.should_save(step):
        first.save(step, args=ocp.args.StandardSave(state))
    assert first.all_steps() == [0]
  with ocp.CheckpointManager(tmp_path / 'second', options=ocp.CheckpointManagerOptions(
      save_interval_steps=100)) as second:
    for step in range(14):
      if step == 13:
        preemption.notify_preemption('test')
      if second.should_save(step):
        second.save(step, args=ocp.args.StandardSave(state))
    second.wait_until_finished()
    assert second.all_steps() == [0, 13]
    assert second.reached_preemption(13)


def test_sigterm_handler_chains_and_restores(tmp_path, installed, monkeypatch):
  preemption.uninstall()
  monkeypatch.setattr(preemption.notice._s, 'manager_seen', False)  # as in a fresh process
  calls = []
  previous = lambda signum, frame: calls.append(signum)
  old = signal.signal(signal.SIGTERM, previous)
  try:
    preemption.install()
    # Not at install (import): only once this main process constructs a CheckpointManager.
    assert signal.getsignal(signal.SIGTERM) is previous
    ocp.CheckpointManager(tmp_path).close()
    assert signal.getsignal(signal.SIGTERM) is preemption.notice._sigterm_handler
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    assert preemption.preemption_noticed()
    assert calls == [signal.SIGTERM]
    assert 'SIGTERM' in preemption.notice_info()['reason']
    preemption.uninstall()
    assert signal.getsignal(signal.SIGTERM) is previous
    # Re-installed at once when a manager already exists in this process.
    preemption.install()
    assert signal.getsignal(signal.SIGTERM) is preemption.notice._sigterm_handler
    preemption.uninstall()
    assert signal.getsignal(signal.SIGTERM) is previous
  finally:
    signal.signal(signal.SIGTERM, old)
    preemption.clear_notice()


def test_sigterm_ignored_or_no_sigterm_env_left_alone(tmp_path, installed, monkeypatch):
  preemption.uninstall()
  old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
  try:
    preemption.install()
    ocp.CheckpointManager(tmp_path).close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # someone chose to ignore it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    monkeypatch.setenv('ORBAX_PATHWAYS_NO_SIGTERM', 'True')  # the usual spellings, not only 1
    preemption.install()
    ocp.CheckpointManager(tmp_path).close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    monkeypatch.setenv('ORBAX_PATHWAYS_NO_SIGTERM', 'sure')
    with pytest.raises(ValueError, match=r"ORBAX_PATHWAYS_NO_SIGTERM='sure' is not a boolean"):
      preemption.install()
  finally:
    preemption.uninstall()
    signal.signal(signal.SIGTERM, old)


def test_which_save_decision_policies_make_sigterm_a_notice(tmp_path):
  """SIGTERM becomes a notice only for a manager whose policy can save for it."""
  p = ocp.v1.training.save_decision_policies

  class Custom:  # a policy Orbax does not define may read context.reached_preemption
    def should_save(self, step, previous_steps, *, context):
      return context.reached_preemption

  cases = {
      'default': (None, True),
      'fixed': (p.FixedIntervalPolicy(5), False),
      'fixed+specific': (p.AnySavePolicy([p.FixedIntervalPolicy(5),
                                          p.SpecificStepsPolicy([3])]), False),
      'fixed+preemption': (p.AnySavePolicy([p.FixedIntervalPolicy(5),
                                            p.PreemptionCheckpointingPolicy()]), True),
      'nested': (p.AnySavePolicy([p.AnySavePolicy([p.PreemptionCheckpointingPolicy()])]), True),
      'custom': (Custom(), True),
  }
  for name, (policy, expected) in cases.items():
    mngr = ocp.CheckpointManager(tmp_path / name, options=ocp.CheckpointManagerOptions(
        save_decision_policy=policy))
    assert orbax_policies.manager_saves_on_preemption(mngr) is expected, name
    mngr.close()
  # should_save_fn: Orbax adds PreemptionCheckpointingPolicy to it.
  mngr = ocp.CheckpointManager(tmp_path / 'fn', options=ocp.CheckpointManagerOptions(
      should_save_fn=lambda step, last: step % 7 == 0))
  assert orbax_policies.manager_saves_on_preemption(mngr)
  mngr.close()


def test_handler_not_installed_off_main_thread():
  import threading
  preemption.uninstall()
  result = []
  t = threading.Thread(target=lambda: result.append(preemption.install_notice_handler()))
  t.start()
  t.join()
  assert result == [False]
  assert signal.getsignal(signal.SIGTERM) is not preemption.notice._sigterm_handler


def test_resume_without_checkpoint_calls_init(tmp_path, installed):
  mngr = ocp.CheckpointManager(tmp_path)
  step, state = preemption.resume(mngr, lambda: {'a': 1})
  assert step is None and state == {'a': 1}


def _age(path, seconds):
  """Backdates ``path`` and everything under it by ``seconds``."""
  t = time.time() - seconds
  for root, dirs, files in os.walk(path):
    for name in dirs + files:
      os.utime(os.path.join(root, name), (t, t))
  os.utime(path, (t, t))


def test_resume_skips_incomplete_and_cleans_only_abandoned_leftovers(tmp_path, installed):
  retention.install()
  try:
    mngr = ocp.CheckpointManager(tmp_path)
    for s in (1, 2):
      mngr.save(s, args=ocp.args.StandardSave({'a': jax.numpy.full(4, float(s))}))
    mngr.wait_until_finished()
    mngr.close()
    # A torn step 3 (final name, no markers); leftovers of deletes and saves, abandoned (old) or
    # maybe still in progress in another process (fresh).
    os.makedirs(tmp_path / '3' / 'default')
    for name in ('0' + retention.DELETING_MARKER + 'abc', '7.orbax-checkpoint-tmp'):
      os.makedirs(tmp_path / name / 'default')
      _age(tmp_path / name, 2 * 3600)
    os.makedirs(tmp_path / ('5' + retention.DELETING_MARKER + 'def') / 'default')
    os.makedirs(tmp_path / '4.orbax-checkpoint-tmp' / 'default')
    retention.uninstall()  # resume applies the completeness rule by itself
    mngr = ocp.CheckpointManager(tmp_path)
    step, state = preemption.resume(mngr, lambda: None)
    assert step == 2
    np.testing.assert_array_equal(np.asarray(state['a']), np.full(4, 2.0))
    # 3 kept: may be legacy. The fresh leftovers may belong to a live process: kept.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        '1', '2', '3', '4.orbax-checkpoint-tmp', '5' + retention.DELETING_MARKER + 'def']
  finally:
    retention.uninstall()


# ----------------------------------------------------------------------------------------------
# resume() falls back past a damaged latest step instead of crash-looping.


def _w(step):
  return np.arange(4096, dtype=np.float32) + np.float32(1000 * step)


def _abstract_w():
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return {'w': jax.ShapeDtypeStruct((4096,), np.float32, sharding=sharding)}


def _saved_steps(directory, steps):
  with ocp.CheckpointManager(directory) as mngr:
    for s in steps:
      mngr.save(s, args=ocp.args.StandardSave({'w': jax.numpy.asarray(_w(s))}))
    mngr.wait_until_finished()


def _flip_byte(step_dir, step):
  """Flips one byte of the stored (uncompressed float) bytes of ``w`` at ``step``."""
  damage.flip_bit_in(sorted(step_dir.rglob('d/*')), _w(step).tobytes()[:64],
                     what=f'w under {step_dir}')


def test_resume_falls_back_past_a_damaged_step_and_training_replaces_it(tmp_path, installed):
  _saved_steps(tmp_path, [1, 2, 3])
  _flip_byte(tmp_path / '3', 3)
  mngr = ocp.CheckpointManager(tmp_path)
  with pytest.warns(RuntimeWarning, match=r'step 3 at \S*/3 is DAMAGED and was skipped '
                                          r'\(ChecksumMismatchError: .*Resuming from step 2'):
    step, state = preemption.resume(mngr, lambda: None, abstract_state=_abstract_w())
  assert step == 2 and np.asarray(state['w']).tobytes() == _w(2).tobytes()
  # The damaged step stays on storage but this manager saves as if it were absent: the next
  # steps are saved, and saving step 3 again replaces the damaged bytes.
  assert mngr.latest_step() == 2 and (tmp_path / '3').exists()
  assert mngr.should_save(3)
  mngr.save(3, args=ocp.args.StandardSave({'w': jax.numpy.asarray(_w(3))}))
  mngr.wait_until_finished()
  fresh = ocp.CheckpointManager(tmp_path)
  got = fresh.restore(3, args=ocp.args.StandardRestore(_abstract_w()))
  assert np.asarray(got['w']).tobytes() == _w(3).tobytes()


def test_resume_without_fallback_raises(tmp_path, installed):
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  _saved_steps(tmp_path, [1, 2])
  _flip_byte(tmp_path / '2', 2)
  with pytest.raises(orbax_pathways.ChecksumMismatchError, match=r'/2/default/w'):
    preemption.resume(ocp.CheckpointManager(tmp_path), lambda: None,
                      abstract_state=_abstract_w(), fallback=False)


def test_resume_with_every_step_damaged_raises_naming_them(tmp_path, installed):
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  _saved_steps(tmp_path, [1, 2])
  _flip_byte(tmp_path / '1', 1)
  _flip_byte(tmp_path / '2', 2)
  with pytest.raises(orbax_pathways.RestoreError,
                     match=r'no complete step in \S+ restores: step 2 \(\S+/2\): '
                           r'ChecksumMismatchError: .*; step 1 \(\S+/1\): ChecksumMismatchError'):
    preemption.resume(ocp.CheckpointManager(tmp_path), lambda: 'never from scratch',
                      abstract_state=_abstract_w())


def test_resume_falls_back_past_a_missing_file(tmp_path, installed):
  _saved_steps(tmp_path, [1, 2])
  for path in (tmp_path / '2').rglob('d/*'):
    path.unlink()  # every data file of step 2 gone
  with pytest.warns(RuntimeWarning, match=r'step 2 at \S*/2 is DAMAGED'):
    step, state = preemption.resume(ocp.CheckpointManager(tmp_path), lambda: None,
                                    abstract_state=_abstract_w())
  assert step == 1 and np.asarray(state['w']).tobytes() == _w(1).tobytes()


def test_resume_with_a_wrong_target_raises_the_latest_steps_error(tmp_path, installed):
  """A request every step rejects is not damage: no fallback through the whole history."""
  import warnings  # pylint: disable=g-import-not-at-top
  _saved_steps(tmp_path, [1, 2, 3])
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  wrong = {'w': jax.ShapeDtypeStruct((17,), np.float32, sharding=sharding)}
  with warnings.catch_warnings():
    warnings.simplefilter('error', RuntimeWarning)  # and no DAMAGED warning
    with pytest.raises(Exception, match=r'/3/') as info:
      preemption.resume(ocp.CheckpointManager(tmp_path), lambda: None, abstract_state=wrong)
  assert 'shape' in str(info.value)


# ----------------------------------------------------------------------------------------------
# SIGTERM against a real training loop in a subprocess (8 CPU devices), then resume elsewhere.

def test_sigterm_saves_at_notice_commits_and_exits_zero_then_resumes(tmp_path):
  ckpt = tmp_path / 'ckpt'
  with started(worker_argv(preemption_loop_worker, ckpt, 'train'), stdout=PIPE, stderr=PIPE,
               text=True) as proc:
    lines = []
    deadline = time.time() + 120
    while time.time() < deadline:
      line = proc.stdout.readline()
      if not line:
        break
      lines.append(line.strip())
      if line.startswith('STEP 250'):
        proc.send_signal(signal.SIGTERM)
        break
    out, err = proc.communicate(timeout=120)
  lines += out.split('\n')
  assert proc.returncode == 0, (proc.returncode, err[-3000:])
  (pre,) = [l for l in lines if l.startswith('PREEMPTED_AT')]
  notice_step, latest = int(pre.split()[1]), int(pre.split()[2])
  # save(250) ran before the notice, so the first preemption step is a later one, and it is saved.
  assert notice_step > 250 and notice_step == latest
  # Committed on disk, listed by a fresh manager (with the strict rule), not a save-interval step.
  assert (ckpt / str(notice_step) / 'commit_success.txt').exists()
  retention.install()
  try:
    assert ocp.CheckpointManager(ckpt).latest_step() == notice_step
  finally:
    retention.uninstall()
  saved = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  assert saved == [100, 200, notice_step]

  r = run_worker(preemption_loop_worker, ckpt, 'resume', timeout=120, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  resumed = [l.split() for l in r.stdout.splitlines() if l.startswith('RESUMED')]
  assert resumed == [['RESUMED', str(notice_step), 'True', 'True']] * 2, r.stdout


# ----------------------------------------------------------------------------------------------
# Multi-controller agreement through the coordination service KV store (service disabled).

def test_multi_controller_kv_agreement(tmp_path):
  port = str(free_port())
  results = []
  with contextlib.ExitStack() as stack:
    procs = [stack.enter_context(started(worker_argv(kv_agreement_worker, i, port), stdout=PIPE,
                                         stderr=PIPE, text=True))
             for i in range(2)]
    for p in procs:
      out, err = p.communicate(timeout=120)
      assert p.returncode == 0, err[-3000:]
      results.append(json.loads(out.strip().splitlines()[-1]))
  # Process 1 noticed at 13; the next agreement step (multiple of 5) is 15, on both processes.
  assert [r['first'] for r in results] == [15, 15]


# ----------------------------------------------------------------------------------------------
# resume() in a multi-controller job: a chunk damaged on one process's shard makes every process
# fall back together (one KV round per step tried).

@pytest.mark.multiprocess
def test_resume_fallback_is_agreed_by_every_process(tmp_path):
  ckpt = tmp_path / 'ckpt'
  results = run_processes(mp_resume_worker.__file__, 2, 2, args=['save', str(ckpt)],
                          timeout=180)
  assert [r.result for r in results] == [{'saved': [1, 2]}] * 2
  # Damage a chunk of step 2 that only process 1 reads (global elements 2048.. live on its
  # first device).
  needle = (np.arange(4 * 1024, dtype=np.float32) + 2000)[2048:2064].tobytes()
  damage.flip_bit_in(sorted((ckpt / '2').rglob('d/*')), needle, what='process 1 shard')
  results = run_processes(mp_resume_worker.__file__, 2, 2, args=['resume', str(ckpt)],
                          timeout=180)
  assert [r.result for r in results] == [{'step': 1, 'ok': True, 'latest': 1}] * 2
  assert 'is DAMAGED and was skipped (ChecksumMismatchError' in results[1].stderr_tail
  assert ('is DAMAGED and was skipped (another process of this job failed to restore it)'
          in results[0].stderr_tail)
