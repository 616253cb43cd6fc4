"""The item index (``_pathways/index.msgpack``, schema 2): written once per save before the step
is committed, read once per restore whatever the number of writers; checkpoints without one
(schema 1: writer records only) still restore and verify, their records read concurrently."""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways.format import grid as grid_lib
from orbax_pathways.format import item as item_lib
from orbax_pathways.format import partial as partial_lib
from orbax_pathways.format import records as records_lib
from orbax_pathways._compat import orbax_finalize
from orbax_pathways.storage import index as index_lib
from orbax_pathways.storage import meta_io

from support import ckpt
from support import procs
from support.arrays import abstract, assert_trees_equal, mesh, random_state

TMP_SUFFIX = '.orbax-checkpoint-tmp'


def _restore(directory, step=0, target=None):
  with ocp.CheckpointManager(directory) as mngr:
    return mngr.restore(step, args=ocp.args.StandardRestore(target) if target is not None else None)


class _Reads:
  """``_pathways`` objects this process reads inside the block, by kind (cold cache)."""

  def __enter__(self):
    meta_io.clear_cache()
    self.before = meta_io.read_counts()
    return self

  def __exit__(self, *exc):
    after = meta_io.read_counts()
    self.counts = {k: after.get(k, 0) - self.before.get(k, 0) for k in after
                   if after.get(k, 0) != self.before.get(k, 0)}


def test_save_writes_the_index_before_the_commit(tmp_path):
  seen = []

  def merge_and_look(directory):
    seen.append((str(directory), sorted(os.listdir(os.path.join(str(directory), '_pathways')))))
    return index_lib.merge_item(directory)

  orbax_finalize.install(merge_and_look)
  try:
    state = random_state(mesh())
    ckpt.save(tmp_path, state)
  finally:
    orbax_finalize.install(index_lib.merge_item)
  # Orbax's finalize ran it on the item's temporary directory, before the rename committed it.
  # (p0: the jax.Array leaves; scalar.<id>: the Python int 'step', written by process 0.)
  assert len(seen) == 1 and TMP_SUFFIX in seen[0][0] and [
      f.split('.')[0] for f in seen[0][1]] == ['p0', 'scalar'], seen
  item = tmp_path / '0' / 'default'
  assert sorted(os.listdir(item / '_pathways')) == ['index.msgpack'] + seen[0][1]
  # The index is the records merged, nothing lost: every chunk, checksum and sharding.
  records = item_lib.merge(meta_io.read_records(item))
  index = meta_io.read_index(item)
  assert index.source == 'index' and records.source == 'records'
  assert index.arrays() == records.arrays()
  assert [(w.writer, w.transport, dict(w.stats)) for w in index.writers] == [
      (w.writer, w.transport, dict(w.stats)) for w in records.writers]


def test_a_failing_merge_leaves_the_step_uncommitted(tmp_path):
  def fail(directory):
    raise OSError(f'no space left writing the index of {directory}')

  orbax_finalize.install(fail)
  try:
    with ocp.CheckpointManager(tmp_path) as mngr:
      mngr.save(0, args=ocp.args.StandardSave(random_state(mesh())))
      with pytest.raises(OSError, match='no space left writing the index'):
        mngr.wait_until_finished()
  finally:
    orbax_finalize.install(index_lib.merge_item)
  assert ocp.CheckpointManager(tmp_path).all_steps() == []


def test_restore_reads_one_metadata_object(tmp_path):
  state = random_state(mesh())
  ckpt.save(tmp_path, state)
  with _Reads() as r:
    restored = _restore(tmp_path, target=abstract(state))
  assert_trees_equal(restored, state)
  assert r.counts == {'index': 1}
  assert orbax_pathways.stats.last_restore().chunks_verified > 0
  # Without a target Orbax asks metadata() and then deserialize(): the second finds the index
  # unchanged (a conditional read that moves no bytes).
  with _Reads() as r:
    restored = _restore(tmp_path)
  assert_trees_equal(restored, state)
  assert r.counts == {'index': 1, 'index_unchanged': 1}


