"""Safe deletion and strict step listing (orbax_pathways.manager.retention), with real CheckpointManagers."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

from orbax_pathways.manager import processes as proc_lib
from orbax_pathways.manager import retention
from orbax_pathways._compat import orbax_manager as om
from orbax_pathways._compat import orbax_manager_state as oms
from support import procs
from support.workers import retention_gc_worker, retention_torn_worker

PY = sys.executable


def _state(step: int) -> dict:
  return {f'p{i}': np.arange(4096, dtype=np.float32) * (i + 1) + step for i in range(6)}


def _abstract():
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
          for k, v in _state(0).items()}


def _save_steps(directory, steps, max_to_keep=None):
  mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep))
  for s in steps:
    mngr.save(s, args=ocp.args.StandardSave({k: jax.numpy.asarray(v)
                                             for k, v in _state(s).items()}))
    mngr.wait_until_finished()
  return mngr


def _restores_exactly(mngr, step) -> bool:
  try:
    got = mngr.restore(step, args=ocp.args.StandardRestore(_abstract()))
  except Exception:  # pylint: disable=broad-except
    return False
  want = _state(step)
  return set(got) == set(want) and all(
      np.asarray(got[k]).tobytes() == want[k].tobytes() for k in want)


@pytest.fixture
def ours():
  retention.install()
  yield
  retention.uninstall()


@pytest.fixture
def stock():
  retention.uninstall()
  yield


# ----------------------------------------------------------------------------------------------
# _compat patches


def test_hooks_install_uninstall_restore_exact_originals():
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  orbax_pathways.uninstall()  # back to stock Orbax; the autouse fixture reinstalls
  assert not om.hooks_installed()
  targets = [(o(), a) for o, a, _ in om._patch_targets()]
  before = [o.__dict__[a] for o, a in targets]
  om.install_manager_hooks()
  om.install_manager_hooks()  # idempotent
  patched = [o.__dict__[a] for o, a in targets]
  assert all(p is not b for p, b in zip(patched, before))
  om.uninstall_manager_hooks()
  om.uninstall_manager_hooks()  # idempotent
  assert all(o.__dict__[a] is b for (o, a), b in zip(targets, before))
  retention.install()
  retention.install()
  retention.uninstall()
  assert all(o.__dict__[a] is b for (o, a), b in zip(targets, before))
  assert not om.hooks_installed()


def test_supported_version_note():
  assert om.SUPPORTED == '>=0.12.4,<0.13'
  assert om.orbax_version_supported()


# ----------------------------------------------------------------------------------------------
# The deleting name is invisible to every Orbax listing


def test_deleting_name_not_listed_not_tmp(tmp_path, stock):
  mngr = _save_steps(tmp_path, [1, 2])
  mngr.close()
  os.rename(tmp_path / '1', tmp_path / retention.deleting_name('1'))
  # Stock listing, stock tmp detection and legacy step helpers all ignore it.
  fresh = ocp.CheckpointManager(tmp_path)
  assert fresh.all_steps() == [2]
  from orbax.checkpoint._src.path import step as step_lib  # test-only peek
  assert step_lib.all_temporary_paths(tmp_path) == []
  assert step_lib.checkpoint_steps(tmp_path) == [2]
  # Stock cleanup_tmp_directories does not touch it (so only our cleanup removes it).
  ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(
      cleanup_tmp_directories=True)).close()
  assert len(retention.leftover_deleting_dirs(tmp_path)) == 1
  # With a step prefix, too.
  mngr = ocp.CheckpointManager(tmp_path / 'p', options=ocp.CheckpointManagerOptions(
      step_prefix='step'))
  mngr.save(3, args=ocp.args.StandardSave({'a': jax.numpy.ones(4)}))
  mngr.wait_until_finished()
  os.rename(tmp_path / 'p' / 'step_3', tmp_path / 'p' / retention.deleting_name('step_3'))
  assert ocp.CheckpointManager(tmp_path / 'p').all_steps() == []


# ----------------------------------------------------------------------------------------------
# Deletion through CheckpointManager


def test_max_to_keep_and_delete_use_rename(tmp_path, ours, monkeypatch):
  renamed = []
  real = retention.deleting_name

  def spy(name):
    renamed.append(name)
    return real(name)

  monkeypatch.setattr(retention, 'deleting_name', spy)
  mngr = _save_steps(tmp_path, range(5), max_to_keep=3)
  assert mngr.all_steps() == [2, 3, 4]
  mngr.delete(3)
  assert mngr.all_steps() == [2, 4]
  mngr.close()
  assert renamed == ['0', '1', '3']
  assert sorted(p.name for p in tmp_path.iterdir()) == ['2', '4']
  fresh = ocp.CheckpointManager(tmp_path)
  assert fresh.all_steps() == [2, 4]
  assert _restores_exactly(fresh, 2) and _restores_exactly(fresh, 4)


def test_background_delete(tmp_path, ours):
  mngr = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(
      max_to_keep=1, enable_background_delete=True))
  for s in range(3):
    mngr.save(s, args=ocp.args.StandardSave({'a': jax.numpy.full(8, s)}))
    mngr.wait_until_finished()
  mngr.close()
  assert sorted(p.name for p in tmp_path.iterdir()) == ['2']


def test_markers_first_when_not_local(tmp_path, ours, monkeypatch):
  """gs:// has no rename: the commit marker must be gone before any data is removed."""
  mngr = _save_steps(tmp_path, [7])
  mngr.close()
  step_dir = epath.Path(tmp_path / '7')
  monkeypatch.setattr(oms, 'is_local_path', lambda p: False)
  seen = {}

  def remove_tree(p):
    seen['commit'] = (p / 'commit_success.txt').exists()
    seen['meta'] = (p / '_CHECKPOINT_METADATA').exists()
    seen['data'] = (p / 'default' / '_METADATA').exists()
    seen['complete'] = retention.is_step_complete(p)
    p.rmtree()

  retention.safe_delete_step(step_dir, remove_tree)
  assert seen == {'commit': False, 'meta': False, 'data': True, 'complete': False}
  assert not step_dir.exists()


