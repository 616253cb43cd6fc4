"""Orbax code that works with stock Orbax works the same with orbax_pathways installed: memory
kinds and device layouts, numpy targets, padding/truncation, Orbax's options, and the exception
types (with their key phrases) that user code catches. Everything we read is verified."""

import dataclasses
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax_pathways
from orbax_pathways.format import item as item_lib
from orbax_pathways.storage import meta_io

from support import damage
from support.arrays import abstract, assert_trees_equal, mesh, put


def _value(shape=(256, 64), seed=0):
  return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def _flip_a_byte(item, value):
  """Flips one byte inside the stored (uncompressed float) bytes of ``value``'s first rows."""
  needle = np.ascontiguousarray(value[:8, :8]).tobytes()[:32]
  files = sorted(item.rglob('*'), key=lambda p: -p.stat().st_size if p.is_file() else 0)
  damage.flip_bit_in(files, needle, what='chunk bytes', offset=5)


# ---- memory kinds and device layouts ----------------------------------------------------------

@pytest.mark.parametrize('transport', ['in_process', 'colocated'])
@pytest.mark.parametrize('kind', ['pinned_host', 'unpinned_host'])
def test_host_offloaded_state_saves_and_restores_bit_exact(tmp_path, kind, transport):
  m = mesh()
  sharding = NamedSharding(m, P('data', 'model'), memory_kind=kind)
  state = {'opt': jax.device_put(_value((512, 512)), sharding),  # above the whole-put size
           'small': jax.device_put(_value((16, 8), 1), sharding)}
  orbax_pathways.install(orbax_pathways.Options(transport=transport))
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(0, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    target = abstract(state)
    out = mngr.restore(0, args=ocp.args.StandardRestore(target))
  assert orbax_pathways.stats.last_restore().chunks_verified > 0
  for k in state:
    assert out[k].sharding.memory_kind == kind, k
  assert_trees_equal(out, state)


def test_restore_into_a_format_target_gets_its_layout(tmp_path):
  m = mesh()
  value = _value((512, 256))
  sharding = NamedSharding(m, P('data', 'model'))
  with ocp.CheckpointManager(tmp_path, item_handlers=ocp.PyTreeCheckpointHandler()) as mngr:
    mngr.save(0, args=ocp.args.PyTreeSave({'x': jax.device_put(value, sharding)}))
    mngr.wait_until_finished()
    for major_to_minor in [(1, 0), (0, 1)]:
      fmt = Format(Layout(major_to_minor=major_to_minor), sharding)
      out = mngr.restore(0, args=ocp.args.PyTreeRestore(
          {'x': value}, restore_args={'x': ocp.ArrayRestoreArgs(sharding=fmt, global_shape=value.shape,
                                                                dtype=value.dtype)}))
      assert out['x'].format.layout.major_to_minor == major_to_minor
      np.testing.assert_array_equal(np.asarray(out['x']), value)


# ---- numpy targets, padding and truncation: verified like every other restore -----------------

def _save_w(directory, value):
  with ocp.CheckpointManager(directory) as mngr:
    mngr.save(0, args=ocp.args.StandardSave({'w': put(value, mesh(), 'data', 'model')}))
    mngr.wait_until_finished()


def test_numpy_targets_are_verified(tmp_path):
  value = _value()
  _save_w(tmp_path, value)
  with ocp.CheckpointManager(tmp_path) as mngr:
    out = mngr.restore(0, args=ocp.args.StandardRestore({'w': np.zeros_like(value)}))
  assert isinstance(out['w'], np.ndarray)
  np.testing.assert_array_equal(out['w'], value)
  assert orbax_pathways.stats.last_restore().chunks_verified > 0
  _flip_a_byte(tmp_path / '0' / 'default', value)
  with ocp.CheckpointManager(tmp_path) as mngr:
    with pytest.raises(orbax_pathways.ChecksumMismatchError, match=r"array 'w'"):
      mngr.restore(0, args=ocp.args.StandardRestore({'w': np.zeros_like(value)}))
  handler = ocp.PyTreeCheckpointHandler()
  with ocp.CheckpointManager(tmp_path, item_handlers=handler) as mngr:
    with pytest.raises(orbax_pathways.ChecksumMismatchError, match=r"array 'w'"):
      mngr.restore(0, args=ocp.args.PyTreeRestore(
          {'w': value}, restore_args={'w': ocp.RestoreArgs(restore_type=np.ndarray)}))


@pytest.mark.parametrize('shape', [(256, 80), (200, 64), (300, 48)])
def test_padding_and_truncation_match_stock_and_are_verified(tmp_path, shape):
  value = _value()
  _save_w(tmp_path, value)
  sharding = NamedSharding(mesh(), P('data', 'model'))
  args = ocp.args.PyTreeRestore({'w': value}, restore_args={
      'w': ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, strict=False)})
  with ocp.CheckpointManager(tmp_path, item_handlers=ocp.PyTreeCheckpointHandler()) as mngr:
    out = np.asarray(mngr.restore(0, args=args)['w'])
  expected = np.zeros(shape, np.float32)
  common = tuple(slice(0, min(a, b)) for a, b in zip(shape, value.shape))
  expected[common] = value[common]
  np.testing.assert_array_equal(out, expected)  # zeros where padded, as stock pads
  assert orbax_pathways.stats.last_restore().chunks_verified > 0
  _flip_a_byte(tmp_path / '0' / 'default', value)
  with ocp.CheckpointManager(tmp_path, item_handlers=ocp.PyTreeCheckpointHandler()) as mngr:
    with pytest.raises(orbax_pathways.ChecksumMismatchError):
      mngr.restore(0, args=args)