def test_a_step_saved_again_under_the_same_number_is_read_anew(tmp_path):
  m = mesh()
  first = random_state(m, seed=1)
  ckpt.save(tmp_path, first)
  assert_trees_equal(_restore(tmp_path, target=abstract(first)), first)  # index now cached
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.delete(0)
  second = random_state(m, seed=2)
  ckpt.save(tmp_path, second)
  before = meta_io.read_counts()
  assert_trees_equal(_restore(tmp_path, target=abstract(second)), second)
  after = meta_io.read_counts()
  assert after.get('index', 0) == before.get('index', 0) + 1  # not served from the cache
  assert orbax_pathways.stats.last_restore().chunks_verified > 0  # the new step's checksums


def test_an_index_rewritten_in_place_is_not_served_from_the_cache(tmp_path):
  def item(crc):
    a = records_lib.ArrayRecord(name='w', dtype='float32', shape=(4,), chunk_shape=(4,),
                             chunks=(records_lib.ChunkRecord((0,), crc, 16),))
    return item_lib.ItemMetadata((records_lib.WriterRecord('p0', 'local', ()),), (a,), 'index')

  meta_io.write_index(tmp_path, item(1))
  assert meta_io.read_index(tmp_path).arrays()['w'].chunks[0].crc32c == 1
  meta_io.write_index(tmp_path, item(2))  # same size, same path, at once
  assert meta_io.read_index(tmp_path).arrays()['w'].chunks[0].crc32c == 2
  os.remove(meta_io.index_path(tmp_path))
  assert meta_io.read_index(tmp_path) is None


def test_checkpoint_without_index_restores_and_verifies_from_its_records(tmp_path):
  state = random_state(mesh())
  ckpt.save(tmp_path, state)
  pw = tmp_path / '0' / 'default' / '_pathways'
  os.remove(pw / 'index.msgpack')  # as schema 1 wrote it: the records only
  import msgpack  # pylint: disable=g-import-not-at-top
  obj = msgpack.unpackb((pw / 'p0.msgpack').read_bytes(), raw=False, strict_map_key=False)
  obj['schema'] = 1
  (pw / 'p0.msgpack').write_bytes(msgpack.packb(obj, use_bin_type=True))
  with _Reads() as r:
    restored = _restore(tmp_path, target=abstract(state))
  assert_trees_equal(restored, state)
  assert r.counts == {'list': 1, 'record': 2}  # p0 and the scalar leaves' record
  assert orbax_pathways.stats.last_restore().chunks_verified > 0


@pytest.mark.gcs
def test_records_without_index_are_read_concurrently(faulty_gcs):
  item = faulty_gcs.path('old', '0', 'default')
  n = 12
  for i in range(n):
    meta_io.write_record(item, records_lib.WriterRecord(f'p{i}', 'local', (records_lib.ArrayRecord(
        name='w', dtype='float32', shape=(n,), chunk_shape=(1,),
        chunks=(records_lib.ChunkRecord((i,), i, 4),)),)))
  arrivals = []
  proxy = faulty_gcs.proxy
  proxy.delay_s = 0.5
  proxy.match = lambda method, target: ('/_pathways/p' in target.replace('%2F', '/')
                                        and 'alt=media' in target)
  original = proxy._choose  # pylint: disable=protected-access

  def choose(method, target):
    kind = original(method, target)
    if kind == 'delay':
      arrivals.append(time.monotonic())
    return kind

  proxy._choose = choose  # pylint: disable=protected-access
  proxy.set_rate(1.0, ['delay'])  # every record read is answered 0.5 s late
  try:
    item_md = meta_io.read_item(item)
  finally:
    proxy.set_rate(0.0)
  assert sorted(c.origin for c in item_md.arrays()['w'].chunks) == [(i,) for i in range(n)]
  assert len(arrivals) == n
  # A reader waiting for each answer before the next request would space requests >= 0.5 s
  # apart; concurrent reads arrive while earlier ones are still held.
  gaps = np.diff(sorted(arrivals))
  assert (gaps < proxy.delay_s / 2).sum() >= n // 2, gaps


# A damaged index costs nothing but reads: the records beside it hold the same
# checksums, so restore rebuilds it from them with one warning naming the file.

