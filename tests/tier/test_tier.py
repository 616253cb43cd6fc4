"""The node-local tier: each save leaves this host's chunks in a node-local
directory; a restore of that committed step reads them first, checked against storage's
checksums, and falls back to storage for anything missing, stale or damaged.

Single-process cases here (real Orbax CheckpointManager, real tensorstore, real files); the
multi-process ones (fewer devices, SIGKILL after commit) in ``test_tier_multiprocess.py``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways.cli import main as cli
from orbax_pathways import engine
from orbax_pathways import stats
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import sources as plan_sources
from orbax_pathways.storage import meta_io
from orbax_pathways.tier import manifest as tier_layout
from orbax_pathways.tier import config as tier_config
from orbax_pathways.tier import store as tier_store
from support import procs

P = jax.sharding.PartitionSpec
Box = boxes_lib.Box


def _state(seed: int = 0):
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('x', 'y'))
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((256, 64)).astype(np.float32)
  b = rng.integers(0, 1000, (32,)).astype(np.int32)
  return {
      'w': jax.device_put(w, jax.sharding.NamedSharding(mesh, P('x', 'y'))),
      'b': jax.device_put(b, jax.sharding.NamedSharding(mesh, P())),
  }, {'w': w, 'b': b}


def _install(tier_dir, **kw):
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier_dir), **kw))


def _save(root, steps, seed=0):
  state, host = _state(seed)
  with ocp.CheckpointManager(root) as m:
    for s in steps:
      m.save(s, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
  tier_store.flush()  # the tier copy lands in the background, after the commit
  return state, host


def _restore(root, step, state):
  with ocp.CheckpointManager(root) as m:
    out = m.restore(step, args=ocp.args.StandardRestore(state))
  return out, stats.last_restore()


def _assert_exact(out, host):
  for k, v in host.items():
    np.testing.assert_array_equal(np.asarray(out[k]), v)


def _entries(tier, root=None):
  return tier_store.entries(str(tier), None if root is None else str(root))


def _chain_lines(caplog):
  return [r for r in caplog.records if 'node-local copy' in r.getMessage()]


def test_same_topology_restore_reads_nothing_from_storage(tmp_path):
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier)
  state, host = _save(root, [1])
  out, st = _restore(root, 1, state)
  _assert_exact(out, host)
  total = sum(v.nbytes for v in host.values())
  assert st.bytes_by_source.get('storage') == 0
  assert st.bytes_by_source.get('local') == total
  assert st.chunks_verified > 0
  (e,) = _entries(tier, root)
  assert e.committed and e.manifest is not None and e.manifest.nbytes == total
  # The save id the tier entry carries is the one storage's committed index records.
  item = meta_io.read_item(str(root / '1' / 'default'))
  assert {w.writer: w.save_id for w in item.writers} == {'p0': e.save_id}


def test_the_tier_copy_is_off_the_commit_path(tmp_path, monkeypatch):
  """A step commits when storage has it: a tier copy held back (a slow node-local disk) does
  not hold the commit; it lands later, is marked committed then, and serves the restore."""
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier)
  gate, real = threading.Event(), tier_store.write_entry

  def held_back(*args, **kwargs):  # the real copy, once the test lets it go
    gate.wait(120)
    return real(*args, **kwargs)

  monkeypatch.setattr(tier_store, 'write_entry', held_back)
  state, host = _state()
  with ocp.CheckpointManager(root) as m:
    m.save(1, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
    assert m.all_steps() == [1] and not _entries(tier, root)  # committed, copy still queued
    gate.set()
    assert tier_store.flush(120)
    (e,) = _entries(tier, root)
    assert e.committed and e.manifest is not None  # its step had committed: marked on landing
    out = m.restore(1, args=ocp.args.StandardRestore(state))
  _assert_exact(out, host)
  assert stats.last_restore().bytes_by_source.get('storage') == 0


def test_keeps_tier_keep_steps_and_drops_older_after_commit(tmp_path):
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier, tier_keep=2)
  state, host = _save(root, [1, 2, 3])
  assert sorted(e.step for e in _entries(tier, root)) == [2, 3]
  assert all(e.committed for e in _entries(tier, root))
  out, st = _restore(root, 2, state)
  _assert_exact(out, host)
  assert st.bytes_by_source.get('storage') == 0


def test_flipped_byte_in_a_local_chunk_falls_back_to_storage(tmp_path, caplog):
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier)
  state, host = _save(root, [1])
  (e,) = _entries(tier, root)
  w = next(a for a in e.manifest.arrays if a.name == 'w')
  path = os.path.join(e.path, w.files[0])
  with open(path, 'r+b') as f:
    f.seek(5)
    byte = f.read(1)
    f.seek(5)
    f.write(bytes([byte[0] ^ 0x10]))
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  out, st = _restore(root, 1, state)
  _assert_exact(out, host)
  assert st.bytes_by_source['storage'] == w.nbytes[0]
  assert st.bytes_by_source['local'] == sum(v.nbytes for v in host.values()) - w.nbytes[0]
  lines = _chain_lines(caplog)
  assert len(lines) == 1, [r.getMessage() for r in lines]
  assert 'damaged' in lines[0].getMessage() and "'w'" in lines[0].getMessage()


def test_missing_local_chunk_falls_back_to_storage(tmp_path, caplog):
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier)
  state, host = _save(root, [1])
  (e,) = _entries(tier, root)
  w = next(a for a in e.manifest.arrays if a.name == 'w')
  os.remove(os.path.join(e.path, w.files[-1]))
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  out, st = _restore(root, 1, state)
  _assert_exact(out, host)
  assert st.bytes_by_source['storage'] == w.nbytes[-1]
  assert len(_chain_lines(caplog)) == 1


def test_another_save_of_the_same_step_is_stale(tmp_path, caplog):
  """The tier holds step 1 of a first save; step 1 is deleted and saved again with other
  values (the tier off meanwhile): the old copy must not be used."""
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier)
  _save(root, [1], seed=0)
  (old,) = _entries(tier, root)
  shutil.rmtree(root / '1')
  _install('off')
  state, host = _save(root, [1], seed=1)
  assert [e.path for e in _entries(tier, root)] == [old.path]  # 'off' wrote nothing
  _install(tier)
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  out, st = _restore(root, 1, state)
  _assert_exact(out, host)
  assert st.bytes_by_source.get('local', 0) == 0
  assert st.bytes_by_source['storage'] == sum(v.nbytes for v in host.values())
  lines = _chain_lines(caplog)
  assert len(lines) == 1 and 'stale' in lines[0].getMessage(), [r.getMessage() for r in lines]


def test_an_older_step_in_the_tier_is_not_used(tmp_path):
  """A node lost during a save: its tier holds step 1, storage's newest is step 2."""
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier)
  _save(root, [1], seed=0)
  _install('off')
  state, host = _save(root, [2], seed=1)
  _install(tier)
  assert [e.step for e in _entries(tier, root)] == [1]
  out, st = _restore(root, 2, state)
  _assert_exact(out, host)
  assert st.bytes_by_source.get('local', 0) == 0