def test_a_lost_writer_record_is_an_error_not_an_unchecked_chunk(tmp_path):
  """Eight (simulated) Pathways workers write eight chunks; an index that lost one worker's
  checksums (or, before schema 2, a lost record) leaves chunks with no checksum, which restore
  refuses to return unchecked."""
  value = _value((512, 512))
  orbax_pathways.install(orbax_pathways.Options(transport='colocated'))
  _save_w(tmp_path, value)
  item = tmp_path / '0' / 'default'
  md = meta_io.read_item(item)
  w = md.arrays()['w']
  assert len(md.writers) == 8 and len(w.chunks) == 8
  lost = dataclasses.replace(w, chunks=tuple(w.chunks)[:-1])
  meta_io.write_index(item, item_lib.ItemMetadata(md.writers, (lost,), source='index'))
  meta_io.clear_cache()
  assert len(meta_io.read_item(item).arrays()['w'].chunks) == 7
  with ocp.CheckpointManager(tmp_path) as mngr:
    with pytest.raises(orbax_pathways.errors.MissingChecksumError,
                       match=r"Array 'w', chunk at \[\d+, \d+\].*has no recorded checksum"):
      mngr.restore(0)


# ---- Orbax's options ---------------------------------------------------------------------------

def _chunk_shape(item, name):
  return meta_io.read_item(item).arrays()[name].chunk_shape


def test_save_args_chunk_byte_size_caps_our_chunks(tmp_path):
  value = _value((512, 512))  # 1 MiB, one 128 KiB shard per device
  handler = ocp.PyTreeCheckpointHandler()
  with ocp.CheckpointManager(tmp_path, item_handlers=handler) as mngr:
    mngr.save(0, args=ocp.args.PyTreeSave(
        {'w': put(value, mesh(), 'data', 'model')},
        save_args={'w': ocp.SaveArgs(chunk_byte_size=16 * 1024)}))
    mngr.wait_until_finished()
  chunk = _chunk_shape(tmp_path / '0' / 'default', 'w')
  assert np.prod(chunk) * 4 <= 16 * 1024, chunk


def test_enable_pinned_host_transfer_picks_the_snapshot(tmp_path):
  for flag, mode in ((True, 'pinned'), (False, 'host')):
    handler = ocp.PyTreeCheckpointHandler(enable_pinned_host_transfer=flag)
    with ocp.CheckpointManager(tmp_path / str(flag), item_handlers=handler) as mngr:
      mngr.save(0, args=ocp.args.PyTreeSave({'w': put(_value(), mesh(), 'data')}))
      mngr.wait_until_finished()
    assert orbax_pathways.stats.last_save().snapshot == mode