DAMAGES = {
    'truncated': lambda b: b[:30],
    'empty': lambda b: b'',
    'garbage': lambda b: b'\xc1garbage' * 8,
    'not_an_index': lambda b: b'\x93\x01\x02\x03',  # valid msgpack, a list
}


def _damage_index(item, how):
  index = item / '_pathways' / 'index.msgpack'
  index.write_bytes(DAMAGES[how](index.read_bytes()))
  meta_io.clear_cache()
  return index


def _warnings_naming(caplog, path):
  return [r for r in caplog.records if r.levelname == 'WARNING' and str(path) in r.getMessage()]


@pytest.mark.parametrize('how', sorted(DAMAGES))
def test_damaged_index_is_rebuilt_from_the_records_with_one_warning(tmp_path, how, caplog):
  state = random_state(mesh())
  ckpt.save(tmp_path, state)
  index = _damage_index(tmp_path / '0' / 'default', how)
  with caplog.at_level('WARNING', logger='orbax_pathways'):
    assert_trees_equal(_restore(tmp_path, target=abstract(state)), state)
    assert_trees_equal(_restore(tmp_path), state)  # metadata() and deserialize() read it too
  assert orbax_pathways.stats.last_restore().chunks_verified > 0
  said = _warnings_naming(caplog, index)
  assert len(said) == 1, [r.getMessage() for r in caplog.records]
  assert 'is damaged' in said[0].getMessage() and 'writer record' in said[0].getMessage()
  item = meta_io.read_item(tmp_path / '0' / 'default')
  assert item.source == 'records' and 'index.msgpack' in item.damaged_index
  with pytest.raises(records_lib.DamagedIndexError, match='is damaged|not an index'):
    meta_io.read_index(tmp_path / '0' / 'default')  # the index itself is still reported


def test_rebuilt_index_still_catches_flipped_bytes(tmp_path):
  from support import damage  # pylint: disable=g-import-not-at-top
  value = np.arange(4096, dtype=np.float32)
  ckpt.save(tmp_path, {'w': jax.numpy.asarray(value)})
  _damage_index(tmp_path / '0' / 'default', 'truncated')
  damage.flip_bit_in(sorted((tmp_path / '0').rglob('d/*')), value.tobytes()[:64], what='w')
  with pytest.raises(orbax_pathways.ChecksumMismatchError, match="array 'w'"):
    _restore(tmp_path, target=abstract({'w': jax.numpy.asarray(value)}))


def test_damaged_index_without_records_is_reported_with_its_path(tmp_path):
  state = random_state(mesh())
  ckpt.save(tmp_path, state)
  item = tmp_path / '0' / 'default'
  (item / '_pathways' / 'p0.msgpack').unlink()
  _damage_index(item, 'truncated')
  with pytest.raises(records_lib.MetadataError, match=r'orbax-pathways index .*0/default/_pathways/'
                                                   r'index\.msgpack is damaged.*orbax-pathways verify'):
    _restore(tmp_path, target=abstract(state))


def test_damaged_index_and_damaged_record_name_both(tmp_path):
  state = random_state(mesh())
  ckpt.save(tmp_path, state)
  item = tmp_path / '0' / 'default'
  (item / '_pathways' / 'p0.msgpack').write_bytes(b'\xc1garbage')
  _damage_index(item, 'empty')
  with pytest.raises(records_lib.MetadataError, match=r'index\.msgpack is damaged.*records beside it '
                                                   r'cannot replace it.*p0\.msgpack is damaged'):
    _restore(tmp_path, target=abstract(state))


def test_newer_index_is_not_rebuilt_from_records(tmp_path):
  import msgpack  # pylint: disable=g-import-not-at-top
  ckpt.save(tmp_path, {'w': jax.numpy.arange(8.0)})
  index = tmp_path / '0' / 'default' / '_pathways' / 'index.msgpack'
  obj = msgpack.unpackb(index.read_bytes(), raw=False)
  index.write_bytes(msgpack.packb({**obj, 'schema': records_lib.SCHEMA_VERSION + 1}, use_bin_type=True))
  meta_io.clear_cache()
  with pytest.raises(records_lib.MetadataError, match='Upgrade orbax-pathways'):
    _restore(tmp_path, target=abstract({'w': jax.numpy.arange(8.0)}))


