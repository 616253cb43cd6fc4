"""No bytes come back unverified: ``np.ndarray`` and scalar leaves carry
crc32c like arrays, and in an item orbax-pathways wrote an array without a record is an error,
not an unchecked read.

Real CheckpointManager saves on the 8 virtual CPU devices; damage is done to the stored bytes
(``support.damage``), found by content.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways.format import item as item_lib
from orbax_pathways.format import records as records_lib
from orbax_pathways.storage import meta_io
from support import ckpt
from support import damage
from support.arrays import host_leaf_state

# An exception nobody could raise (an answer into a closed event loop) or a coroutine never
# awaited fails the test.
pytestmark = [pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning'),
              pytest.mark.filterwarnings('error:coroutine .* was never awaited:RuntimeWarning')]


def _state(seed: int = 0) -> dict:
  return host_leaf_state(seed)


def _handler(use_ocdbt: bool = True, use_zarr3: bool = False):
  # Uncompressed, so that a flipped byte still decodes: only a checksum can tell.
  return ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3,
                                     use_compression=False)


def _save(directory, state, **kw) -> pathlib.Path:
  with ocp.CheckpointManager(directory, item_handlers=_handler(**kw)) as mngr:
    mngr.save(0, args=ocp.args.PyTreeSave(state))
    mngr.wait_until_finished()
  return pathlib.Path(directory) / '0' / 'default'


def _restore(directory, **kw) -> dict:
  with ocp.CheckpointManager(directory, item_handlers=_handler(**kw)) as mngr:
    return mngr.restore(0)


def _data_files(item: pathlib.Path) -> list[pathlib.Path]:
  return sorted((p for p in item.rglob('*') if p.is_file() and '_pathways' not in p.parts),
                key=lambda p: -p.stat().st_size)


@pytest.mark.parametrize('use_ocdbt,use_zarr3', [(True, False), (False, False), (True, True)])
def test_numpy_and_scalar_leaves_are_recorded_and_round_trip(tmp_path, use_ocdbt, use_zarr3):
  state = _state()
  item = _save(tmp_path, state, use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
  arrays = meta_io.read_item(item).arrays()
  assert set(arrays) == {'w', 'loader', 'rng', 'step', 'lr'}
  for name in ('loader', 'rng', 'step', 'lr'):
    assert len(arrays[name].chunks) >= 1, name
  writers = sorted(p.name for p in (item / records_lib.DIRNAME).iterdir())
  assert any(w.startswith('numpy.') for w in writers) and any(
      w.startswith('scalar.') for w in writers), writers
  out = _restore(tmp_path, use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
  np.testing.assert_array_equal(out['loader'], state['loader'])
  np.testing.assert_array_equal(out['rng'], state['rng'])
  assert (out['step'], out['lr']) == (7, 0.25) and type(out['step']) is int
  assert out['loader'].dtype == np.float32 and out['rng'].dtype == np.uint32


def test_flipped_byte_in_a_numpy_leaf_is_caught(tmp_path):
  state = _state()
  item = _save(tmp_path, state)
  damage.flip_bit_in(_data_files(item), state['loader'].tobytes()[:64], what='numpy leaf bytes')
  with pytest.raises(orbax_pathways.ChecksumMismatchError,
                     match=r"Checksum mismatch in array 'loader', chunk at \[0, 0\] .*0/default/"
                           r"loader: recorded crc32c"):
    _restore(tmp_path)


def test_flipped_byte_in_a_scalar_leaf_is_caught(tmp_path):
  """Without OCDBT (with it, a value this small lives inside OCDBT's compressed b-tree node)."""
  state = dict(_state(), step=np.int64(0x1122334455667788))
  item = _save(tmp_path, state, use_ocdbt=False)
  damage.flip_bit_in(_data_files(item), np.int64(0x1122334455667788).tobytes(), offset=3,
                     what='scalar leaf bytes')
  with pytest.raises(orbax_pathways.ChecksumMismatchError, match="array 'step'"):
    _restore(tmp_path, use_ocdbt=False)


def test_stock_orbax_reads_our_numpy_leaves_and_we_read_stock_ones(tmp_path):
  state = _state()
  _save(tmp_path / 'ours', state)
  with ckpt.stock_orbax():
    _save(tmp_path / 'stock', state)
  assert not (tmp_path / 'stock' / '0' / 'default' / records_lib.DIRNAME).exists()
  ckpt.assert_stock_reads_same(tmp_path / 'ours', tmp_path / 'stock')
  out = _restore(tmp_path / 'stock')  # stock-written: read unchecked, as before
  np.testing.assert_array_equal(out['loader'], state['loader'])
  assert out['step'] == 7


def _drop_record(item: pathlib.Path, name: str) -> None:
  """Loses ``name``'s record the way a lost writer file or a partial index would: rewrites the
  index (and every writer record) without it."""
  md = meta_io.read_item(item)
  kept = tuple(a for n, a in sorted(md.arrays().items()) if n != name)
  meta_io.write_index(item, item_lib.ItemMetadata(md.writers, kept, source='index'))
  for f in (item / records_lib.DIRNAME).glob('*.msgpack'):
    if f.name == records_lib.INDEX_FILENAME:
      continue
    rec = records_lib.decode(f.read_bytes())
    f.write_bytes(records_lib.encode(dataclasses.replace(
        rec, arrays=tuple(a for a in rec.arrays if a.name != name))))
  meta_io.clear_cache()


@pytest.mark.parametrize('name', ['w', 'loader', 'step'])
def test_an_array_whose_record_is_lost_is_an_error(tmp_path, name):
  state = _state()
  item = _save(tmp_path, state)
  _drop_record(item, name)
  assert name not in meta_io.read_item(item).arrays()
  with pytest.raises(orbax_pathways.errors.MissingChecksumError,
                     match=rf"Array '{name}' at .*0/default/{name} has no checksum record in "
                           r'.*_pathways/index.msgpack.*Run `orbax-pathways verify`.*'
                           r'ORBAX_PATHWAYS_VERIFY=0'):
    _restore(tmp_path)
  with ckpt.options(verify_checksums=False):  # the documented opt-out
    out = _restore(tmp_path)
  np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(state[name]))


