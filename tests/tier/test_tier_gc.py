"""Node-level clean-up of the node-local tier (``orbax_pathways/tier/gc.py``): a save drops other
checkpoint directories' entries that are idle past the max age or incomplete, and the oldest
entries while the tier is over its size cap; ``orbax-pathways tier --gc`` does it by hand.

Real files in a tmp directory: entries written by the store's own ``write_entry`` (and marked
committed by ``on_commit``) or by a real save through a CheckpointManager; ages set with
``os.utime``. Each test asserts the tree on disk.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import uuid

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways import engine
from orbax_pathways import options as options_lib
from orbax_pathways import stats
from orbax_pathways.transports import values
from orbax_pathways.cli import main as cli
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import save as save_plan
from orbax_pathways.storage import writer as writer_lib
from orbax_pathways.tier import gc as tier_gc
from orbax_pathways.tier import manifest as tier_layout
from orbax_pathways.tier import config as tier_config
from orbax_pathways.tier import store as tier_store
from support import procs

P = jax.sharding.PartitionSpec
HOUR = 3600.0
KiB = 1 << 10


def _write(tier, root, step, nbytes=64 * KiB, commit=True, keep=1):
  """One real entry of ``root``'s ``step`` (one array of ``nbytes``), through the store; the
  step's directory exists on storage (an entry of a step that does not is gone: see below)."""
  os.makedirs(os.path.join(root, str(step)), exist_ok=True)
  cfg = tier_config.resolve(str(tier), keep)
  leaf = values.SaveLeaf('w', (nbytes,), np.dtype(np.uint8), np.dtype(np.uint8), False, 1 << 20)
  plan = save_plan.ArrayWritePlan((nbytes,), (nbytes,), ())
  piece = writer_lib.Piece(boxes_lib.Box((0,), (nbytes,)), np.full(nbytes, step, np.uint8))
  path = tier_store.write_entry(cfg, f'{root}/{step}/default', 'p0', uuid.uuid4().hex[:16],
                                [leaf], [plan], [[piece]], {})
  assert path is not None
  if commit:
    tier_store.on_commit(str(root), step)
  return path


def _cut_short(path):
  """An entry whose copy never finished: its chunk files, no manifest."""
  os.remove(os.path.join(path, tier_layout.MANIFEST))
  return path


def _age(path, seconds):
  """Makes ``path`` (an entry directory and its files) look last touched ``seconds`` ago."""
  t = time.time() - seconds
  for name in os.listdir(path):
    os.utime(os.path.join(path, name), (t, t))
  os.utime(path, (t, t))
  return path


def _tree(tier):
  """{checkpoint directory: sorted step names} of what is on disk (root keys by root.txt)."""
  out = {}
  for key in sorted(os.listdir(tier)):
    root = tier_store.root_of(str(tier), key) or key
    out[root] = sorted(s for s in os.listdir(tier / key) if s != tier_layout.ROOT_FILE)
  return out