def test_resume_restores_the_step_whose_index_is_damaged(tmp_path, caplog):
  from orbax_pathways import preemption  # pylint: disable=g-import-not-at-top
  with ocp.CheckpointManager(tmp_path) as mngr:
    for step in (1, 2):
      w = jax.numpy.arange(512, dtype=np.float32) + step
      mngr.save(step, args=ocp.args.StandardSave({'w': w}))
    mngr.wait_until_finished()
  index = _damage_index(tmp_path / '2' / 'default', 'truncated')
  with caplog.at_level('WARNING'), ocp.CheckpointManager(tmp_path) as mngr:
    step, state = preemption.resume(mngr, lambda: None, abstract_state={'w': jax.ShapeDtypeStruct(
        (512,), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))})
  assert step == 2
  assert np.asarray(state['w']).tobytes() == (np.arange(512, dtype=np.float32) + 2).tobytes()
  assert len(_warnings_naming(caplog, index)) == 1
  assert not [r for r in caplog.records if 'trying the next older step' in r.getMessage()]


def test_v1_load_rebuilds_a_damaged_index(tmp_path, caplog):
  state = random_state(mesh())
  ocp.v1.save(tmp_path / 'a', state)
  index = _damage_index(tmp_path / 'a' / 'state', 'garbage')
  with caplog.at_level('WARNING', logger='orbax_pathways'):
    assert_trees_equal(ocp.v1.load(tmp_path / 'a'), state)
  assert len(_warnings_naming(caplog, index)) == 1


def test_merge_item_leaves_items_without_records_and_existing_indexes_alone(tmp_path):
  assert index_lib.merge_item(tmp_path / 'nothing') is None
  assert not (tmp_path / 'nothing').exists()
  state = random_state(mesh())
  ckpt.save(tmp_path, state)
  item = tmp_path / '0' / 'default'
  stamp = os.stat(item / '_pathways' / 'index.msgpack').st_mtime_ns
  assert index_lib.merge_item(item) is None
  assert os.stat(item / '_pathways' / 'index.msgpack').st_mtime_ns == stamp


def test_uninstall_puts_orbax_finalize_back_exactly(tmp_path):
  from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as base  # pylint: disable=g-import-not-at-top
  cls = base.BasePyTreeCheckpointHandler
  original = orbax_finalize.original()
  assert original is not None and cls.__dict__['_finalize_async'] is not original
  orbax_pathways.uninstall()
  try:
    assert cls.__dict__['_finalize_async'] is original and not orbax_finalize.installed()
    ckpt.save(tmp_path / 'stock', random_state(mesh()))
    assert not (tmp_path / 'stock' / '0' / 'default' / '_pathways').exists()
  finally:
    orbax_pathways.install()
  assert orbax_finalize.original() is original
  orbax_pathways.install()  # idempotent: still wraps Orbax's own function once
  assert orbax_finalize.original() is original


def test_orbax_v1_saves_write_the_index_and_loads_read_it_once(tmp_path):
  state = random_state(mesh())
  ocp.v1.save(tmp_path / 'a', state)
  item = tmp_path / 'a' / 'state'
  files = sorted(os.listdir(item / '_pathways'))  # the Python int 'step' has a scalar record
  assert files[:2] == ['index.msgpack', 'p0.msgpack'] and len(files) == 3, files
  assert files[2].startswith('scalar.'), files
  with _Reads() as r:
    loaded = ocp.v1.load(tmp_path / 'a')
  assert_trees_equal(loaded, state)
  assert r.counts.get('index') == 1 and 'record' not in r.counts, r.counts


def test_cli_verify_reads_the_index(tmp_path):
  state = random_state(mesh())
  ckpt.save(tmp_path, state)
  # A damaged writer record beside a sound index: the index is what restore and the CLI read.
  record = tmp_path / '0' / 'default' / '_pathways' / 'p0.msgpack'
  record.write_bytes(b'\xc1garbage')
  assert_trees_equal(_restore(tmp_path, target=abstract(state)), state)
  proc = procs.run_cli('verify', tmp_path / '0', timeout=120)
  assert proc.returncode == 0, proc.stdout + proc.stderr