def test_byte_limits_bound_what_is_in_flight_and_restore_exactly(tmp_path):
  """``save_concurrent_gb``/``restore_concurrent_gb`` (Orbax's byte limiters) cap our write
  budget and batch our reads; the values are unchanged."""
  state = {f'a{i}': put(_value((256, 256), i), mesh(), 'data', 'model') for i in range(4)}
  gb = 300 * 1024 / 1e9  # 300 KB: about one array at a time
  handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=gb, restore_concurrent_gb=gb)
  with ocp.CheckpointManager(tmp_path, item_handlers=handler) as mngr:
    mngr.save(0, args=ocp.args.PyTreeSave(state))
    mngr.wait_until_finished()
    target = abstract(state)
    out = mngr.restore(0, args=ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
  assert_trees_equal(out, state)


def test_serialization_status_callback_hears_every_array(tmp_path):
  from orbax.checkpoint._src.serialization import types as orbax_types  # pylint: disable=g-import-not-at-top
  events = []

  class Callback(orbax_types.DefaultSerializationStatusCallback):
    def on_transfer_end(self, keypath):
      events.append(('transfer', jax.tree_util.keystr(keypath)))

    def on_write_end(self, keypath):
      events.append(('write', jax.tree_util.keystr(keypath)))

  registry = ocp.type_handlers.create_type_handler_registry(
      (jax.Array, orbax_pathways.ProxyArrayHandler(callback=Callback())))
  handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
  with ocp.CheckpointManager(tmp_path, item_handlers=handler) as mngr:
    mngr.save(0, args=ocp.args.PyTreeSave({'a': put(_value(), mesh(), 'data'),
                                            'b': put(_value(), mesh())}))
    mngr.wait_until_finished()
  assert sorted(events) == [('transfer', "['a']"), ('transfer', "['b']"),
                            ('write', "['a']"), ('write', "['b']")]
  assert (tmp_path / '0' / 'default' / '_pathways').exists()


# ---- exception types user code catches ---------------------------------------------------------

@pytest.mark.parametrize('use_ocdbt', [True, False])
def test_missing_array_raises_what_stock_raises(tmp_path, use_ocdbt):
  value = _value()
  state = {'x': put(value, mesh(), 'data'), 'y': put(value, mesh(), 'data')}
  handler = lambda: ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt)  # noqa: E731
  with ocp.CheckpointManager(tmp_path, item_handlers=handler()) as mngr:
    mngr.save(0, args=ocp.args.PyTreeSave(state))
    mngr.wait_until_finished()
  item = tmp_path / '0' / 'default'
  if use_ocdbt:
    import tensorstore as ts  # pylint: disable=g-import-not-at-top
    kv = ts.KvStore.open({'driver': 'ocdbt', 'base': f'file://{item}/'}).result()
    kv.delete_range(ts.KvStore.KeyRange(b'y/', b'y0')).result()
  else:
    os.remove(item / 'y' / '.zarray')
  target = abstract(state)
  with ocp.CheckpointManager(tmp_path, item_handlers=handler()) as mngr:
    with pytest.raises(FileNotFoundError, match=r"Array 'y' not found at .*0/default/y") as e:
      mngr.restore(0, args=ocp.args.PyTreeRestore(
          target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
  assert isinstance(e.value, ValueError)  # what stock raises with OCDBT
  assert isinstance(e.value, orbax_pathways.RestoreError)


def test_save_args_shard_axes_chunk_only_along_those_axes(tmp_path):
  value = _value((512, 512))
  handler = ocp.PyTreeCheckpointHandler()
  with ocp.CheckpointManager(tmp_path, item_handlers=handler) as mngr:
    mngr.save(0, args=ocp.args.PyTreeSave(
        {'w': put(value, mesh(), None)},  # replicated: one 1 MiB write
        save_args={'w': ocp.SaveArgs(chunk_byte_size=64 * 1024, shard_axes=(0,))}))
    mngr.wait_until_finished()
    out = mngr.restore(0)
  chunk = _chunk_shape(tmp_path / '0' / 'default', 'w')
  assert chunk[1] == 512 and np.prod(chunk) * 4 <= 64 * 1024, chunk  # rows cut, columns whole
  np.testing.assert_array_equal(np.asarray(out['w']), value)


@pytest.mark.parametrize('max_replicas,min_bytes,writers', [(None, None, 8), (2, None, 2),
                                                             (None, 1 << 30, 1)])
def test_replica_parallel_limits(tmp_path, max_replicas, min_bytes, writers):
  """``max_replicas_for_replica_parallel`` / ``min_slice_bytes_for_replica_parallel``: a fully
  replicated array held by 8 (simulated Pathways) worker hosts is split among at most that many,
  each piece at least that big."""
  orbax_pathways.install(orbax_pathways.Options(transport='colocated', coalesce_bytes=0))
  value = _value((2048, 1024))  # 8 MiB on every device: 1 MiB pieces over 8 hosts
  registry = ocp.type_handlers.create_type_handler_registry((jax.Array, orbax_pathways.ProxyArrayHandler(
      options=orbax_pathways.Options(transport='colocated', coalesce_bytes=0),
      max_replicas_for_replica_parallel=max_replicas,
      min_slice_bytes_for_replica_parallel=min_bytes)))
  handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
  with ocp.CheckpointManager(tmp_path, item_handlers=handler) as mngr:
    mngr.save(0, args=ocp.args.PyTreeSave({'w': put(value, mesh(), None)}))
    mngr.wait_until_finished()
  st = orbax_pathways.stats.last_save()
  assert len([w for w, n in st.written_bytes.items() if n]) == writers, st.written_bytes
  assert sum(st.written_bytes.values()) == value.nbytes