def _save(root, steps, every=1, **options):
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('x', 'y'))
  w = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
  state = {'w': jax.device_put(w, jax.sharding.NamedSharding(mesh, P('x', 'y')))}
  orbax_pathways.install(orbax_pathways.Options(**options))
  with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(
      save_interval_steps=every)) as m:
    for s in steps:
      m.save(s, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
  assert tier_store.flush(120)  # the copy and the clean-up run in the background
  return state, w


# ---- the rule (pure) -----------------------------------------------------------------------------

NOW = 1e9


def _seen(name, key, step, age_s, committed=True, complete=True, nbytes=100):
  return tier_gc.Seen(name, key, step, committed, complete, nbytes, NOW - age_s)


def _plan(seen, max_age_s=24 * HOUR, max_bytes=None, current=None, keep=()):
  return {d.seen.path: d.reason for d in tier_gc.plan(seen, NOW, max_age_s, max_bytes, current,
                                                       keep)}


def test_plan_drops_other_roots_by_age_and_incomplete_ones_once_idle():
  seen = [_seen('old', 'a', 1, 25 * HOUR), _seen('day-old', 'b', 1, 23 * HOUR),
          _seen('cut', 'c', 1, 10 * 60, committed=False, complete=False),
          _seen('writing', 'c', 2, 60, committed=False, complete=False),
          _seen('mine-old', 'cur', 1, 48 * HOUR),
          _seen('mine-cut', 'cur', 2, 48 * HOUR, committed=False, complete=False)]
  assert _plan(seen, current='cur') == {'old': 'age', 'cut': 'incomplete'}
  # By hand (no saving directory) every directory's entries are judged alike.
  assert _plan(seen) == {'old': 'age', 'cut': 'incomplete', 'mine-old': 'age',
                         'mine-cut': 'age'}
  # Nothing touched in the last IDLE_S goes, whatever the max age.
  assert _plan(seen, max_age_s=0, current='cur') == {'old': 'age', 'day-old': 'age',
                                                     'cut': 'age'}
  assert _plan(seen, max_age_s=float('inf'), current='cur') == {'cut': 'incomplete'}


def test_plan_cap_drops_oldest_first_other_roots_before_the_saving_ones_older_steps():
  seen = [_seen('a5', 'a', 5, 3 * HOUR), _seen('b1', 'b', 1, 2 * HOUR),
          _seen('young', 'y', 1, 60),
          _seen('c1', 'cur', 1, 5 * HOUR), _seen('c2', 'cur', 2, 4 * HOUR),
          _seen('c3', 'cur', 3, 6 * HOUR, committed=False),
          _seen('c4', 'cur', 4, 6 * HOUR, committed=False)]
  keep = ('c4',)  # just written
  assert _plan(seen, max_bytes=700, current='cur', keep=keep) == {}
  assert _plan(seen, max_bytes=600, current='cur', keep=keep) == {'a5': 'cap'}
  assert _plan(seen, max_bytes=500, current='cur', keep=keep) == {'a5': 'cap', 'b1': 'cap'}
  # Then the saving directory's steps older than its newest committed one (2), oldest first;
  # never step 2, the step in flight after it (3), the entry just written, a young entry.
  assert _plan(seen, max_bytes=0, current='cur', keep=keep) == {'a5': 'cap', 'b1': 'cap',
                                                                'c1': 'cap'}
  # No committed step of the saving directory (a front door without the commit hook): none
  # of its entries goes for the cap.
  uncommitted = [dataclasses.replace(e, committed=False) if e.root_key == 'cur' else e
                 for e in seen]
  assert _plan(uncommitted, max_bytes=0, current='cur', keep=keep) == {'a5': 'cap',
                                                                       'b1': 'cap'}


# ---- at a save -----------------------------------------------------------------------------------


def test_a_save_drops_other_directories_stale_entries_and_keeps_young_ones(tmp_path):
  tier = tmp_path / 'tier'
  old, young, cut, fresh_cut, cur = (tmp_path / n for n in ('old', 'young', 'cut', 'fresh', 'cur'))
  _save(old, [1, 2], tier_dir=str(tier))  # a real save: the job that left this node
  for e in tier_store.entries(str(tier), str(old)):
    _age(e.path, 25 * HOUR)
  _write(tier, young, 7)
  _age(_write(tier, young, 8), 23 * HOUR)  # idle, but younger than the max age: kept
  _age(_cut_short(_write(tier, cut, 3, commit=False)), 10 * 60)
  _cut_short(_write(tier, fresh_cut, 3, commit=False))  # maybe still being written: kept
  # prune kept each directory's newest step
  assert _tree(tier) == {str(old): ['2'], str(young): ['8'], str(cut): ['3'],
                         str(fresh_cut): ['3']}

  _save(cur, [1], tier_dir=str(tier))
  # The old directory is gone whole (its root key too), the cut-short copy too.
  assert _tree(tier) == {str(young): ['8'], str(fresh_cut): ['3'], str(cur): ['1']}
  assert len(tier_store.entries(str(tier), str(cur))) == 1


def test_a_restore_marks_its_entry_in_use(tmp_path):
  """An entry a restore just read counts as touched: a save of another directory keeps it
  even though it was written longer ago than the max age."""
  tier, old, cur = tmp_path / 'tier', tmp_path / 'old', tmp_path / 'cur'
  state, w = _save(old, [1], tier_dir=str(tier))
  (e,) = tier_store.entries(str(tier), str(old))
  _age(e.path, 25 * HOUR)
  with ocp.CheckpointManager(old) as m:
    out = m.restore(1, args=ocp.args.StandardRestore(state))
  np.testing.assert_array_equal(np.asarray(out['w']), w)
  assert stats.last_restore().bytes_by_source.get('local') == w.nbytes
  _save(cur, [1], tier_dir=str(tier))
  assert _tree(tier) == {str(old): ['1'], str(cur): ['1']}
  # Once idle past the max age, the next save (another step) drops it.
  _age(e.path, 25 * HOUR)
  _save(cur, [2], tier_dir=str(tier))
  assert _tree(tier) == {str(cur): ['2']}


def test_the_size_cap_drops_oldest_first_never_the_newest_committed_step(tmp_path):
  tier, cur = tmp_path / 'tier', tmp_path / 'cur'
  for n, hours in (('a', 3), ('b', 2), ('c', 1)):
    _age(_write(tier, tmp_path / n, 1), hours * HOUR)
  for s in (1, 2):
    _age(_write(tier, cur, s, keep=2), (5 - s) * HOUR)
  assert _tree(tier) == {str(tmp_path / n): ['1'] for n in 'abc'} | {str(cur): ['1', '2']}
  # Room for four entries of 64 KiB: the two oldest other directories go.
  cfg = tier_config.resolve(str(tier), 2, max_bytes=4 * 64 * KiB)
  just = _write(tier, cur, 3, commit=False, keep=2)
  result = tier_gc.after_write(cfg, just)
  assert [d.reason for d in result.dropped] == ['cap', 'cap']
  assert _tree(tier) == {str(tmp_path / 'c'): ['1'], str(cur): ['1', '2', '3']}
  # No room at all: everything idle goes except the newest committed step (2) and the entry
  # just written (3, not committed yet); older steps of the saving directory go last.
  cfg = tier_config.resolve(str(tier), 2, max_bytes=0)
  just = _write(tier, cur, 4, commit=False, keep=2)
  _age(just, 60)
  tier_gc.after_write(cfg, just)
  assert _tree(tier) == {str(cur): ['2', '3', '4']}


def test_a_save_through_options_applies_the_cap(tmp_path):
  tier, cur = tmp_path / 'tier', tmp_path / 'cur'
  for n, h in (('a', 3), ('b', 2)):
    _age(_write(tier, tmp_path / n, 1), h * HOUR)
  _save(cur, [1], tier_dir=str(tier), tier_max_bytes=0)
  assert _tree(tier) == {str(cur): ['1']}


def test_a_failing_clean_up_never_fails_the_save_and_warns_once(tmp_path, monkeypatch, caplog):
  tier, cur = tmp_path / 'tier', tmp_path / 'cur'
  _age(_write(tier, tmp_path / 'old', 1), 25 * HOUR)

  def unreadable(tier_dir, judge=None):
    raise PermissionError(13, 'Permission denied', tier_dir)

  monkeypatch.setattr(tier_gc, 'scan', unreadable)
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  _save(cur, [1, 2], tier_dir=str(tier))
  warnings = [r for r in caplog.records if 'cleaning up other checkpoint' in r.getMessage()]
  assert len(warnings) == 1 and 'PermissionError' in warnings[0].getMessage()
  assert _tree(tier) == {str(tmp_path / 'old'): ['1'], str(cur): ['2']}


def _node_steps(tier):
  return sorted(str(p.relative_to(tier)) for p in tier.glob('.node-steps/*/*')
                if not p.parent.name.endswith('.copies'))


def _copies(tier):
  return sorted(str(p.relative_to(tier)) for p in tier.glob('.node-steps/*.copies/*/*'))


def _age_tree(path, seconds):
  """Makes ``path`` and everything below it look last touched ``seconds`` ago."""
  t = time.time() - seconds
  for p in [*path.rglob('*'), path]:
    os.utime(p, (t, t))


def test_node_steps_count_against_the_cap_and_only_a_stopped_jobs_go(tmp_path, capsys):
  """A manager with ``local_steps_in='nodes'`` keeps local-only steps 2 and 3 in the node
  (``local_steps_keep=2``, while the tier keeps one copy of a storage step, ``tier_keep=1``):
  their bytes count against the tier's cap (an idle entry of another directory makes room for
  them), the cap never drops one, and one idle longer than the max age (a job that stopped)
  goes, by hand too."""
  tier, cur, other = tmp_path / 'tier', tmp_path / 'cur', tmp_path / 'other'
  _save(cur, [0, 1, 2, 3], every=4, tier_dir=str(tier), local_save_interval_steps=1,
        tier_keep=1, local_steps_keep=2, local_steps_in='nodes')
  held = _node_steps(tier)
  assert [h.rpartition('/')[2] for h in held] == ['2', '3'], held
  nbytes = sum(f.stat().st_size for f in (tier / held[1]).rglob('*') if f.is_file())
  assert nbytes > 64 * KiB  # the step's 64 KiB array and Orbax's files
  # A partner's copy of its step 3 (fleet/node_copy.py's layout) counts as a node step too.
  shutil.copytree(tier / held[1], tier / (held[1].rsplit('/', 1)[0] + '.copies') / 'p1' / '3')
  held_copies = _copies(tier)
  for h in held + held_copies:
    _age_tree(tier / h, 2 * HOUR)  # idle, younger than the max age
  _age(_write(tier, other, 1), 3 * HOUR)
  seen, _ = tier_gc.scan(str(tier))
  on_node = [e for e in seen if e.node_step]
  assert [(e.step, e.complete) for e in on_node] == [(2, True), (3, True), (3, True)], on_node
  assert on_node[1].nbytes == nbytes == on_node[2].nbytes
  assert on_node[2].root_key.endswith('.copies/p1'), on_node[2]
  # Room for everything but the other directory's entry: it goes, for the node steps' bytes.
  room = sum(e.nbytes for e in seen if e.root_key != tier_layout.root_key(str(other)))
  result = tier_gc.collect(str(tier), max_age_s=24 * HOUR, max_bytes=room, current='x')
  assert [(d.reason, d.seen.node_step) for d in result.dropped] == [('cap', False)]
  assert str(other) not in _tree(tier)
  tier_gc.collect(str(tier), max_age_s=24 * HOUR, max_bytes=0, current='x')
  assert _node_steps(tier) == held and _copies(tier) == held_copies  # never by the cap
  for h in held + held_copies:
    _age_tree(tier / h, 25 * HOUR)
  assert cli.main(['tier', str(tier), '--gc']) == 0
  text = capsys.readouterr().out
  assert f'removed  node step {tier / held[0]}' in text and 'idle longer than the max age' in text
  assert _node_steps(tier) == [] and _copies(tier) == []


# ---- by hand -------------------------------------------------------------------------------------


def test_cli_gc_dry_run_lists_without_removing_then_removes(tmp_path, capsys):
  tier, old, young = tmp_path / 'tier', tmp_path / 'old', tmp_path / 'young'
  _age(_write(tier, old, 1), 25 * HOUR)
  _age(_write(tier, old, 2), 25 * HOUR)
  _write(tier, young, 1)
  before = _tree(tier)
  assert before == {str(old): ['2'], str(young): ['1']}  # prune kept old's newest step

  assert cli.main(['tier', str(tier), '--gc', '--dry-run', '--json']) == 0
  obj = json.loads(capsys.readouterr().out)
  assert obj['dry_run'] and obj['max_age_s'] == 24 * HOUR and obj['entries'] == 2
  assert [(x['root'], x['step'], x['reason'], x['bytes']) for x in obj['removed']] == [
      (str(old), 2, 'age', 64 * KiB)]
  assert obj['bytes_before'] - obj['bytes_after'] == 64 * KiB
  assert _tree(tier) == before  # nothing removed

  assert cli.main(['tier', str(tier), '--gc']) == 0
  text = capsys.readouterr().out
  assert f'removed  {old}  step 2' in text and 'idle longer than the max age' in text
  assert _tree(tier) == {str(young): ['1']}
  # A max age of 0 still keeps what was touched in the last 5 minutes; a cap of 0 too.
  assert cli.main(['tier', str(tier), '--gc', '--max-age-s', '0', '--max-bytes', '0',
                   '--json']) == 0
  assert json.loads(capsys.readouterr().out)['removed'] == []
  assert _tree(tier) == {str(young): ['1']}


def test_cli_gc_flags_need_gc_and_a_bad_variable_is_named(tmp_path, capsys, monkeypatch):
  tier = tmp_path / 'tier'
  _write(tier, tmp_path / 'a', 1)
  assert cli.main(['tier', str(tier), '--dry-run']) == 2
  assert '--dry-run, --max-age-s and --max-bytes go with --gc' in capsys.readouterr().err
  monkeypatch.setenv('ORBAX_PATHWAYS_TIER_MAX_AGE_S', '1d')
  assert cli.main(['tier', str(tier), '--gc', '--json']) == 2
  captured = capsys.readouterr()
  assert "ORBAX_PATHWAYS_TIER_MAX_AGE_S='1d' is not a number >= 0" in captured.err
  assert json.loads(captured.out)['exit_code'] == 2


# ---- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize('name,value,message', [
    ('ORBAX_PATHWAYS_TIER_MAX_AGE_S', '1d', r'is not a number >= 0 \(seconds; inf: never'),
    ('ORBAX_PATHWAYS_TIER_MAX_AGE_S', '-5', r'is out of range: it must be a number >= 0'),
    ('ORBAX_PATHWAYS_TIER_MAX_BYTES', '8GiB', r'is not an integer >= 0 \(bytes\)'),
    ('ORBAX_PATHWAYS_TIER_MAX_BYTES', '-1', r'is out of range: it must be an integer >= 0'),
])
def test_a_bad_variable_fails_install_naming_it(monkeypatch, name, value, message):
  monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=rf'{name}={value!r} {message}'):
    orbax_pathways.install()