def test_off_writes_nothing(tmp_path):
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  tier.mkdir()
  _install('off')
  state, host = _save(root, [1])
  assert os.listdir(tier) == []
  out, st = _restore(root, 1, state)
  _assert_exact(out, host)
  assert st.bytes_by_source == {'storage': sum(v.nbytes for v in host.values())}


def test_unwritable_tier_directory_skips_with_one_warning(tmp_path, caplog):
  blocker = tmp_path / 'a_file'
  blocker.write_text('not a directory')
  tier, root = blocker / 'tier', tmp_path / 'ckpt'
  _install(tier)
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  state, host = _save(root, [1, 2])
  warnings = [r for r in caplog.records if 'node-local tier skipped' in r.getMessage()]
  assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
  assert str(tier) in warnings[0].getMessage()
  out, st = _restore(root, 2, state)
  _assert_exact(out, host)
  assert st.bytes_by_source == {'storage': sum(v.nbytes for v in host.values())}


def _mount_tmpfs(path, *options):
  path.mkdir()
  # mode=0700: a private tier directory (tmpfs's own default, 1777, is refused as writable by
  # other users before its room or its read-only state would matter)
  r = procs.run(['mount', '-t', 'tmpfs', '-o', ','.join(('size=1m', 'mode=0700') + options),
                 'tmpfs', path], check=False, timeout=60)
  if r.returncode:
    pytest.skip(f'cannot mount a tmpfs here (needs root): {r.stderr.strip()}')