def test_rename_failure_falls_back_to_markers_first(tmp_path, ours, monkeypatch):
  mngr = _save_steps(tmp_path, [1])
  mngr.close()

  def fail(name):
    return '../no-such-dir/x'  # rename into a missing directory fails with ENOENT

  monkeypatch.setattr(retention, 'deleting_name', fail)
  seen = []
  retention.safe_delete_step(epath.Path(tmp_path / '1'),
                             lambda p: (seen.append(retention.is_step_complete(p)), p.rmtree()))
  assert seen == [False] and not (tmp_path / '1').exists()


# ----------------------------------------------------------------------------------------------
# Completeness rule


def test_completeness_rule(tmp_path, ours):
  mngr = _save_steps(tmp_path, [1, 2, 3, 4])
  mngr.close()
  # 2: as written by Orbax 0.11.x - 0.12.1: no commit_success.txt, metadata has commit timestamp.
  os.remove(tmp_path / '2' / 'commit_success.txt')
  # 3: torn: both markers gone (what a stock rmtree does first on this filesystem).
  os.remove(tmp_path / '3' / 'commit_success.txt')
  os.remove(tmp_path / '3' / '_CHECKPOINT_METADATA')
  # 4: metadata without commit timestamp and no marker: never committed.
  os.remove(tmp_path / '4' / 'commit_success.txt')
  meta = (tmp_path / '4' / '_CHECKPOINT_METADATA')
  import json
  d = json.loads(meta.read_text())
  d['commit_timestamp_nsecs'] = None
  meta.write_text(json.dumps(d))
  # 5: an empty final-named directory.
  os.mkdir(tmp_path / '5')

  fresh = ocp.CheckpointManager(tmp_path)
  assert fresh.all_steps() == [1, 2]
  assert fresh.latest_step() == 2
  # Only listing is guarded: an explicit restore(3) still reads whatever files are there.
  assert _restores_exactly(fresh, 2)

  retention.uninstall()
  assert ocp.CheckpointManager(tmp_path).all_steps() == [1, 2, 3, 4, 5]  # stock lists them all
  retention.install(accept_unmarked_steps=True)
  # Unmarked (no metadata at all) accepted: 3 and 5; 4 has metadata without commit: still not.
  assert ocp.CheckpointManager(tmp_path).all_steps() == [1, 2, 3, 5]


