"""The ``_pathways`` metadata codec (``orbax_pathways.format``), property-tested on random
records: a writer record (``<writer>.msgpack``) and an item's index (``index.msgpack``, schema 2)
decode to what was encoded, and damaged or newer files fail with ``MetadataError`` naming the file.

Random arrays cover scalars, zero-size and clipped (edge) chunk grids, partial coverage (cells
nobody wrote), chunks off the regular grid, every stored dtype family, and sharding records with
nested PartitionSpec entries (``('data', 'model')`` inside a spec). Pure: no jax, no storage.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from orbax_pathways import errors
from orbax_pathways.format import grid as grid_lib
from orbax_pathways.format import item as item_lib
from orbax_pathways.format import partial as partial_lib
from orbax_pathways.format import records as records_lib

FAST = settings(max_examples=150, deadline=None, database=None)
PATH = '/ckpt/7/default/_pathways/p3.msgpack'
INDEX_PATH = '/ckpt/7/default/_pathways/index.msgpack'

DTYPES = ('float32', 'bfloat16', 'float16', 'float64', 'float8_e4m3fn', 'int8', 'uint8', 'int32',
          'int64', 'uint32', 'bool', 'complex64')
AXES = ('data', 'model', 'replica', 'stage')
names = st.text(min_size=1, max_size=12)
u32 = st.integers(0, 2**32 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)


# ---- strategies ------------------------------------------------------------------------------

@st.composite
def shardings(draw):
  """None, or a record as the primary writer stores it; spec entries None, an axis, or a tuple
  of axes (nested), also the empty tuple."""
  kind = draw(st.sampled_from(['named', 'named', 'single_device', 'other', None]))
  if kind is None:
    return None
  if kind != 'named':
    return records_lib.ShardingRecord(kind=kind)
  ndim = draw(st.integers(0, 3))
  axis_names = tuple(draw(st.permutations(AXES))[:ndim])
  mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
  n = math.prod(mesh_shape)
  device_ids = tuple(draw(st.permutations(range(n))))
  num_slices = draw(st.integers(1, 4))
  entry = st.one_of(st.none(), st.sampled_from(axis_names or ('data',)),
                    st.lists(st.sampled_from(axis_names or ('data',)), max_size=3, unique=True)
                    .map(tuple))
  return records_lib.ShardingRecord(
      kind='named', mesh_shape=mesh_shape, axis_names=axis_names, device_ids=device_ids,
      device_slices=tuple(draw(st.lists(st.integers(0, num_slices - 1), min_size=n, max_size=n))),
      spec=tuple(draw(st.lists(entry, max_size=4))),
      slice_axes=tuple(draw(st.lists(st.sampled_from(axis_names), max_size=2, unique=True)))
      if axis_names else (),
      num_slices=num_slices)


def _cells(shape, chunk_shape):
  return itertools.product(*(range(0, d, c) for d, c in zip(shape, chunk_shape)))


def _nbytes(origin, shape, chunk_shape, dtype):
  return math.prod(min(o + c, d) - o for o, c, d in zip(origin, chunk_shape, shape)) * (
      records_lib.itemsize(dtype))


@st.composite
def arrays(draw, name):
  """An array record whose chunks are either cells of its regular grid (clipped at the edges;
  some cells may have no record) or, sometimes, origins off that grid."""
  dtype = draw(st.sampled_from(DTYPES))
  ndim = draw(st.integers(0, 3))
  shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
  chunk_shape = tuple(draw(st.integers(1, max(d, 1) + 2)) for d in shape)
  if draw(st.integers(0, 5)):
    cells = list(_cells(shape, chunk_shape))
    keep = draw(st.lists(st.booleans(), min_size=len(cells), max_size=len(cells)))
    origins = [o for o, k in zip(cells, keep) if k]
    chunks = tuple(records_lib.ChunkRecord(o, draw(u32), _nbytes(o, shape, chunk_shape, dtype))
                   for o in origins)
  else:  # off the grid (never written by this version; the codec keeps them as a list)
    origins = draw(st.lists(st.tuples(*[st.integers(0, 20)] * ndim), max_size=4, unique=True))
    chunks = tuple(records_lib.ChunkRecord(o, draw(u32), draw(st.integers(0, 1 << 40)))
                   for o in origins)
  return records_lib.ArrayRecord(name=name, dtype=dtype, shape=shape, chunk_shape=chunk_shape,
                              chunks=chunks, sharding=draw(shardings()))


@st.composite
def writer_records(draw, schema=st.sampled_from([1, records_lib.SCHEMA_VERSION]), stat=i64):
  array_names = draw(st.lists(names, max_size=4, unique=True))
  return records_lib.WriterRecord(
      writer=draw(names), transport=draw(st.sampled_from(['local', 'colocated', 'persistence'])),
      arrays=tuple(draw(arrays(n)) for n in array_names),
      library_version=draw(st.text(max_size=8)),
      stats=draw(st.dictionaries(names, stat, max_size=3)), schema=draw(schema))


@st.composite
def items(draw):
  """1-4 writers of one item: each array's chunks split among them (each chunk written once),
  its sharding recorded by the primary only, some writers holding none of an array."""
  n = draw(st.integers(1, 4))
  writers = draw(st.lists(names, min_size=n, max_size=n, unique=True))
  array_names = draw(st.lists(names, max_size=4, unique=True))
  per_writer = {w: [] for w in writers}
  for name in array_names:
    a = draw(arrays(name))
    owner = draw(st.lists(st.sampled_from(writers), min_size=len(a.chunks),
                          max_size=len(a.chunks)))
    holders = [w for w in writers if w in owner or draw(st.booleans())] or writers[:1]
    for w in holders:
      mine = tuple(c for c, o in zip(a.chunks, owner) if o == w)
      per_writer[w].append(dataclasses.replace(
          a, chunks=mine, sharding=a.sharding if w == holders[0] else None))
  records = [records_lib.WriterRecord(
      writer=w, transport=draw(st.sampled_from(['local', 'colocated'])),
      arrays=tuple(per_writer[w]), library_version=draw(st.sampled_from(['', '0.1.0'])),
      stats=draw(st.dictionaries(st.sampled_from(['chunks', 'bytes', 'seconds_ms']),
                                 st.integers(0, 2**40), max_size=2)))
      for w in writers]
  return item_lib.merge(draw(st.permutations(records)))


def _lookups(array):
  """origin -> record as restore looks a chunk up (the index's grid made on access)."""
  mapping = grid_lib.chunk_index([array])
  return {tuple(o): mapping.get(tuple(o)) for o in mapping}


# ---- round trips -----------------------------------------------------------------------------

@FAST
@given(writer_records())
def test_writer_record_round_trips(record):
  data = records_lib.encode(record)
  back = records_lib.decode(data, path=PATH)
  assert back == record
  assert records_lib.encode(back) == data  # one encoding per record


def test_every_writer_record_carries_the_library_version_and_its_stats():
  """What ``orbax-pathways show`` reports of a writer: the version that wrote it and what it
  wrote (the persistence plugin's writes report no stats)."""
  from orbax_pathways import version  # pylint: disable=g-import-not-at-top
  rec = records_lib.writer_record('p0', 'local', written_bytes=12, chunks=3, save_id='s')
  back = records_lib.decode(records_lib.encode(rec))
  assert (back.library_version, dict(back.stats), back.save_id) == (
      version.VERSION, {'written_bytes': 12, 'chunks': 3}, 's')
  assert records_lib.writer_record('controller', 'persistence').stats == {}


@FAST
@given(items())
def test_index_round_trips(item):
  data = item_lib.encode_index(item)
  back = item_lib.decode_index(data, path=INDEX_PATH)
  assert back.source == 'index'
  want = item.arrays()
  got = back.arrays()
  assert list(got) == sorted(want)
  for name, a in want.items():
    b = got[name]
    assert (b.dtype, b.shape, b.chunk_shape, b.sharding) == (a.dtype, a.shape, a.chunk_shape,
                                                              a.sharding), name
    assert b == a, name
    assert len(b.chunks) == len(a.chunks), name
    # Every recorded chunk is found at its origin, with its crc32c and byte count.
    assert _lookups(b) == {tuple(c.origin): c for c in a.chunks}, name
  ws = sorted(item.writers, key=lambda w: w.writer)
  assert list(back.writers) == [
      dataclasses.replace(item_lib.summary(w), schema=records_lib.SCHEMA_VERSION) for w in ws]
  assert back.transports() == item.transports()
  # Re-encoding the decoded index, or the index made from the records, gives the same bytes.
  assert item_lib.encode_index(back) == data
  assert item_lib.encode_index(item_lib.index_of(item)) == data


def test_index_keeps_grid_cells_nobody_wrote_absent():
  """A concrete partial grid: clipped edge cells have their clipped byte counts, the hole is
  absent (not a zero checksum), out-of-bounds and off-grid origins are not found."""
  shape, chunk_shape = (10, 7), (4, 3)
  chunks = tuple(records_lib.ChunkRecord(o, 1000 + i, _nbytes(o, shape, chunk_shape, 'bfloat16'))
                 for i, o in enumerate(_cells(shape, chunk_shape)) if o != (4, 3))
  a = records_lib.ArrayRecord('w', 'bfloat16', shape, chunk_shape, chunks)
  item = item_lib.merge([records_lib.WriterRecord('p0', 'local', (a,))])
  back = item_lib.decode_index(item_lib.encode_index(item), path=INDEX_PATH).arrays()['w']
  assert isinstance(back.chunks, grid_lib.ChunkGrid) and len(back.chunks) == 8
  lookup = grid_lib.chunk_index([back])
  assert lookup.get((8, 6)) == records_lib.ChunkRecord((8, 6), 1000 + 8, 2 * 1 * 2)
  assert lookup.get((4, 3)) is None and (4, 3) not in lookup
  assert lookup.get((12, 0)) is None and lookup.get((1, 0)) is None


# ---- damaged and newer files -----------------------------------------------------------------

def _assert_names(err, path):
  text = str(err.value)
  assert path in text, text
  assert isinstance(err.value, errors.RestoreError)  # what restore callers catch


@FAST
@given(writer_records(), st.data())
def test_truncated_writer_record_is_a_metadata_error_naming_the_file(record, data):
  encoded = records_lib.encode(record)
  cut = data.draw(st.integers(0, len(encoded) - 1))
  with pytest.raises(records_lib.MetadataError, match='is damaged') as err:
    records_lib.decode(encoded[:cut], path=PATH)
  _assert_names(err, PATH)


@FAST
@given(items(), st.data())
def test_truncated_index_is_a_metadata_error_naming_the_file(item, data):
  encoded = item_lib.encode_index(item)
  cut = data.draw(st.integers(0, len(encoded) - 1))
  with pytest.raises(records_lib.DamagedIndexError, match='is damaged') as err:  # rebuilt from records
    item_lib.decode_index(encoded[:cut], path=INDEX_PATH)
  _assert_names(err, INDEX_PATH)


@FAST
@given(writer_records(), st.binary(min_size=1, max_size=16))
def test_trailing_bytes_are_a_metadata_error(record, extra):
  with pytest.raises(records_lib.MetadataError, match='is damaged') as err:
    records_lib.decode(records_lib.encode(record) + extra, path=PATH)
  _assert_names(err, PATH)


def _with(data: bytes, **fields) -> bytes:
  o = msgpack.unpackb(data, raw=False, strict_map_key=False)
  o.update(fields)
  return msgpack.packb(o, use_bin_type=True)


@FAST
@given(writer_records(), items(), st.integers(1, 1000))
def test_newer_schema_is_a_metadata_error_saying_upgrade(record, item, ahead):
  newer = records_lib.SCHEMA_VERSION + ahead
  with pytest.raises(records_lib.MetadataError, match=(
      rf'has schema {newer}, this version reads up to {records_lib.SCHEMA_VERSION}\. '
      r'Upgrade orbax-pathways\.')) as err:
    records_lib.decode(_with(records_lib.encode(record), schema=newer), path=PATH)
  _assert_names(err, PATH)
  with pytest.raises(records_lib.MetadataError, match=rf'has schema {newer}.*Upgrade') as err:
    item_lib.decode_index(_with(item_lib.encode_index(item), schema=newer), path=INDEX_PATH)
  _assert_names(err, INDEX_PATH)
  assert not isinstance(err.value, records_lib.DamagedIndexError)  # not rebuilt: upgrade instead


@FAST
@given(writer_records())
def test_a_writer_record_is_not_an_index(record):
  with pytest.raises(records_lib.DamagedIndexError, match="is not an index \\(kind None\\)") as err:
    item_lib.decode_index(records_lib.encode(record), path=INDEX_PATH)
  _assert_names(err, INDEX_PATH)


@pytest.mark.parametrize('field', ['writer', 'transport', 'arrays'])
def test_missing_field_is_a_metadata_error_naming_it(field):
  record = records_lib.WriterRecord('p0', 'local', ())
  o = msgpack.unpackb(records_lib.encode(record), raw=False)
  del o[field]
  with pytest.raises(records_lib.MetadataError, match=f"is missing field '{field}'") as err:
    records_lib.decode(msgpack.packb(o, use_bin_type=True), path=PATH)
  _assert_names(err, PATH)


@pytest.mark.parametrize('data', [
    b'', b'\xc1', b'\x01', b'\x93\x01\x02\x03', b'{"schema": 2}', msgpack.packb({'schema': 'two'}),
    msgpack.packb({'schema': None})])
def test_garbage_is_a_metadata_error(data):
  for decode, path in ((records_lib.decode, PATH), (item_lib.decode_index, INDEX_PATH)):
    with pytest.raises(records_lib.MetadataError, match='is damaged') as err:
      decode(data, path=path)
    _assert_names(err, path)
    assert isinstance(err.value, records_lib.DamagedIndexError) == (decode is item_lib.decode_index)


# A fixed record and index, damaged in every way listed below; decoding must raise MetadataError
# naming the file, at decode time (not later, when restore walks the chunks or the writers).
_RECORD = records_lib.WriterRecord('p0', 'local', (records_lib.ArrayRecord(
    'w', 'float32', (4, 4), (2, 4), (records_lib.ChunkRecord((0, 0), 5, 32),),
    records_lib.ShardingRecord('named', (2,), ('data',), (0, 1), (0, 0), (('data', 'model'),),
                            ('data',), 2)),), stats={'chunks': 1})
_CODECS = {'record': (records_lib.encode(_RECORD), records_lib.decode, PATH),
           'index': (item_lib.encode_index(item_lib.merge([_RECORD])), item_lib.decode_index,
                     INDEX_PATH)}


def _decode_all(kind, data):
  """Decodes and walks everything restore and the CLI read."""
  _, decode, path = _CODECS[kind]
  out = decode(data, path=path)
  if kind == 'index':
    list(out.writers)
    for a in out.arrays().values():
      list(a.chunks)
  return out


def _bit_flips(data: bytes):
  for i in range(len(data)):
    for bit in range(8):
      flipped = bytearray(data)
      flipped[i] ^= 1 << bit
      yield bytes(flipped)


@pytest.mark.parametrize('kind', ['record', 'index'])
def test_every_single_bit_flip_decodes_or_names_the_file(kind):
  """No checksum guards these files: a flipped bit may still decode (to other values, which the
  chunk checksums then catch), but it never escapes as anything but MetadataError."""
  data, _, path = _CODECS[kind]
  for flipped in _bit_flips(data):
    try:
      _decode_all(kind, flipped)
    except records_lib.MetadataError as e:
      assert path in str(e), str(e)


def _damaged(kind, field_path, value):
  o = msgpack.unpackb(_CODECS[kind][0], raw=False)
  node = o
  for k in field_path[:-1]:
    node = node[k]
  node[field_path[-1]] = value
  return msgpack.packb(o, use_bin_type=True)


@pytest.mark.parametrize('kind,field_path,value', [
    pytest.param('record', ('arrays', 'w'), 0, id='record-arrays.w'),
    pytest.param('record', ('arrays', 'w', 'origins'), 5, id='record-origins'),
    pytest.param('record', ('arrays', 'w', 'sharding', 'mesh_shape'), None, id='record-mesh'),
    pytest.param('index', ('arrays', 'w', 'grid_crc32c'), b'\x00' * 3, id='index-grid_crc32c'),
    pytest.param('index', ('arrays', 'w', 'dtype'), 'not-a-dtype', id='index-dtype'),
    pytest.param('index', ('writers', 'writer'), 7, id='index-writers.writer'),
    pytest.param('record', ('arrays',), [], id='record-arrays'),
    pytest.param('index', ('arrays',), [], id='index-arrays'),
    pytest.param('index', ('writers', 'stats'), [], id='index-writers.stats'),
    pytest.param('index', ('arrays', 'w', 'chunk_shape'), [0, 4],
                 id='index-chunk_shape'),
    pytest.param('index', ('writers', 'stats', 'chunks'), 3,
                 id='index-stats.chunks'),
])
def test_wrongly_typed_field_is_a_metadata_error(kind, field_path, value):
  with pytest.raises(records_lib.MetadataError) as err:
    _decode_all(kind, _damaged(kind, field_path, value))
  _assert_names(err, _CODECS[kind][2])
  if kind == 'index':
    assert isinstance(err.value, records_lib.DamagedIndexError)


# ---- partial saves: parts joined -------------------------------------------------------------

def _renamed(item, prefix):
  """``item`` with every array renamed (parts of a partial save hold different arrays)."""
  return item_lib.ItemMetadata(tuple(dataclasses.replace(w, arrays=tuple(
      dataclasses.replace(a, name=prefix + a.name) for a in w.arrays)) for w in item.writers))


@FAST
@given(items(), items())
def test_joined_indexes_hold_every_array_of_both_parts_once(a, b):
  a, b = _renamed(a, 'a/'), _renamed(b, 'b/')
  ia = item_lib.decode_index(item_lib.encode_index(a))
  ib = item_lib.decode_index(item_lib.encode_index(b))
  joined = partial_lib.join_indexes(ia, ib)
  want = {**a.arrays(), **b.arrays()}
  got = item_lib.decode_index(item_lib.encode_index(joined)).arrays()
  assert sorted(got) == sorted(want)
  for name, rec in want.items():
    assert sorted(got[name].chunks, key=lambda c: c.origin) == sorted(rec.chunks, key=lambda c: c.origin)
  assert partial_lib.join_indexes(joined, ib) is joined and partial_lib.join_indexes(joined, ia) is joined
  writers = {w.writer for w in (*a.writers, *b.writers)}
  assert [w.writer for w in joined.writers] == sorted(writers)
  if joined is ia:  # b brought nothing new (no array, no writer): nothing joined, stats kept
    return
  for w in joined.writers:
    for k, v in w.stats.items():
      assert v == sum(int(x.stats.get(k) or 0) for x in (*a.writers, *b.writers) if x.writer == w.writer)


# Stats are counts (bytes, chunks): two parts' sum must still be an int64 for the codec.
COUNT = st.integers(0, 2**61)


@FAST
@given(writer_records(stat=COUNT), writer_records(stat=COUNT))
def test_joined_records_keep_both_parts_arrays_later_winning(a, b):
  b = dataclasses.replace(b, writer=a.writer)
  joined = partial_lib.join_records(a, b)
  assert {x.name: x for x in joined.arrays} == {**{x.name: x for x in a.arrays},
                                                **{x.name: x for x in b.arrays}}
  assert partial_lib.join_records(joined, b) is joined
  if any(x not in a.arrays for x in b.arrays):
    assert joined.stats == {k: a.stats.get(k, 0) + b.stats.get(k, 0) for k in {*a.stats, *b.stats}}
  assert records_lib.decode(records_lib.encode(joined)) == joined
  with pytest.raises(ValueError, match='cannot join'):
    partial_lib.join_records(a, dataclasses.replace(b, writer=a.writer + 'x'))