def test_variables_and_options_reach_the_tier(monkeypatch, tmp_path):
  monkeypatch.setenv('ORBAX_PATHWAYS_TIER_MAX_AGE_S', '3600')
  monkeypatch.setenv('ORBAX_PATHWAYS_TIER_MAX_BYTES', '1048576')
  o = options_lib.Options.from_env()
  assert (o.tier_max_age_s, o.tier_max_bytes) == (3600.0, 1 << 20)
  monkeypatch.setenv('ORBAX_PATHWAYS_TIER_MAX_AGE_S', 'inf')
  assert options_lib.Options.from_env().tier_max_age_s == float('inf')
  cfg = engine.Engine(orbax_pathways.Options(tier_dir=str(tmp_path), tier_max_age_s=60,
                                             tier_max_bytes=5)).tier()
  assert (cfg.max_age_s, cfg.max_bytes) == (60, 5)
  for kwargs, message in [
      ({'tier_max_age_s': -1}, r'Options.tier_max_age_s=-1: use a number of seconds >= 0'),
      ({'tier_max_age_s': 'day'}, r"Options.tier_max_age_s='day'"),
      ({'tier_max_bytes': -1}, r'Options.tier_max_bytes=-1: must be an integer >= 0 or None'),
  ]:
    with pytest.raises(ValueError, match=message):
      orbax_pathways.Options(**kwargs)


