"""Orbax v1 partial saves (``ocp.v1.partial.save`` / ``save_async`` / ``finalize``) through our
engine: each ``partial.save`` writes into a pending directory of its own with
the same writer's ``_pathways/p0.msgpack``; finalize joins them (records and index) so the
finalized checkpoint loads bit-exact with every chunk checksummed, the CLI verifies it, a
failed finalize can be retried, and stock Orbax reads ours (and we read stock's)."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways.format import grid as grid_lib
from orbax_pathways.format import item as item_lib
from orbax_pathways.format import records as records_lib
from orbax_pathways._compat import orbax_finalize
from orbax_pathways.storage import index as index_lib
from orbax_pathways.storage import meta_io

from support import procs
from support.arrays import assert_bit_identical, mesh, put
from support.workers import stock_v1_partial_worker

v1 = ocp.v1


def _parts():
  """Three parts of one state: sharded floats, replicated ints, a nested bf16 and a numpy leaf."""
  m = mesh()
  rng = np.random.default_rng(21)
  return [
      {'a': put(rng.standard_normal((64, 32), dtype=np.float32), m, 'data', 'model')},
      {'b': put(np.arange(40, dtype=np.int32), m, None),
       'opt': {'mu': put(rng.standard_normal((16, 8)).astype(jax.numpy.bfloat16), m, 'data')}},
      {'c': put(rng.standard_normal((8,), dtype=np.float32), m, None)},
  ]


def _merged(parts):
  out = {}
  for p in parts:
    out.update(p)
  return out


def _verify_cli(path):
  proc = procs.run_cli('verify', path, '--json', timeout=180)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert json.loads(proc.stdout)['ok'] is True, proc.stdout


def _assert_checksummed(item, names):
  """The finalized item's index covers every array of every part, each chunk with a crc32c,
  and agrees with the joined writer record."""
  assert sorted(os.listdir(item / '_pathways')) == ['index.msgpack', 'p0.msgpack']
  meta_io.clear_cache()
  index = meta_io.read_index(item)
  assert index is not None and sorted(index.arrays()) == sorted(names)
  for a in index.arrays().values():
    grid = grid_lib.ChunkGrid.of(a.shape, a.chunk_shape, records_lib.itemsize(a.dtype), a.chunks)
    assert grid is not None and grid.present is None, a.name  # every cell has a checksum
  (record,) = meta_io.read_records(item)
  assert record.writer == 'p0' and sorted(a.name for a in record.arrays) == sorted(names)
  assert record.stats['chunks'] == sum(len(a.chunks) for a in index.arrays().values())
  assert item_lib.encode_index(index) == item_lib.encode_index(item_lib.merge([record]))


NAMES = ['a', 'b', 'c', 'opt.mu']


def test_partial_saves_finalize_load_bit_exact_and_verify(tmp_path):
  parts = _parts()
  path = tmp_path / 'ckpt'
  for p in parts:
    v1.partial.save(path, p)
  assert not path.exists()
  v1.partial.finalize(path)
  assert not (tmp_path / 'ckpt.partial_save').exists()
  _assert_checksummed(path / 'state', NAMES)
  meta_io.clear_cache()
  loaded = v1.load(path)
  assert_bit_identical(loaded, _merged(parts))
  rst = orbax_pathways.stats.last_restore()
  assert rst.arrays == 4 and rst.chunks_verified >= 4
  _verify_cli(path)


def test_partial_saves_of_numpy_and_scalar_leaves_join_their_records(tmp_path):
  """Each part's numpy and scalar leaves get a record of their own (named by the leaves, so two
  parts never collide); finalize joins them and the finalized checkpoint verifies."""
  m = mesh()
  parts = [{'a': put(np.arange(64, dtype=np.float32).reshape(8, 8), m, 'data'),
            'loader': np.arange(12, dtype=np.int64), 'step': 3},
           {'rng': np.arange(4, dtype=np.uint32), 'lr': 0.5},
           {'ema': np.linspace(0, 1, 8, dtype=np.float32), 'count': 9}]
  path = tmp_path / 'ckpt'
  for p in parts:
    v1.partial.save(path, p)
  v1.partial.finalize(path)
  item = path / 'state'
  meta_io.clear_cache()
  assert sorted(meta_io.read_index(item).arrays()) == sorted(_merged(parts))
  writers = [w for w in os.listdir(item / '_pathways') if w.startswith(('numpy.', 'scalar.'))]
  assert len(writers) == 6, writers  # a numpy and a scalar record per part
  loaded = v1.load(path)
  for name, value in _merged(parts).items():
    np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(value))
  assert type(loaded['step']) is int and type(loaded['lr']) is float
  _verify_cli(path)


def test_partial_save_async_then_finalize(tmp_path):
  """Each ``save_async`` waited for before the next (stock Orbax 0.12.x breaks on two in
  flight at once, with or without orbax-pathways: both use the same temporary directory)."""
  parts = _parts()
  path = tmp_path / 'ckpt'
  for p in parts:
    response = v1.partial.save_async(path, p)
    assert response.result() is None
  v1.partial.finalize(path)
  _assert_checksummed(path / 'state', NAMES)
  assert_bit_identical(v1.load(path), _merged(parts))
  _verify_cli(path)


def test_finalize_given_the_partial_save_path(tmp_path):
  parts = _parts()[:2]
  for p in parts:
    v1.partial.save(tmp_path / 'ckpt', p)
  v1.partial.finalize(tmp_path / 'ckpt.partial_save')
  assert_bit_identical(v1.load(tmp_path / 'ckpt'), _merged(parts))


def test_finalize_that_failed_before_the_fix_succeeds_when_retried(tmp_path):
  """Without the join (orbax-pathways before this fix) finalize fails on the second part's
  ``p0.msgpack`` half-way through Orbax's merge; finalize again with the join: the checkpoint
  loads bit-exact with every array checksummed."""
  parts = _parts()
  path = tmp_path / 'ckpt'
  for p in parts:
    v1.partial.save(path, p)
  orbax_finalize.install(index_lib.merge_item)  # no pending hook: what the old version did
  with pytest.raises(FileExistsError, match='File collision on p0.msgpack during finalize'):
    v1.partial.finalize(path)
  orbax_pathways.install()  # puts the join back
  assert orbax_finalize.partial_originals()
  v1.partial.finalize(path)
  _assert_checksummed(path / 'state', NAMES)
  assert_bit_identical(v1.load(path), _merged(parts))
  _verify_cli(path)


def test_finalize_retried_after_orbax_failed_midway(tmp_path, monkeypatch):
  """Orbax's merge fails after our records were joined (here: moving the second part's files);
  the retry joins nothing twice (stats not doubled) and loads every part."""
  from orbax.checkpoint.experimental.v1._src.partial import saving  # pylint: disable=g-import-not-at-top
  parts = _parts()
  path = tmp_path / 'ckpt'
  for p in parts:
    v1.partial.save(path, p)
  real, calls = saving._merge_pytree_directory, []  # pylint: disable=protected-access

  async def failing_once(*args):
    calls.append(args)
    if len(calls) == 2:
      raise OSError('injected: storage went away while moving a part')
    return await real(*args)

  monkeypatch.setattr(saving, '_merge_pytree_directory', failing_once)
  with pytest.raises(OSError, match='injected'):
    v1.partial.finalize(path)
  monkeypatch.setattr(saving, '_merge_pytree_directory', real)
  v1.partial.finalize(path)
  _assert_checksummed(path / 'state', NAMES)
  assert_bit_identical(v1.load(path), _merged(parts))


def test_finalize_retried_after_the_pytree_finalize_failed(tmp_path):
  """The PyTree finalize (OCDBT merge, our index) fails after every part was moved: no part is
  left for the retry, which must still merge and index the item before committing it (stock
  commits it unmerged: unloadable)."""
  parts = _parts()
  path = tmp_path / 'ckpt'
  for p in parts:
    v1.partial.save(path, p)

  def failing(item_dir):
    raise OSError(f'injected: index of {item_dir} not written')

  orbax_finalize.install(failing, index_lib.merge_pending)
  with pytest.raises(OSError, match='injected'):
    v1.partial.finalize(path)
  assert not list((tmp_path / 'ckpt.partial_save').glob('*.pending_*'))
  orbax_pathways.install()
  v1.partial.finalize(path)
  assert (path / 'state' / 'manifest.ocdbt').exists()
  _assert_checksummed(path / 'state', NAMES)
  assert_bit_identical(v1.load(path), _merged(parts))
  _verify_cli(path)


def test_joining_a_part_twice_changes_nothing(tmp_path):
  """``merge_pending`` is idempotent: a finalize interrupted after a join and before the part's
  ``_pathways`` was removed joins it again without doubling stats or chunks."""
  def record(writer, names, chunks=1):
    return records_lib.WriterRecord(writer, 'local', tuple(
        records_lib.ArrayRecord(n, 'float32', (4,), (4,), (records_lib.ChunkRecord((0,), 7, 16),))
        for n in names), stats={'written_bytes': 16 * len(names), 'chunks': chunks * len(names)})
  item, part1, part2 = tmp_path / 'item', tmp_path / 'p1', tmp_path / 'p2'
  meta_io.write_record(part1, record('p0', ['a']))
  meta_io.write_record(part2, record('p0', ['b', 'c']))
  meta_io.write_record(part2, record('p1', ['d']))
  index_lib.merge_pending(item, part1)
  index_lib.merge_pending(item, part2)
  once = {p.name: p.read_bytes() for p in (item / '_pathways').iterdir()}
  index_lib.merge_pending(item, part2)
  index_lib.merge_pending(item, part1)
  assert {p.name: p.read_bytes() for p in (item / '_pathways').iterdir()} == once
  got = {r.writer: r for r in meta_io.read_records(item)}
  assert [a.name for a in got['p0'].arrays] == ['a', 'b', 'c']
  assert got['p0'].stats == {'chunks': 3, 'written_bytes': 48}
  assert [a.name for a in got['p1'].arrays] == ['d']


def test_colocated_partial_saves_join_their_indexes(tmp_path, monkeypatch):
  """Under Pathways the colocated controller writes each part's index itself (no records):
  finalize joins the indexes."""
  monkeypatch.setenv('ORBAX_PATHWAYS_RUNTIME', 'pathways')
  parts = _parts()
  path = tmp_path / 'ckpt'
  orbax_pathways.install(orbax_pathways.Options(transport='colocated'))
  for p in parts:
    v1.partial.save(path, p)
    assert orbax_pathways.stats.last_save().transport == 'colocated'
  v1.partial.finalize(path)
  item = path / 'state'
  assert os.listdir(item / '_pathways') == ['index.msgpack']
  meta_io.clear_cache()
  index = meta_io.read_index(item)
  assert sorted(index.arrays()) == NAMES
  assert all(len(a.chunks) for a in index.arrays().values())
  assert_bit_identical(v1.load(path), _merged(parts))
  assert orbax_pathways.stats.last_restore().chunks_verified >= 4
  _verify_cli(path)


def test_stock_loads_our_partial_checkpoint_and_we_load_stocks(tmp_path):
  parts = _parts()
  for p in parts:
    v1.partial.save(tmp_path / 'ours', p)
  v1.partial.finalize(tmp_path / 'ours')
  want = {'a': np.asarray(parts[0]['a']), 'b': np.asarray(parts[1]['b']),
          'c': np.asarray(parts[2]['c'])}
  procs.run_worker(stock_v1_partial_worker, tmp_path / 'ours', tmp_path / 'ours.npz',
                   tmp_path / 'stock', env={'ORBAX_PATHWAYS_DISABLE': '1'})
  got = np.load(tmp_path / 'ours.npz')
  for k, v in want.items():
    assert got[k].tobytes() == v.tobytes(), k
  assert got['mu'].tobytes() == np.asarray(parts[1]['opt']['mu']).tobytes()
  stock = v1.load(tmp_path / 'stock')
  assert stock['x'].tolist() == list(np.arange(10.0))
  assert np.asarray(stock['y']).tolist() == [[0, 1, 2], [3, 4, 5]]
  assert not (tmp_path / 'stock' / 'state' / '_pathways').exists()


def test_uninstall_puts_orbax_partial_finalize_back_exactly():
  from orbax.checkpoint.experimental.v1._src.partial import saving  # pylint: disable=g-import-not-at-top
  originals = orbax_finalize.partial_originals()
  assert sorted(originals) == ['_is_pytree_dir', '_merge_all', '_read_first_metadata']
  assert all(getattr(saving, k) is not f for k, f in originals.items())
  orbax_pathways.uninstall()
  try:
    assert all(getattr(saving, k) is f for k, f in originals.items())
    assert not orbax_finalize.partial_originals()
  finally:
    orbax_pathways.install()
  orbax_pathways.install()  # idempotent: still wraps Orbax's own functions once
  assert orbax_finalize.partial_originals() == originals