@pytest.mark.parametrize('kind', ['full', 'read-only'])
def test_full_or_read_only_tmpfs_skips_with_one_warning(tmp_path, caplog, kind):
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _mount_tmpfs(tier, *(('ro',) if kind == 'read-only' else ()))
  try:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
    big = np.arange(2 << 20, dtype=np.float32) if kind == 'full' else np.arange(8, dtype=np.float32)
    state = {'big': jax.device_put(big, jax.sharding.NamedSharding(mesh, P('x')))}
    _install(tier)
    caplog.set_level(logging.INFO, logger='orbax_pathways')
    with ocp.CheckpointManager(root) as m:
      m.save(1, args=ocp.args.StandardSave(state))
      m.save(2, args=ocp.args.StandardSave(state))
      m.wait_until_finished()
      tier_store.flush()
      out = m.restore(2, args=ocp.args.StandardRestore(state))
    np.testing.assert_array_equal(np.asarray(out['big']), big)
    warnings = [r.getMessage() for r in caplog.records
                if 'node-local tier skipped' in r.getMessage()]
    assert len(warnings) == 1, warnings
    if kind == 'full':  # the numbers, and the margin (none: the directory was set explicitly)
      assert f"share of {root}/1" in warnings[0] and 'bytes are free' in warnings[0]
      assert 'an explicit directory leaves no safety margin' in warnings[0]
    else:
      assert 'Read-only file system' in warnings[0]
    assert os.listdir(tier) == []  # a skipped copy leaves no folders behind
  finally:
    procs.run(['umount', tier], check=False, timeout=60)


def test_cli_tier_lists_and_verifies(tmp_path, capsys):
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier, tier_keep=2)
  _save(root, [1, 2])
  assert cli.main(['tier', str(tier), '--json']) == 0
  obj = json.loads(capsys.readouterr().out)
  assert [(e['step'], e['item'], e['writer'], e['status']) for e in obj['entries']] == [
      (1, 'default', 'p0', 'ok'), (2, 'default', 'p0', 'ok')]
  assert obj['entries'][0]['root'] == str(root)
  e = _entries(tier, root)[1]
  with open(os.path.join(e.path, e.manifest.arrays[0].files[0]), 'r+b') as f:
    f.write(b'\xff\xff')
  assert cli.main(['tier', str(tier)]) == 1
  text = capsys.readouterr().out
  assert 'damaged' in text and str(root) in text


def test_plan_sources_splits_a_region_chunk_by_chunk():
  region = Box((0, 0), (8, 8))
  held = [{(0, 0), (4, 4)}, {(0, 4), (0, 0)}]
  plan = plan_sources.assign(region, (4, 4), (8, 8), held)
  assert plan.chunks == ((0, Box((0, 0), (4, 4))), (1, Box((0, 4), (4, 8))),
                         (0, Box((4, 4), (8, 8))))
  assert plan.storage == (Box((4, 0), (8, 4)),)
  assert plan_sources.assign(region, (4, 4), (8, 8), [set()]).storage == (region,)
  assert plan_sources.assign(region, (4, 4), (8, 8), []).storage == (region,)


def test_keep_steps_drops_only_what_a_newer_committed_step_replaces():
  assert tier_layout.keep_steps([(1, True), (2, False)], 1) == {1, 2}
  assert tier_layout.keep_steps([(1, True), (2, True)], 1) == {2}
  assert tier_layout.keep_steps([(1, True), (2, True), (3, False)], 2) == {1, 2, 3}
  assert tier_layout.keep_steps([(1, False), (2, False), (3, False)], 1) == {2, 3}