def test_without_pathways_the_step_restores_unchecked_as_stock(tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  state = _state()
  item = _save(tmp_path, state)
  shutil.rmtree(item / records_lib.DIRNAME)
  meta_io.clear_cache()
  out = _restore(tmp_path)
  np.testing.assert_array_equal(np.asarray(out['w']), np.asarray(state['w']))
  np.testing.assert_array_equal(out['loader'], state['loader'])


def test_colocated_index_lists_the_numpy_leaves(tmp_path):
  """The colocated controller writes the index itself; the numpy and scalar records process 0
  writes beside it are merged in before the commit."""
  state = _state()
  with ckpt.options(transport='colocated'):
    item = _save(tmp_path, state)
  md = meta_io.read_index(item)
  assert md is not None and {'w', 'loader', 'rng', 'step', 'lr'} <= set(md.arrays())
  damage.flip_bit_in(_data_files(item), state['loader'].tobytes()[:64], what='loader bytes')
  with pytest.raises(orbax_pathways.ChecksumMismatchError, match="array 'loader'"):
    _restore(tmp_path)


def test_uninstall_gives_back_orbaxs_numpy_and_scalar_handlers():
  from orbax_pathways._compat import orbax as compat  # pylint: disable=g-import-not-at-top
  assert type(compat.registered_handler(np.ndarray)).__name__ == 'ProxyNumpyHandler'
  assert type(compat.registered_handler(int)).__name__ == 'ProxyScalarHandler'
  orbax_pathways.uninstall()
  try:
    assert type(compat.registered_handler(np.ndarray)) is compat.NumpyHandler
    for ty in (int, float, np.number):
      assert type(compat.registered_handler(ty)) is compat.ScalarHandler
  finally:
    ckpt.install_defaults()


def test_a_pytree_restore_without_target_verifies_jax_arrays(tmp_path):
  """``PyTreeCheckpointHandler`` without a target hands ``jax.Array`` leaves plain
  ``RestoreArgs``: they are read and verified by us, not unchecked by Orbax's handler."""
  state = _state()
  item = _save(tmp_path, state)
  out = _restore(tmp_path)
  np.testing.assert_array_equal(np.asarray(out['w']), np.asarray(state['w']))
  assert out['w'].sharding.is_equivalent_to(state['w'].sharding, 2)
  assert orbax_pathways.stats.last_restore().chunks_verified > 0
  damage.flip_bit_in(_data_files(item), np.asarray(state['w'])[:8, :16].tobytes()[:32],
                     what='w bytes')
  with pytest.raises(orbax_pathways.ChecksumMismatchError, match="array 'w'"):
    _restore(tmp_path)


def test_host_leaves_that_were_never_recorded_restore_unchecked(tmp_path):
  """Numpy and scalar leaves saved by Orbax's own handlers beside our arrays (Orbax v1's leaf
  handlers, or an orbax-pathways version that did not record them): read as stock reads them;
  the jax.Array leaf is still verified, and still required to have its record."""
  state = _state()
  item = _save(tmp_path, state)
  ckpt.drop_host_leaf_records(item)
  assert set(meta_io.read_item(item).arrays()) == {'w'}
  out = _restore(tmp_path)
  np.testing.assert_array_equal(out['loader'], state['loader'])
  assert out['step'] == 7 and out['lr'] == 0.25
  _drop_record(item, 'w')
  with pytest.raises(orbax_pathways.errors.MissingChecksumError, match="Array 'w'"):
    _restore(tmp_path)