def test_leftovers_removed_at_init_on_primary(tmp_path, ours):
  mngr = _save_steps(tmp_path, [1])
  mngr.close()
  leftover = tmp_path / retention.deleting_name('0')  # this process's, and no delete runs
  os.makedirs(leftover / 'default' / 'd')
  (leftover / 'default' / 'd' / 'x').write_bytes(b'x')
  ro = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(read_only=True))
  assert leftover.exists()  # read-only managers never delete
  ro.close()
  fresh = ocp.CheckpointManager(tmp_path)
  assert not leftover.exists()
  assert fresh.all_steps() == [1]


def _owned(step: str, host: str, pid: int, start: int, age_s: float) -> str:
  """A deleting name as another process writes it (format in retention's docstring)."""
  return (f'{step}{retention.DELETING_MARKER}{host}-{pid}-{start}-{int(time.time() - age_s)}-'
          'abcdef01')


def _backdate(path, seconds):
  t = time.time() - seconds
  os.utime(path, (t, t))


def test_leftover_cleanup_removes_only_provably_abandoned_ones(tmp_path, ours):
  """Readers (an evaluator's manager, resume in a second job) must never delete a trainer's
  delete in progress: only leftovers whose owner is provably gone."""
  _save_steps(tmp_path, [9]).close()
  me = proc_lib.host_id()
  with procs.started([PY, '-c', 'import time; time.sleep(600)'], devices=None) as live:
    with procs.started([PY, '-c', 'pass'], devices=None) as dead:
      dead.wait()
    live_start = proc_lib.process_start(live.pid)
    names = {
        'live': _owned('1', me, live.pid, live_start, 5),
        'live_unknown_start': _owned('2', me, live.pid, 0, 5),
        'dead': _owned('3', me, dead.pid, 12345, 5),
        'pid_reused': _owned('4', me, live.pid, live_start + 1, 5),
        'live_but_expired': _owned('5', me, live.pid, live_start, 2 * 3600),
        'other_host': _owned('6', 'f' * 8 if me != 'f' * 8 else 'e' * 8, 1, 1, 60),
        'other_host_expired': _owned('7', 'f' * 8 if me != 'f' * 8 else 'e' * 8, 1, 1, 7200),
        'legacy_fresh': f'8{retention.DELETING_MARKER}{"0" * 32}',
        'legacy_old': f'10{retention.DELETING_MARKER}{"1" * 32}',
    }
    for name in names.values():
      os.makedirs(tmp_path / name / 'default')
      (tmp_path / name / 'default' / 'x').write_bytes(b'x')
    _backdate(tmp_path / names['legacy_old'], 2 * 3600)
    reader = ocp.CheckpointManager(tmp_path)  # an evaluator's ordinary manager
    assert reader.all_steps() == [9]
    left = {k for k, n in names.items() if (tmp_path / n).exists()}
    assert left == {'live', 'live_unknown_start', 'other_host', 'legacy_fresh'}
    live.kill()
    live.wait()
    ocp.CheckpointManager(tmp_path).close()  # the owner is gone now
    left = {k for k, n in names.items() if (tmp_path / n).exists()}
    assert left == {'other_host', 'legacy_fresh'}


def test_deleter_tolerates_files_vanishing_under_it(tmp_path, ours):
  """Another process removes the same tree meanwhile: the delete still completes."""
  _save_steps(tmp_path, [1, 2]).close()
  calls = []

  def racing_remove(path):
    listed = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    calls.append(len(listed))
    shutil.rmtree(path / 'default')  # the other process got there first
    for f in listed:
      os.unlink(f)  # FileNotFoundError, as Orbax's rmtree would see it

  retention.safe_delete_step(epath.Path(tmp_path / '1'), racing_remove)
  assert calls and calls[0] > 3
  assert sorted(p.name for p in tmp_path.iterdir()) == ['2']