def test_colocated_workers_write_and_read_their_tier(tmp_path, caplog):
  """Under the colocated transport each worker host writes its own chunks to its node's tier
  (in the CPU simulation: in-process, one node) and reads them back first."""
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier, transport='colocated')
  state, host = _state()
  state['key'] = jax.random.key(3)  # a second device set: a second colocated call per save
  with ocp.CheckpointManager(root) as m:
    m.save(1, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
    written = stats.last_save().written_bytes
    found = _entries(tier, root)
    assert {e.writer for e in found} == set(written)
    assert {e.writer: e.manifest.nbytes for e in found} == written
    item = meta_io.read_item(str(root / '1' / 'default'))
    assert {w.writer: w.save_id for w in item.writers} == {e.writer: e.save_id for e in found}
    out = m.restore(1, args=ocp.args.StandardRestore(state))
    st = stats.last_restore()
    assert st.transport == 'colocated'
    assert st.bytes_by_source.get('storage') == 0, st
    # Every simulated worker shares the one node's tier: replicas another worker wrote too.
    assert st.bytes_by_source.get('local') == sum(st.bytes_read.values())
    _assert_exact({k: out[k] for k in host}, host)
    # A flipped byte in a worker's local chunk: that chunk comes from storage, one log line.
    e = next(e for e in found if any(a.name == 'w' for a in e.manifest.arrays))
    w = next(a for a in e.manifest.arrays if a.name == 'w')  # sharded: one reader needs it
    with open(os.path.join(e.path, w.files[0]), 'r+b') as f:
      f.write(b'\x00\x01\x02\x03' if f.read(4) != b'\x00\x01\x02\x03' else b'\x09\x09\x09\x09')
    caplog.set_level(logging.INFO, logger='orbax_pathways')
    out = m.restore(1, args=ocp.args.StandardRestore(state))
  _assert_exact({k: out[k] for k in host}, host)
  assert stats.last_restore().bytes_by_source['storage'] == w.nbytes[0]
  assert len(_chain_lines(caplog)) == 1


def test_scalars_and_zero_size_arrays_restore_from_the_tier(tmp_path):
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier)
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  host = {'s': np.float32(2.5), 'e': np.zeros((0, 3), np.float32), 'v': np.arange(5.0)}
  state = {k: jax.device_put(v, dev) for k, v in host.items()}
  with ocp.CheckpointManager(root) as m:
    m.save(1, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
    tier_store.flush()
    out = m.restore(1, args=ocp.args.StandardRestore(state))
  _assert_exact(out, host)
  assert stats.last_restore().bytes_by_source.get('storage') == 0


def test_v1_save_and_load_use_the_tier(tmp_path):
  """``ocp.v1`` has no manager commit hook: the entry stays unmarked, and is used because the
  committed index records its save id. Directories that are not step numbers are kept by age."""
  tier = tmp_path / 'tier'
  _install(tier, tier_keep=1)
  state, host = _state()
  for name in ('a', 'b', 'c'):
    ocp.v1.save(tmp_path / name, state)
  tier_store.flush()
  assert sorted(e.step_name for e in _entries(tier, tmp_path)) == ['b', 'c']
  out = ocp.v1.load(tmp_path / 'c', jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state))
  _assert_exact(out, host)
  st = stats.last_restore()
  assert st.bytes_by_source.get('storage') == 0
  assert st.bytes_by_source.get('local') == sum(v.nbytes for v in host.values())


def test_colocated_workers_of_a_lost_slice_come_from_storage_onto_fewer_devices(tmp_path):
  """The colocated transport with one slice's workers lost (their tier entries gone): a
  restore onto fewer devices takes every chunk the surviving workers hold from the tier and
  exactly the lost workers' chunks from storage, bit-exact."""
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier, transport='colocated')
  state, host = _state()
  with ocp.CheckpointManager(root) as m:
    m.save(1, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
  tier_store.flush()
  lost_rows = 192  # mesh row x=3 holds rows 192..255 of 'w': that slice's workers are lost
  lost = [e for e in _entries(tier, root)
          if any(a.name == 'w' and any(o[0] == lost_rows for o in a.origins)
                 for a in e.manifest.arrays)]
  assert lost
  lost_w = sum(n for e in lost for a in e.manifest.arrays if a.name == 'w' for n in a.nbytes)
  lost_paths = {e.path for e in lost}
  lost_b = not any(a.name == 'b' for e in _entries(tier, root) if e.path not in lost_paths
                   for a in e.manifest.arrays)  # no surviving worker holds a copy of 'b'
  for e in lost:
    shutil.rmtree(e.path)
  half = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ('x', 'y'))
  target = {
      'w': jax.ShapeDtypeStruct((256, 64), np.float32,
                                sharding=jax.sharding.NamedSharding(half, P('x', 'y'))),
      'b': jax.ShapeDtypeStruct((32,), np.int32, sharding=jax.sharding.NamedSharding(half, P())),
  }
  with ocp.CheckpointManager(root) as m:
    out = m.restore(1, args=ocp.args.StandardRestore(target))
  _assert_exact(out, host)
  st = stats.last_restore()
  # Each lost chunk of 'w' is needed by exactly one of the 4 new devices; 'b' (replicated, 128
  # bytes) by all 4, from storage only if no surviving worker holds it.
  assert st.bytes_by_source.get('storage') == lost_w + (4 * host['b'].nbytes if lost_b else 0), st
  assert st.bytes_by_source.get('local', 0) > 0, st