def test_index_round_trips_every_kind_of_array():
  def rec(name, dtype, shape, chunk_shape, chunks):
    return records_lib.ArrayRecord(name, dtype, shape, chunk_shape, tuple(
        records_lib.ChunkRecord(o, crc, n) for o, crc, n in chunks))

  isz = {'float32': 4, 'bfloat16': 2, 'int8': 1}
  def cells(shape, chunk_shape, dtype, skip=()):
    out = []
    for i in range(-(-shape[0] // chunk_shape[0])):
      for j in range(-(-shape[1] // chunk_shape[1])):
        o = (i * chunk_shape[0], j * chunk_shape[1])
        if o in skip:
          continue
        n = (min(o[0] + chunk_shape[0], shape[0]) - o[0]) * (min(o[1] + chunk_shape[1], shape[1]) - o[1])
        out.append((o, (o[0] * 131 + o[1]) ^ 0xdeadbeef, n * isz[dtype]))
    return out

  arrays = [
      rec('edges', 'bfloat16', (10, 7), (4, 3), cells((10, 7), (4, 3), 'bfloat16')),  # clipped cells
      rec('partial', 'float32', (8, 8), (4, 4), cells((8, 8), (4, 4), 'float32', skip={(4, 0)})),
      rec('scalar', 'float32', (), (), [((), 7, 4)]),
      rec('empty', 'int8', (0, 4), (1, 4), []),
      rec('off_grid', 'float32', (8,), (4,), [((2,), 5, 16)]),  # not on its grid: list form
  ]
  # Two writers, the chunks of each array split between them.
  writers = [records_lib.WriterRecord(f'p{w}', 'local', tuple(
      dataclasses.replace(a, chunks=a.chunks[w::2]) for a in arrays), stats={'chunks': w})
      for w in range(2)]
  merged = item_lib.merge(writers)
  back = item_lib.decode_index(item_lib.encode_index(merged))
  assert back.arrays() == merged.arrays()
  assert [w.writer for w in back.writers] == ['p0', 'p1'] and back.transports() == {'local'}
  grid = grid_lib.chunk_index([back.arrays()['edges']])
  want = grid_lib.chunk_index([merged.arrays()['edges']])
  assert dict(grid) == want and len(grid) == 9
  assert grid.get((8, 6)) == records_lib.ChunkRecord((8, 6), (8 * 131 + 6) ^ 0xdeadbeef, 2 * 1 * 2)
  assert grid.get((1, 0)) is None and grid.get((12, 0)) is None  # off the grid, out of bounds
  assert grid_lib.chunk_index([back.arrays()['partial']]).get((4, 0)) is None
  assert len(back.arrays()['empty'].chunks) == 0


def test_cli_knows_checksumless_arrays_from_the_index(tmp_path):
  """An index whose only writer is the persistence plugin (no chunk checksums): verify decodes
  the arrays instead of failing every chunk, and show counts writers, not files."""
  import json  # pylint: disable=g-import-not-at-top
  ckpt.save(tmp_path, random_state(mesh()))
  item = tmp_path / '0' / 'default'
  arrays = meta_io.read_item(item).arrays()
  plugin = item_lib.merge([records_lib.WriterRecord(
      writer='controller', transport='persistence',
      arrays=tuple(dataclasses.replace(a, chunks=()) for a in arrays.values()))])
  os.remove(meta_io.index_path(item))
  meta_io.write_index(item, plugin)
  meta_io.clear_cache()

  def cli(*argv):
    return procs.run_cli(*argv, timeout=120)

  out = cli('verify', str(tmp_path / '0'), '--json')
  doc = json.loads(out.stdout)
  assert out.returncode == 3 and doc['problems'] == [], doc['problems']  # intact, unchecked
  assert doc['verdict'] == 'unchecked' and len(doc['unchecked']) == doc['arrays']
  assert doc['modes'] == {'default': 'decode'} and doc['chunks_checksummed'] == 0
  assert 'written by persistence (1 writer)' in cli('show', str(tmp_path), '--step', '0').stdout


def test_the_index_records_who_wrote_each_chunk():
  """The writer column (``grid_writer``): each chunk's writer survives the writer records ->
  index round trip, the join of two parts whose writers differ, and an item of 70,000 writers
  (the uint32 column); an index without it reads as before (writer unknown)."""
  def part(writer, origins, name='x'):
    a = records_lib.ArrayRecord(name, 'float32', (8, 4), (1, 4), tuple(
        records_lib.ChunkRecord((o, 0), o, 16) for o in origins))
    rec = records_lib.WriterRecord(writer, 'local', (a,), save_id=f'id-{writer}')
    return records_lib.decode(records_lib.encode(rec))  # as finalize reads it: through the codec

  merged = item_lib.merge([part('p1', [1, 3, 5, 7]), part('p0', [0, 2, 4, 6])])
  back = item_lib.decode_index(item_lib.encode_index(merged))
  chunks = grid_lib.chunk_index([back.arrays()['x']])
  assert [chunks[(o, 0)].writer for o in range(8)] == ['p0', 'p1'] * 4
  assert 'grid_writer' in str(item_lib.msgpack.unpackb(item_lib.encode_index(merged)))

  # A later part with one more writer: positions in the writers column move, writers do not.
  joined = partial_lib.join_indexes(back, item_lib.merge([part('a9', [0], name='z')]))
  again = item_lib.decode_index(item_lib.encode_index(joined))
  assert [w.writer for w in again.writers] == ['a9', 'p0', 'p1']
  assert [c.writer for c in again.arrays()['x'].chunks] == ['p0', 'p1'] * 4
  assert [c.writer for c in again.arrays()['z'].chunks] == ['a9']

  # An index without the column (written before it): chunks read back with no writer.
  plain = item_lib.merge([records_lib.WriterRecord('p0', 'local', (records_lib.ArrayRecord(
      'x', 'float32', (2,), (1,), (records_lib.ChunkRecord((0,), 1, 4),
                                   records_lib.ChunkRecord((1,), 2, 4))),))])
  assert 'grid_writer' not in str(item_lib.msgpack.unpackb(item_lib.encode_index(plain)))
  assert [c.writer for c in item_lib.decode_index(item_lib.encode_index(plain)).arrays()['x'].chunks] == ['', '']

  # 70,000 writers: the column is uint32, 4 bytes a chunk.
  many = item_lib.merge([records_lib.WriterRecord(f'p{i}', 'local', (records_lib.ArrayRecord(
      'y', 'int8', (70000,), (1,), (records_lib.ChunkRecord((i,), i, 1, f'p{i}'),)),))
      for i in range(70000)])
  obj = item_lib.msgpack.unpackb(item_lib.encode_index(many), raw=False)
  assert len(obj['arrays']['y']['grid_writer']) == 4 * 70000
  ys = item_lib.decode_index(item_lib.encode_index(many)).arrays()['y'].chunks
  assert ys.writer_of(69999) == 'p69999' and ys.writer_of(12345) == 'p12345'


def test_a_saved_index_names_the_writer_of_every_chunk(tmp_path):
  ckpt.save(tmp_path, random_state(mesh()))
  meta_io.clear_cache()
  arrays = meta_io.read_item(tmp_path / '0' / 'default').arrays()
  item = meta_io.read_item(tmp_path / '0' / 'default')
  known = {w.writer for w in item.writers}  # p0, and the records of numpy and scalar leaves
  assert all(c.writer in known for a in arrays.values() for c in a.chunks)
  assert {c.writer for a in arrays.values() for c in a.chunks} == known, known


def test_writers_at_names_the_writers_of_a_set_of_cells():
  grid = grid_lib.ChunkGrid((4, 6), (2, 3), 4, np.zeros(4, np.uint32),
                            writer=np.array([0, 1, -1, 1], np.int32), writer_names=('p0', 'p1'))
  assert grid.writers_at([(0, 0), (2, 3)]) == {'p0', 'p1'}
  assert grid.writers_at([(2, 0)]) == set()  # unknown
  assert grid.writers_at([(1, 0), (8, 0)]) == set()  # off the grid, out of bounds
  assert grid_lib.ChunkGrid((4,), (2,), 4, np.zeros(2, np.uint32)).writers_at([(0,)]) == set()
