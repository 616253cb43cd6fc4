"""Unchanged CheckpointManager code, through ProxyArrayHandler, on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax_pathways
from orbax_pathways.storage import meta_io

from support import ckpt
from support import procs
from support.arrays import assert_trees_equal, mesh, put, random_state
from support.workers import handler_worker

# An exception nobody could raise (a callback into a closed event loop) or a coroutine never
# awaited fails the test.
pytestmark = [pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning'),
              pytest.mark.filterwarnings('error:coroutine .* was never awaited:RuntimeWarning')]


def test_registered_handler_is_ours():
  h = ocp.type_handlers.get_type_handler(jax.Array)
  assert type(h) is orbax_pathways.ProxyArrayHandler
  assert h.typestr() == 'jax.Array'
  assert h._array_metadata_store is not None  # keeps write_shape / PRNG metadata for stock readers


def test_install_idempotent_and_uninstall_restores_previous():
  ours = orbax_pathways.installed()
  assert ours is not None
  assert orbax_pathways.install() is ours
  orbax_pathways.uninstall()
  try:
    stock = ocp.type_handlers.get_type_handler(jax.Array)
    assert type(stock) is ocp.type_handlers.ArrayHandler
    assert orbax_pathways.installed() is None
    orbax_pathways.uninstall()  # no-op
  finally:
    again = orbax_pathways.install()
  assert ocp.type_handlers.get_type_handler(jax.Array) is again
  orbax_pathways.uninstall()
  assert ocp.type_handlers.get_type_handler(jax.Array) is stock  # the very same object
  orbax_pathways.install()


def test_opt_out_environment_variable():
  proc = procs.run_worker(handler_worker, 'registered', env={'ORBAX_PATHWAYS_DISABLE': '1'})
  assert proc.stdout.strip().endswith('ArrayHandler')
  assert 'Proxy' not in proc.stdout


def test_install_logs_what_it_installed():
  proc = procs.run_worker(handler_worker, 'install_log', fresh=True)
  assert 'installed ProxyArrayHandler for jax.Array' in proc.stderr


def test_save_and_restore_are_served_by_our_handler(tmp_path):
  m = mesh()
  state = random_state(m)
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(1, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    st = orbax_pathways.stats.last_save()
    assert st.transport == 'in_process' and st.arrays == 4
    assert st.written_bytes['p0'] == sum(
        x.nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
    restored = mngr.restore(1, args=ocp.args.StandardRestore(state))
  rst = orbax_pathways.stats.last_restore()
  assert rst.arrays == 4 and rst.chunks_verified > 0
  assert_trees_equal(restored, state)
  for leaf, target in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    if isinstance(target, jax.Array):
      assert leaf.sharding == target.sharding
  record = meta_io.read_item(tmp_path / '1' / 'default')
  assert set(record.arrays()) == {'params.w', 'params.b', 'params.e', 'opt.mu', 'step'}
  assert record.transports() == {'local'}


# Every dtype and sharding kind (sharded, replicated, partly replicated, single-device, scalars,
# zero-size, PRNG keys) round-trips in the transport conformance suite, which runs for the local
# transport too (support/conformance.py, tests/transports/test_transport_conformance.py).


def test_64_bit_dtypes_round_trip(tmp_path):
  procs.run_worker(handler_worker, 'x64', tmp_path)


def test_restore_onto_a_different_mesh_with_explicit_target(tmp_path):
  m = mesh()
  value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(0, args=ocp.args.StandardSave({'a': put(value, m, 'data', 'model')}))
    mngr.wait_until_finished()
    m2 = mesh((2, 2), ('x', 'y'), jax.devices()[4:])
    target = {'a': jax.ShapeDtypeStruct(value.shape, jnp.bfloat16, sharding=NamedSharding(m2, P(None, ('x', 'y'))))}
    r = mngr.restore(0, args=ocp.args.StandardRestore(target))
  assert r['a'].dtype == jnp.bfloat16 and r['a'].sharding == target['a'].sharding
  np.testing.assert_array_equal(np.asarray(r['a']), value.astype(jnp.bfloat16))


def test_shape_mismatch_error_names_array_path_and_fix(tmp_path):
  m = mesh()
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(0, args=ocp.args.StandardSave({'a': put(np.zeros((8, 4), np.float32), m, 'data')}))
    mngr.wait_until_finished()
    target = {'a': jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=NamedSharding(m, P()))}
    # Stock's exception type and key phrase, plus the array, its path and the fix.
    with pytest.raises(ValueError, match=r"Array 'a' at .*0/default/a: Requested shape: \(8, 6\) is "
                                         r"not compatible with the stored shape: \(8, 4\).*strict=False"):
      mngr.restore(0, args=ocp.args.StandardRestore(target))


def test_checkpoint_manager_features(tmp_path):
  m = mesh()
  options = ocp.CheckpointManagerOptions(
      max_to_keep=2, save_interval_steps=2, best_fn=lambda metrics: metrics['loss'],
      best_mode='min', keep_checkpoints_without_metrics=False)
  losses = {0: 5.0, 2: 1.0, 4: 3.0, 6: 4.0}
  with ocp.CheckpointManager(tmp_path, options=options) as mngr:
    for step in range(7):
      state = {'w': put(np.full((8, 4), step, np.float32), m, 'data')}
      saved = mngr.save(step, args=ocp.args.StandardSave(state),
                        metrics={'loss': losses.get(step, 9.0)})
      assert saved == (step % 2 == 0)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 4]  # the two best by loss
    assert mngr.best_step() == 2
    r = mngr.restore(4)
  np.testing.assert_array_equal(np.asarray(r['w']), np.full((8, 4), 4, np.float32))


def test_pytree_and_composite_items_and_partial_restore(tmp_path):
  m = mesh()
  state = random_state(m)
  extra = {'ema': put(np.ones((16, 8), np.float32), m, None, 'model')}
  with ocp.CheckpointManager(tmp_path, item_names=('state', 'extra')) as mngr:
    mngr.save(0, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                         extra=ocp.args.StandardSave(extra)))
    mngr.wait_until_finished()
    r = mngr.restore(0, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(state, restore_args=ocp.checkpoint_utils.construct_restore_args(state)),
        extra=ocp.args.StandardRestore(extra)))
    assert_trees_equal(r.state, state)
    assert_trees_equal(r.extra, extra)
  with ocp.CheckpointManager(tmp_path, item_names=('state', 'extra')) as mngr:
    partial = {'params': {'w': state['params']['w']}}
    r = mngr.restore(0, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        partial, restore_args=ocp.checkpoint_utils.construct_restore_args(partial),
        partial_restore=True)))
  assert_trees_equal(r.state, partial)


def test_chunks_are_bounded_and_recorded(tmp_path):
  m = mesh((8,), ('x',))
  value = np.random.default_rng(0).standard_normal((256, 512), dtype=np.float32)  # 512 KiB
  with ckpt.options(max_chunk_bytes=16 * 1024) as handler:
    with ocp.CheckpointManager(tmp_path) as mngr:
      mngr.save(0, args=ocp.args.StandardSave({'a': put(value, m, 'x', None)}))
      mngr.wait_until_finished()
      rec = meta_io.read_item(tmp_path / '0' / 'default').arrays()['a']
      assert np.prod(rec.chunk_shape) * 4 <= 16 * 1024
      assert rec.chunk_shape[1] < 512  # columns split too, not only the sharded rows
      assert sum(c.nbytes for c in rec.chunks) == value.nbytes
      assert len({c.origin for c in rec.chunks}) == len(rec.chunks)
      np.testing.assert_array_equal(np.asarray(mngr.restore(0)['a']), value)
  assert handler is not orbax_pathways.installed()  # back to default options


def test_save_blocks_only_for_snapshot(tmp_path):
  """save() returns with the step still uncommitted; wait_until_finished() commits it."""
  m = mesh()
  big = {'a': put(np.random.default_rng(0).standard_normal((2048, 4096), dtype=np.float32), m, 'data')}
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(0, args=ocp.args.StandardSave(big))
    listed_while_writing = sorted(p.name for p in tmp_path.iterdir())
    mngr.wait_until_finished()
    assert mngr.all_steps() == [0]
  assert ocp.CheckpointManager(tmp_path).all_steps() == [0]
  # 32 MiB cannot be written and committed before save() returns on this machine: step 0 is not
  # there yet, only its temporary directory (which Orbax may still be creating in the
  # background) and the lease (this job saves here: orbax_pathways.manager.lease).
  assert listed_while_writing in (['0.orbax-checkpoint-tmp', 'orbax-pathways-lease.json'],
                                  ['orbax-pathways-lease.json']), listed_while_writing


def _compressor(item_dir, name, use_zarr3=False):
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  t = ts.open({'driver': 'zarr', 'kvstore': {'driver': 'ocdbt', 'base': f'file://{item_dir}/',
                                             'path': name}}).result()
  return t.spec().to_json()['metadata']['compressor']


@pytest.mark.parametrize('mode', ['auto', 'zstd', 'none'])
def test_compression_policy_by_dtype(tmp_path, mode):
  m = mesh()
  state = {'f': put(np.random.default_rng(0).standard_normal((64, 32), dtype=np.float32), m, 'data'),
           'i': put(np.arange(64 * 32, dtype=np.int32).reshape(64, 32), m, 'data')}
  orbax_pathways.install(orbax_pathways.Options(compression=mode))
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(0, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    assert_trees_equal(mngr.restore(0), state)
  item = tmp_path / '0' / 'default'
  expect_f = {'auto': None, 'zstd': 'zstd', 'none': None}[mode]
  expect_i = {'auto': 'zstd', 'zstd': 'zstd', 'none': None}[mode]
  assert (_compressor(item, 'f') or {}).get('id') == expect_f
  assert (_compressor(item, 'i') or {}).get('id') == expect_i


def test_small_sharded_arrays_are_stored_as_one_chunk(tmp_path):
  """A small array sharded over all 8 devices of this process becomes one chunk (not 8), its
  bytes read back equal on the same and on another layout, and stock Orbax reads it."""
  m = mesh()
  state = random_state(m)
  ckpt.save(tmp_path / 'on', state)
  ckpt.save_with_options(tmp_path / 'off', state, coalesce_bytes=0)
  on = meta_io.read_item(tmp_path / 'on' / '0' / 'default').arrays()
  off = meta_io.read_item(tmp_path / 'off' / '0' / 'default').arrays()
  w = state['params']['w']  # (64, 32) float32 over a (4, 2) mesh: 8 shards of (16, 16)
  assert off['params.w'].chunk_shape == (16, 16) and len(off['params.w'].chunks) == 8
  assert on['params.w'].chunk_shape == (64, 32) and len(on['params.w'].chunks) == 1
  assert on['params.w'].chunks[0].nbytes == w.nbytes
  assert on['opt.mu'].chunk_shape == (64, 32)  # sharded over 'data' only, replicated over 'model'
  ckpt.assert_stock_reads_same(tmp_path / 'on', tmp_path / 'off')
  with ocp.CheckpointManager(tmp_path / 'on') as mngr:
    assert_trees_equal(mngr.restore(0, args=ocp.args.StandardRestore(state)), state)
    small = mesh((2,), ('x',))  # another layout, on two devices: w split over its columns
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(small, P(None, 'x') if x.ndim == 2 else P()))
        if isinstance(x, jax.Array) else x, state)
    got = mngr.restore(0, args=ocp.args.StandardRestore(target))
    assert_trees_equal(got, state)
    assert got['params']['w'].sharding.device_set == set(small.devices.flat)


@pytest.mark.parametrize('mode', ['pinned', 'host'])
def test_snapshot_modes_copy_before_save_returns(tmp_path, mode):
  """After save() returns, the caller may delete (or donate) its arrays: what lands on disk is
  what they held at save(). 'pinned' copies into pinned_host memory (the accelerator default;
  the CPU backend has that memory kind too, so the same code runs here)."""
  m = mesh()
  rng = np.random.default_rng(5)
  big = rng.standard_normal((1024, 512), dtype=np.float32)  # 2 MiB: one piece per shard
  state = {'big': put(big, m, 'data', 'model'), 'rep': put(big[:256], m, None, None),
           'small': put(big[0, :64], m, ('data', 'model'))}
  want = jax.tree.map(np.asarray, state)
  with ckpt.options(snapshot=mode), ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(0, args=ocp.args.StandardSave(state))
    assert orbax_pathways.stats.last_save().snapshot == mode
    for x in state.values():
      x.delete()
    mngr.wait_until_finished()
    got = mngr.restore(0)
  assert_trees_equal(got, want)


def test_snapshot_auto_is_host_on_cpu_and_rejects_unknown_modes(tmp_path):
  m = mesh()
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(0, args=ocp.args.StandardSave({'a': put(np.arange(64.0), m, 'data')}))
    mngr.wait_until_finished()
  assert orbax_pathways.stats.last_save().snapshot == 'host'  # CPU devices: np.asarray aliases
  with pytest.raises(ValueError, match="snapshot='gpu': use 'auto', 'pinned' or 'host'"):
    orbax_pathways.Options(snapshot='gpu')


def test_one_log_line_per_save_and_per_commit_with_their_times(tmp_path, caplog):
  m = mesh()
  state = {'a': put(np.arange(1 << 18, dtype=np.float32).reshape(256, 1024), m, 'data', 'model')}
  with caplog.at_level('INFO', logger='orbax_pathways'):
    with ocp.CheckpointManager(tmp_path) as mngr:
      mngr.save(3, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()
  st = orbax_pathways.stats.last_save()
  assert 0 < st.blocking_s < st.commit_s
  saved = [r.getMessage() for r in caplog.records if ' saved 1 arrays' in r.getMessage()]
  committed = [r.getMessage() for r in caplog.records if 'step 3 committed' in r.getMessage()]
  assert len(saved) == 1 and '1.0 MiB from p0 (in_process, host snapshot)' in saved[0]
  assert len(committed) == 1, [r.getMessage() for r in caplog.records]
  assert f'{st.commit_s:.2f} s after save()' in committed[0]
  assert 'wrote 1.0 MiB of arrays' in committed[0] and str(tmp_path) in committed[0]


def test_phases_show_in_a_jax_profile(tmp_path):
  """What TensorBoard / xprof would show: the profile of a save and a restore names our phases."""
  m = mesh()
  state = {'a': put(np.ones((256, 1024), np.float32), m, 'data', 'model')}
  with jax.profiler.trace(str(tmp_path / 'trace')):
    with ocp.CheckpointManager(tmp_path / 'ckpt') as mngr:
      mngr.save(0, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()
      mngr.restore(0, args=ocp.args.StandardRestore(state))
  blobs = b''.join(p.read_bytes() for p in (tmp_path / 'trace').rglob('*.xplane.pb'))
  for phase in ('plan', 'snapshot', 'write', 'commit', 'read', 'device_put'):
    assert f'orbax_pathways.{phase}'.encode() in blobs, phase