def _modes(tree):
  """{path relative to ``tree``: (kind, mode)} of everything under it (lstat)."""
  out = {}
  for d, dirs, files in os.walk(tree):
    for n in dirs + files:
      st = os.lstat(os.path.join(d, n))
      out[os.path.relpath(os.path.join(d, n), tree)] = (
          'dir' if stat.S_ISDIR(st.st_mode) else 'file' if stat.S_ISREG(st.st_mode) else 'other',
          stat.S_IMODE(st.st_mode))
  return out


def test_a_saved_tier_is_private_to_its_user(tmp_path):
  """Tier directories are 0700 and files 0600 after a real save (nobody else on the node can
  read the checkpoint's values), the tier directory itself included."""
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier, tier_keep=2)
  _save(root, [1, 2])
  assert stat.S_IMODE(os.lstat(tier).st_mode) == 0o700
  found = _modes(tier)
  assert {k for k, _ in found.values()} == {'dir', 'file'} and len(found) > 8
  assert {m for k, m in found.values() if k == 'dir'} == {0o700}, found
  assert {m for k, m in found.values() if k == 'file'} == {0o600}, found


def test_an_existing_tier_readable_by_others_is_made_private(tmp_path):
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  tier.mkdir()
  os.chmod(tier, 0o755)
  _install(tier)
  _save(root, [1])
  assert stat.S_IMODE(os.lstat(tier).st_mode) == 0o700
  assert len(_entries(tier, root)) == 1


@pytest.mark.parametrize('mode', [0o777, 0o775])
def test_a_tier_others_can_write_into_is_not_used(tmp_path, caplog, mode):
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  tier.mkdir()
  os.chmod(tier, mode)
  _install(tier)
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  state, host = _save(root, [1, 2])
  out, st = _restore(root, 2, state)
  _assert_exact(out, host)
  assert st.bytes_by_source == {'storage': sum(v.nbytes for v in host.values())}
  assert os.listdir(tier) == [] and stat.S_IMODE(os.lstat(tier).st_mode) == mode
  warnings = [r.getMessage() for r in caplog.records if 'node-local tier skipped' in r.getMessage()]
  assert len(warnings) == 1 and 'other users can write into it' in warnings[0], warnings


# ---- the default --------------------------------------------------------------------------------


def test_the_default_tier_is_kept_only_where_it_saves_a_storage_read(tmp_path):
  assert not tier_config.default_applies(False, 1, False)  # local disk, one process
  assert tier_config.default_applies(True, 1, False)  # gs:// or network storage
  assert tier_config.default_applies(False, 2, False)  # a job of several processes
  assert tier_config.default_applies(False, 1, True)  # Pathways workers
  assert tier_config.storage_is_remote('gs://bucket/run')
  assert not tier_config.storage_is_remote('file:///tmp/run')
  assert not tier_config.storage_is_remote(str(tmp_path / 'ckpt'))


def test_no_default_tier_for_a_local_directory_of_one_process(tmp_path, monkeypatch, caplog):
  """Options.tier_dir unset, ORBAX_PATHWAYS_TIER_DIR unset: a one-process save into a local
  directory gets no tier (said once); an explicit directory or 'off' mean what they say."""
  monkeypatch.delenv(tier_config.ENV, raising=False)
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  item = str(tmp_path / 'ckpt' / '1' / 'default')
  assert engine.Engine(orbax_pathways.Options()).tier(item) is None
  assert engine.Engine(orbax_pathways.Options()).tier(item) is None
  said = [r.getMessage() for r in caplog.records if 'no node-local tier for' in r.getMessage()]
  assert len(said) == 1 and 'ORBAX_PATHWAYS_TIER_DIR' in said[0]
  explicit = engine.Engine(orbax_pathways.Options(tier_dir=str(tmp_path / 't'))).tier(item)
  assert explicit is not None and explicit.tier_dir == str(tmp_path / 't')
  assert engine.Engine(orbax_pathways.Options(tier_dir='off')).tier(item) is None
  monkeypatch.setenv(tier_config.ENV, str(tmp_path / 'node'))
  assert engine.Engine(orbax_pathways.Options()).tier(item).tier_dir == str(tmp_path / 'node')