# ---- a tier with room for one copy --------------------------------------------------------------


def _mount_tmpfs(path, size):
  path.mkdir()
  r = procs.run(['mount', '-t', 'tmpfs', '-o', f'size={size},mode=0700', 'tmpfs', path],
                check=False, timeout=60)
  if r.returncode:
    pytest.skip(f'cannot mount a tmpfs here (needs root): {r.stderr.strip()}')


def test_a_tier_with_room_for_one_copy_keeps_the_newest_step(tmp_path, caplog):
  """16 MiB of tmpfs, 10 MiB of state, max_to_keep=1: each save replaces the older copy, so the
  tier holds the newest committed step (not the first one forever), and the restore of it
  reads nothing from storage. No warning: every copy fitted once the older one went."""
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _mount_tmpfs(tier, '16m')
  try:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
    w = np.arange(10 * 2**18, dtype=np.float32).reshape(8, -1)  # 10 MiB
    state = {'w': jax.device_put(w, jax.sharding.NamedSharding(mesh, P('x')))}
    orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier)))
    caplog.set_level(logging.INFO, logger='orbax_pathways')
    opts = ocp.CheckpointManagerOptions(max_to_keep=1)
    with ocp.CheckpointManager(root, options=opts) as m:
      for s in (1, 2, 3):
        m.save(s, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
        assert tier_store.flush(120)
      assert m.all_steps() == [3]
      assert [(e.step, e.committed) for e in tier_store.entries(str(tier))] == [(3, True)]
      out = m.restore(3, args=ocp.args.StandardRestore(state))
    np.testing.assert_array_equal(np.asarray(out['w']), w)
    assert stats.last_restore().bytes_by_source == {'local': w.nbytes, 'storage': 0}
    assert not [r for r in caplog.records if 'node-local tier skipped' in r.getMessage()]
  finally:
    procs.run(['umount', tier], check=False, timeout=60)


def test_no_room_names_the_safety_margin_and_leaves_nothing(tmp_path, caplog):
  """The /dev/shm default leaves 64 MiB free on its filesystem (node memory): a copy that does
  not fit with that margin is skipped with one warning naming the bytes, the free space and
  the margin, and creates nothing."""
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _mount_tmpfs(tier, '16m')
  try:
    caplog.set_level(logging.INFO, logger='orbax_pathways')
    cfg = tier_config.TierConfig(str(tier), explicit=False)  # what the default resolves to
    leaf = values.SaveLeaf('w', (1 << 20,), np.dtype(np.uint8), np.dtype(np.uint8), False, 1 << 20)
    plan = save_plan.ArrayWritePlan((1 << 20,), (1 << 20,), ())
    piece = writer_lib.Piece(boxes_lib.Box((0,), (1 << 20,)), np.zeros(1 << 20, np.uint8))
    for step in (1, 2):
      assert tier_store.write_entry(cfg, f'{root}/{step}/default', 'p0', uuid.uuid4().hex[:16],
                                    [leaf], [plan], [[piece]], {}) is None
    warnings = [r.getMessage() for r in caplog.records
                if 'node-local tier skipped' in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f'share of {root}/1/default is {1 << 20} bytes' in warnings[0]
    assert 'safety margin of 67108864 bytes (64 MiB)' in warnings[0]
    assert os.listdir(tier) == []
  finally:
    procs.run(['umount', tier], check=False, timeout=60)


# ---- what was never cleaned ---------------------------------------------------------------------


def test_delete_drops_the_tier_copy_of_the_step(tmp_path):
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  state, w = _save(root, [1, 2], tier_dir=str(tier), tier_keep=2)
  assert sorted(e.step for e in tier_store.entries(str(tier), str(root))) == [1, 2]
  with ocp.CheckpointManager(root) as m:
    m.delete(2)
    assert m.all_steps() == [1]
  assert [e.step for e in tier_store.entries(str(tier), str(root))] == [1]


def test_retention_drops_the_tier_copy_of_the_steps_it_deletes(tmp_path):
  """tier_keep=2 but max_to_keep=1: the step retention deletes from storage goes from the
  tier too (no copy of a step storage no longer has)."""
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('x', 'y'))
  w = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
  state = {'w': jax.device_put(w, jax.sharding.NamedSharding(mesh, P('x', 'y')))}
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), tier_keep=2))
  with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=1)) as m:
    for s in (1, 2, 3):
      m.save(s, args=ocp.args.StandardSave(state))
      m.wait_until_finished()
      assert tier_store.flush(120)
    assert m.all_steps() == [3]
  assert [e.step for e in tier_store.entries(str(tier), str(root))] == [3]


