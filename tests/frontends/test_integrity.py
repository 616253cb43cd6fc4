"""Damaged checkpoints fail restore with an error naming the array, the chunk and the path."""

import os
import threading
import warnings

import crc32c
import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways.format import checksum
from orbax_pathways.format import records as records_lib
from orbax_pathways.storage import meta_io

from support import damage
from support.arrays import abstract, mesh, put


def _save(directory, use_ocdbt=True):
  m = mesh()
  value = np.random.default_rng(0).standard_normal((256, 64), dtype=np.float32)
  state = {'w': put(value, m, 'data', 'model')}
  handler = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt)
  with ocp.CheckpointManager(directory, item_handlers=handler) as mngr:
    mngr.save(0, args=ocp.args.PyTreeSave(state))
    mngr.wait_until_finished()
  return state


def _restore(directory, state, use_ocdbt=True):
  handler = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt)
  with ocp.CheckpointManager(directory, item_handlers=handler) as mngr:
    target = abstract(state)
    return mngr.restore(0, args=ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))


def _data_files(item):
  return sorted((p for p in item.glob('ocdbt.process_0/d/*')), key=lambda p: -p.stat().st_size)


def _flip_byte_in_chunk_data(item, value: np.ndarray):
  """Flips one byte inside the stored float bytes (found by content, not by guessing offsets)."""
  damage.flip_bit_in(_data_files(item), np.ascontiguousarray(value).tobytes()[:64],
                     what='uncompressed chunk bytes')


def test_flipped_byte_is_caught_by_the_checksum(tmp_path):
  state = _save(tmp_path)
  item = tmp_path / '0' / 'default'
  # Chunks of w are stored uncompressed (floats), so a flipped byte still decodes: only our
  # crc32c can tell.
  _flip_byte_in_chunk_data(item, _first_chunk(state, item))
  with pytest.raises(orbax_pathways.ChecksumMismatchError,
                     match=r"Checksum mismatch in array 'w', chunk at \[\d+, \d+\] \(shape \[\d+, \d+\]\) "
                           r"of .*0/default/w: recorded crc32c 0x[0-9a-f]{8}, read 0x[0-9a-f]{8}\. "
                           r'The stored bytes are damaged'):
    _restore(tmp_path, state)


def _first_chunk(state, item):
  rec = meta_io.read_item(item).arrays()['w']
  origin = rec.chunks[0].origin
  sl = tuple(slice(o, o + c) for o, c in zip(origin, rec.chunk_shape))
  return np.asarray(state['w'])[sl]


def test_verification_can_be_turned_off(tmp_path):
  state = _save(tmp_path)
  item = tmp_path / '0' / 'default'
  _flip_byte_in_chunk_data(item, _first_chunk(state, item))
  orbax_pathways.install(orbax_pathways.Options(verify_checksums=False))
  restored = _restore(tmp_path, state)
  assert not np.array_equal(np.asarray(restored['w']), np.asarray(state['w']))  # damage passes