def test_the_default_tier_on_a_real_node(tmp_path, gcs_bucket):
  """With nothing set, in a private /dev/shm: a one-process save into a local directory leaves
  nothing in /dev/shm; a save to gs:// keeps this host's share in
  /dev/shm/orbax-pathways-<uid> (0700 directories, 0600 files) and the restore reads it."""
  from support import private_shm  # pylint: disable=g-import-not-at-top
  from support.workers import default_tier_worker  # pylint: disable=g-import-not-at-top
  r = private_shm.run(default_tier_worker, {'local': str(tmp_path / 'ckpt'), 'gs': gcs_bucket.path('ckpt')})
  total = 8 * 4096 * 4
  assert r['local'] == [True, {'storage': total}] and r['after_local'] == []
  assert r['remote'][0] and r['remote'][1].get('local') == total, r['remote']
  name = f'orbax-pathways-{os.geteuid()}'
  assert r['shm'] == [name]
  dirs = {m for k, (d, m) in r['tree'].items() if d}
  files = {m for k, (d, m) in r['tree'].items() if not d}
  assert dirs == {0o700} and files == {0o600}, r['tree']


# ---- what the tier must not hide ----------------------------------------------------------------


def test_cli_tier_says_damaged_when_a_manifest_records_another_dtype(tmp_path, capsys):
  """Only the dtype edited in a tier manifest (float32 -> int32, same bytes, so every crc32c
  still matches): ``orbax-pathways tier`` compares the layout with storage's committed records
  and reports the entry damaged, naming both dtypes."""
  from orbax_pathways.tier import fsafe  # pylint: disable=g-import-not-at-top
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier)
  _save(root, [1])
  assert cli.main(['tier', str(tier)]) == 0
  capsys.readouterr()
  (e,) = _entries(tier, root)
  m = e.manifest
  edited = tier_layout.Manifest(**{**m.__dict__, 'arrays': tuple(
      tier_layout.TierArray(**{**a.__dict__, 'dtype': 'int32'}) if a.name == 'w' else a
      for a in m.arrays)})
  fsafe.write_file(os.path.join(e.path, tier_layout.MANIFEST), tier_layout.encode(edited))
  assert cli.main(['tier', str(tier), '--json']) == 1
  (x,) = json.loads(capsys.readouterr().out)['entries']
  assert x['status'] == 'damaged'
  assert x['problems'] == ["array 'w': dtype int32, committed float32"]


def test_a_restore_the_tier_serves_says_storage_was_not_read_and_verify_checks_it(
    tmp_path, caplog, capsys):
  """A flipped byte in a storage chunk while the tier holds an intact copy: the restore is
  served from the tier (exact values) and says, once, that storage was not read and that
  ``orbax-pathways verify`` checks it; ``verify`` finds the damage."""
  from support import damage  # pylint: disable=g-import-not-at-top
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  _install(tier)
  state, host = _save(root, [1])
  needle = np.ascontiguousarray(host['w'][:8, :8]).tobytes()[:32]
  files = sorted((root / '1').rglob('*'), key=lambda p: -p.stat().st_size if p.is_file() else 0)
  damage.flip_bit_in(files, needle, what='chunk bytes', offset=5)
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  out, st = _restore(root, 1, state)
  _assert_exact(out, host)
  assert st.bytes_by_source.get('storage') == 0
  said = [r.getMessage() for r in caplog.records if 'were not read and not checked' in
          r.getMessage()]
  assert len(said) == 1, said
  assert f'`orbax-pathways verify {root}/1` checks storage' in said[0]
  assert cli.main(['verify', str(root / '1')]) == 1
  assert 'crc' in capsys.readouterr().out.lower()
  assert cli.main(['verify', '--help']) == 0
  assert 'verify reads storage, never a node-local tier' in capsys.readouterr().out