def _strace_available() -> bool:
  if shutil.which('strace') is None:
    return False
  r = procs.run(['strace', '-qq', '-o', os.devnull, '-e', 'inject=unlinkat:error=ENOENT:when=1',
                 'true'], devices=None, timeout=60, check=False)
  return r.returncode == 0


def _strace(*inject: str) -> list[str]:
  """The ``strace`` prefix of a worker's argv: every process of it traced (``-f``), only its
  ``unlinkat`` calls, each ``inject`` an ``-e inject=`` rule for them."""
  argv = ['strace', '-f', '-qq', '-o', os.devnull, '-e', 'trace=unlinkat']
  for rule in inject:
    argv += ['-e', f'inject=unlinkat:{rule}']
  return argv


needs_strace = pytest.mark.skipif(
    not _strace_available(),
    reason='strace with syscall injection is unavailable (apt-get install -y strace; it also '
           'needs ptrace permission in the container)')


@needs_strace
def test_failing_garbage_collection_never_fails_a_save(tmp_path):
  """Every unlink fails (EACCES from the kernel, injected by strace): old steps cannot be
  removed. Saves must still all succeed and stay listed (stock Orbax fails the *next* save and
  forgets the committed step); the user's own mngr.delete() raises naming the step."""
  ckpt = tmp_path / 'ckpt'
  r = procs.run(_strace('error=EACCES') + procs.worker_argv(retention_gc_worker, ckpt),
                timeout=300, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out['errors'] == [] and out['listed'] == [3], out
  assert out['explicit'].startswith('OSError: orbax_pathways: deleting step 3 ('), out
  assert 'garbage collection of old step 0' in r.stderr
  # Steps 0-2 were renamed away (unlisted) but could not be removed; the child is gone, so the
  # next manager removes them.
  assert len(retention.leftover_deleting_dirs(ckpt)) == 4  # 0, 1, 2 and the explicit delete of 3
  retention.install()
  try:
    assert ocp.CheckpointManager(ckpt).all_steps() == []
    assert retention.leftover_deleting_dirs(ckpt) == []
  finally:
    retention.uninstall()


# ----------------------------------------------------------------------------------------------
# Deterministic torn-delete reproduction: SIGKILL at the K-th unlinkat of the old-step delete.

def _run_killed_child(tmp_path, mode: str, k: int):
  ckpt = tmp_path / 'ckpt'
  # Only old-step deletion calls unlinkat in this child (checked: a full run makes 2 x 20 calls,
  # all inside rmtree of steps 0 and 1), so the K-th unlinkat is inside the delete of step 0.
  proc = procs.run(_strace(f'signal=SIGKILL:when={k}')
                   + procs.worker_argv(retention_torn_worker, ckpt, mode), timeout=180,
                   check=False)
  assert proc.returncode in (-9, 137), (proc.returncode, proc.stderr[-3000:])
  return ckpt


@needs_strace
@pytest.mark.parametrize('k', [3, 8, 16])
def test_torn_delete_with_hooks_lists_only_restorable_steps(tmp_path, ours, k):
  ckpt = _run_killed_child(tmp_path, 'ours', k)
  assert len(retention.leftover_deleting_dirs(ckpt)) == 1  # killed mid-rmtree, renamed away
  mngr = ocp.CheckpointManager(ckpt)
  steps = mngr.all_steps()
  assert steps == [1, 2, 3], steps
  for s in steps:
    assert _restores_exactly(mngr, s), s
  assert retention.leftover_deleting_dirs(ckpt) == []  # removed at manager init


@needs_strace
def test_torn_delete_stock_lists_broken_step(tmp_path, stock):
  """The same kill against stock Orbax lists a step that does not restore (the test can fail).

  Which files the first K unlinks remove depends on the directory order of the random data file
  names, so a few K inside the delete of step 0 are tried until one tears it."""
  for k in (8, 10, 12, 9, 11, 14):
    work = tmp_path / f'k{k}'
    work.mkdir()
    ckpt = _run_killed_child(work, 'stock', k)
    mngr = ocp.CheckpointManager(ckpt)
    assert mngr.all_steps() == [0, 1, 2, 3]
    if not _restores_exactly(mngr, 0):
      break
  else:
    raise AssertionError('no kill inside the delete of step 0 left a listed, broken step')
  # And our rule alone (no rename) hides it here only because the markers were unlinked first.
  retention.install()
  try:
    assert ocp.CheckpointManager(ckpt).all_steps() == [1, 2, 3]
  finally:
    retention.uninstall()


def test_reader_listing_while_a_step_is_deleted(tmp_path, ours):
  """A reader builds a CheckpointManager at the instant retention renames a step away (the race
  the 200-round torture hit: Orbax stat()s the vanished path for its commit time). The step
  must simply drop out of the listing."""
  _save_steps(tmp_path, [0, 1, 2])
  vanished = []

  class CompleteThenDeleted(retention.RetentionHooks):
    def step_complete(self, step_path):
      ok = retention.is_step_complete(step_path)
      if ok and step_path.name == '1':  # retention renames step 1 right after it was judged complete
        retention.safe_delete_step(step_path)
        vanished.append(step_path.name)
      return ok

  installed = [h for h in om.registered() if h.name == 'retention'][0]
  om.register(CompleteThenDeleted())  # in retention's place
  try:
    reader = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(read_only=True))
  finally:
    om.register(installed)
  assert vanished == ['1']
  assert reader.all_steps() == [0, 2]