def test_a_save_drops_entries_whose_checkpoint_directory_is_gone(tmp_path):
  """Entries of a local checkpoint directory that was removed (a test run's, a notebook's),
  idle but younger than the max age: the next save (of another directory) drops them, and
  those of a directory still there stay."""
  tier = tmp_path / 'tier'
  gone, there, cur = tmp_path / 'gone', tmp_path / 'there', tmp_path / 'cur'
  _save(gone, [1, 2], tier_dir=str(tier))
  _save(there, [1], tier_dir=str(tier))
  for e in tier_store.entries(str(tier)):
    _age(e.path, 10 * 60)
  shutil.rmtree(gone)
  _save(cur, [1], tier_dir=str(tier))
  assert _tree(tier) == {str(there): ['1'], str(cur): ['1']}


def test_cli_gc_drops_gone_and_stale_entries(tmp_path, capsys):
  """``orbax-pathways tier --gc``: an entry of a step deleted from storage behind the tier's
  back (``rm -r``), and one of a step saved again since (storage records another save id),
  both idle: removed, with their reasons; the entry storage still records stays."""
  tier = tmp_path / 'tier'
  a, b = tmp_path / 'a', tmp_path / 'b'
  _save(a, [1, 2], tier_dir=str(tier), tier_keep=2)
  _save(b, [1], tier_dir=str(tier))
  shutil.rmtree(a / '1')
  shutil.rmtree(b / '1')
  _save(b, [1], tier_dir='off')  # saved again, tier off: storage records another save id
  for e in tier_store.entries(str(tier)):
    _age(e.path, 10 * 60)
  assert cli.main(['tier', str(tier), '--gc', '--json']) == 0
  obj = json.loads(capsys.readouterr().out)
  assert sorted((x['root'], x['step'], x['reason']) for x in obj['removed']) == [
      (str(a), 1, 'gone'), (str(b), 1, 'stale')]
  assert _tree(tier) == {str(a): ['2']}
  assert cli.main(['tier', str(tier), '--json']) == 0  # what is left is ok


def test_cli_gc_drops_entries_of_steps_gone_from_gs(tmp_path, gcs_bucket, capsys):
  """A gs:// checkpoint directory: a save never lists storage for other directories' entries;
  by hand, one listing of the directory finds the step gone and its entry goes."""
  tier = tmp_path / 'tier'
  path = gcs_bucket.path('ckpt')
  _save(path, [1, 2], tier_dir=str(tier), tier_keep=2)
  assert sorted(e.step for e in tier_store.entries(str(tier), path)) == [1, 2]
  epath.Path(path, '1').rmtree()
  for e in tier_store.entries(str(tier)):
    _age(e.path, 10 * 60)
  assert cli.main(['tier', str(tier), '--gc', '--json']) == 0
  obj = json.loads(capsys.readouterr().out)
  assert [(x['root'], x['step'], x['reason']) for x in obj['removed']] == [(path, 1, 'gone')]
  assert [e.step for e in tier_store.entries(str(tier), path)] == [2]