def test_truncated_data_file(tmp_path):
  state = _save(tmp_path)
  big = _data_files(tmp_path / '0' / 'default')[0]
  os.truncate(big, big.stat().st_size // 2)
  with pytest.raises(orbax_pathways.RestoreError, match=r"array 'w'.* from .*0/default/w failed: .*"
                                                        r'run `orbax-pathways verify`'):
    _restore(tmp_path, state)


def test_deleted_chunk_file_without_ocdbt(tmp_path):
  state = _save(tmp_path, use_ocdbt=False)
  chunk = tmp_path / '0' / 'default' / 'w' / '0.0'
  assert chunk.exists()
  chunk.unlink()
  with pytest.raises(orbax_pathways.RestoreError, match=r"array 'w'.*0/default/w"):
    _restore(tmp_path, state, use_ocdbt=False)


def test_deleted_ocdbt_data_file(tmp_path):
  state = _save(tmp_path)
  for f in _data_files(tmp_path / '0' / 'default'):
    f.unlink()
  with pytest.raises(orbax_pathways.RestoreError, match=r"array 'w'"):
    _restore(tmp_path, state)


def test_damaged_pathways_metadata(tmp_path):
  state = _save(tmp_path)
  record = tmp_path / '0' / 'default' / '_pathways' / 'p0.msgpack'
  (record.parent / 'index.msgpack').unlink()  # as written before schema 2: records only
  record.write_bytes(record.read_bytes()[:20])
  with pytest.raises(records_lib.MetadataError, match=r'orbax-pathways metadata file .*p0\.msgpack is '
                                                   r'damaged.*orbax-pathways verify'):
    _restore(tmp_path, state)


def test_checkpoint_from_a_newer_schema_is_refused(tmp_path):
  state = _save(tmp_path)
  record = tmp_path / '0' / 'default' / '_pathways' / 'index.msgpack'
  import msgpack  # pylint: disable=g-import-not-at-top
  obj = msgpack.unpackb(record.read_bytes(), raw=False, strict_map_key=False)
  obj['schema'] = records_lib.SCHEMA_VERSION + 1
  record.write_bytes(msgpack.packb(obj, use_bin_type=True))
  with pytest.raises(records_lib.MetadataError, match=r'has schema 3, this version reads up to 2\. '
                                                   r'Upgrade orbax-pathways'):
    _restore(tmp_path, state)


def test_reregistration_is_detected_at_the_next_save(tmp_path):
  m = mesh()
  state = {'w': put(np.zeros((8, 4), np.float32), m, 'data')}
  orbax_pathways.uninstall()
  stock = ocp.type_handlers.get_type_handler(jax.Array)  # Orbax's own, to put back at the end
  orbax_pathways.install()
  ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(), override=True)
  with ocp.CheckpointManager(tmp_path) as mngr:
    with pytest.warns(RuntimeWarning, match=r'jax\.Array is now handled by .*ArrayHandler, not '
                                            r'orbax_pathways .*Call orbax_pathways\.install\(\)'):
      mngr.save(0, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    with warnings.catch_warnings():
      warnings.simplefilter('error')  # warned once per intruder, not at every save
      mngr.save(1, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()
  assert orbax_pathways.installed() is None
  # Later tests compare against Orbax's own handler: uninstall() must give that back, not the
  # intruder this test registered.
  ocp.type_handlers.register_type_handler(jax.Array, stock, override=True)
  orbax_pathways.install(orbax_pathways.Options.from_env())
  assert orbax_pathways.installed() is not None


@pytest.mark.parametrize('block', [1 << 20, 96, 8])
@pytest.mark.parametrize('dtype', [np.float32, ml_dtypes.bfloat16, np.int8, np.bool_])
def test_checksum_of_strided_views_equals_checksum_of_their_bytes(dtype, block, monkeypatch):
  """Chunks are hashed in place inside larger read buffers (column blocks, strided leading
  axes, transposes): the crc must be that of the chunk's own C-order bytes (docs/format.md).
  ``block``: the scratch slab (``checksum.BLOCK_BYTES``) holding all of a view, a few rows of
  it, or less than one row (runs hashed one by one, or slabs of a sub-view)."""
  monkeypatch.setattr(checksum, 'BLOCK_BYTES', block)
  monkeypatch.setattr(checksum, '_scratch', threading.local())
  base = np.random.default_rng(1).standard_normal((8, 16, 32)) > 0 if dtype is np.bool_ else (
      np.random.default_rng(1).standard_normal((8, 16, 32)).astype(dtype))
  views = [base, base[:, :, :16], base[:, 2:10], base[::2, :, :16], base[:, :1, 3:9],
           base.transpose(1, 0, 2), base[..., ::2], base[:0]]
  for v in views:
    assert checksum.of_array(v) == crc32c.crc32c(np.ascontiguousarray(v).tobytes()), v.shape