# ----------------------------------------------------------------------------------------------
# A failed restore's explanation: "deleted while it was being restored" only
# for a step the manager listed when the restore began; otherwise Orbax's own error.


def _restore_error(mngr, step, with_args=True) -> BaseException:
  with pytest.raises(Exception) as info:
    if with_args:
      mngr.restore(step, args=ocp.args.StandardRestore(_abstract()))
    else:
      mngr.restore(step)
  return info.value


def _never_saved(d):
  mngr = _save_steps(d, [0, 1])
  return mngr, 5


def _deleted_earlier(d):
  mngr = _save_steps(d, [0, 1, 2])
  mngr.delete(1)
  return mngr, 1


def _empty(d):
  return ocp.CheckpointManager(d), 5


@pytest.mark.parametrize('with_args', [True, False])
@pytest.mark.parametrize('case', [_never_saved, _deleted_earlier, _empty])
def test_restoring_a_step_that_is_not_listed_raises_orbaxs_own_error(tmp_path, case, with_args):
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  orbax_pathways.uninstall()
  try:
    mngr, step = case(tmp_path / 'stock')
    stock = _restore_error(mngr, step, with_args)
    mngr.close()
  finally:
    orbax_pathways.install(orbax_pathways.Options.from_env())
  mngr, step = case(tmp_path / 'ours')
  ours = _restore_error(mngr, step, with_args)
  mngr.close()
  assert type(ours) is type(stock), (ours, stock)
  assert (str(ours).replace(str(tmp_path / 'ours'), '<dir>') ==
          str(stock).replace(str(tmp_path / 'stock'), '<dir>'))
  assert 'deleted while' not in str(ours)


def test_a_listed_step_deleted_during_its_restore_is_named_as_such(tmp_path, monkeypatch):
  """Another process's retention deletes the step after the restore began (injected inside the
  real handler's restore, with the real deletion)."""
  mngr = _save_steps(tmp_path, [0, 1])
  original = ocp.StandardCheckpointHandler.restore

  def deleted_first(self, directory, *args, **kwargs):
    retention.safe_delete_step(epath.Path(directory).parent)  # <dir>/1/default -> <dir>/1
    return original(self, directory, *args, **kwargs)

  monkeypatch.setattr(ocp.StandardCheckpointHandler, 'restore', deleted_first)
  error = _restore_error(mngr, 1)
  assert isinstance(error, FileNotFoundError), repr(error)
  assert f'Step 1 ({tmp_path}/1) was deleted while it was being restored' in str(error), error
  monkeypatch.undo()
  assert _restores_exactly(mngr, 0)
