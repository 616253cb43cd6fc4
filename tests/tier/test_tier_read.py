"""The restore's read of this node's tier: a tier copy is used only
when its manifest's dtype, shape and chunk shape are the committed step's and each chunk file is
a regular file of the committed size, read as raw bits into the region buffer; anything else is
a damaged copy that storage serves, with one log line, and never blocks.

Real Orbax CheckpointManager, real tensorstore, real files (FIFOs, symlinks). A restore that
could hang runs in a thread bounded by ``HANG_S``, so a hang fails as an assertion here rather
than at pytest's timeout.
"""

from __future__ import annotations

import logging
import os
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways.format import checksum
from orbax_pathways import stats
from orbax_pathways.fleet import chain as tier_chain
from orbax_pathways.tier import chunk_read
from orbax_pathways.tier import manifest as tier_layout
from orbax_pathways.tier import store as tier_store
from support import ckpt

P = jax.sharding.PartitionSpec
HANG_S = 120.0  # a restore of a few KiB takes ~1 s here, even on a loaded machine


def _state():
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('x', 'y'))
  rng = np.random.default_rng(0)
  host = {
      # 8-way sharded: one chunk per device box, each read straight into its region.
      'w': rng.standard_normal((256, 64)).astype(np.float32),
      # Sharded over 'x' only, written by its 2 replicas: chunks are column halves of the row
      # block each device needs (strided in the region's buffer).
      'r': rng.standard_normal((32, 4096)).astype(np.float32),
      'b': rng.integers(0, 1000, (32,)).astype(np.int32),
  }
  specs = {'w': P('x', 'y'), 'r': P('x', None), 'b': P()}
  state = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, specs[k])) for k, v in host.items()}
  return state, host


def _save(tier, root):
  # coalesce_bytes=0: small arrays are chunked per shard, so 'w' has one chunk per device box.
  state, host = _state()
  return state, host, ckpt.save_tier_entry(tier, root, state)


def _bounded(fn, on_timeout=lambda: None):
  """``fn()`` in a thread; fails the test if it does not return within ``HANG_S`` (then calls
  ``on_timeout`` to release what the restore is stuck on, so the thread ends)."""
  result: dict = {}

  def run():
    try:
      result['value'] = fn()
    except BaseException as e:  # pylint: disable=broad-except  (re-raised in the test thread)
      result['error'] = e

  t = threading.Thread(target=run, daemon=True)
  t.start()
  t.join(HANG_S)
  if t.is_alive():
    on_timeout()
    t.join(30)
    pytest.fail(f'the restore did not finish within {HANG_S:.0f} s: it blocked on a tier file')
  if 'error' in result:
    raise result['error']
  return result['value']


def _restore(root, target):
  with ocp.CheckpointManager(root) as m:
    out = m.restore(1, args=ocp.args.StandardRestore(target))
  return {k: np.asarray(v) for k, v in out.items()}, stats.last_restore()


def _chain_lines(caplog):
  return [r.getMessage() for r in caplog.records if 'node-local copy' in r.getMessage()]


def _assert_exact(out, host):
  for k, v in host.items():
    assert out[k].dtype == v.dtype, k
    np.testing.assert_array_equal(out[k], v, err_msg=k)


def test_every_chunk_is_read_from_the_tier_bit_exact(tmp_path):
  """The baseline the cases below fall back from: contiguous and strided chunk views of the
  region buffers, every chunk from the tier, every byte checked."""
  state, host, entry = _save(tmp_path / 'tier', tmp_path / 'ckpt')
  out, st = _restore(tmp_path / 'ckpt', state)
  _assert_exact(out, host)
  assert st.bytes_by_source.get('storage') == 0
  assert st.bytes_by_source['local'] == sum(v.nbytes for v in host.values())
  r = next(a for a in entry.manifest.arrays if a.name == 'r')
  assert r.chunk_shape[1] < r.shape[1], 'r should be stored in column halves (strided reads)'


@pytest.mark.parametrize('spec', [P('x', None), P()])
def test_chunks_narrower_than_the_target_regions_are_read_from_the_tier(tmp_path, spec):
  """Another target sharding: each region holds several chunks side by side, so a chunk's place
  is a column block of short rows ('w': 128-byte runs, read through a staging buffer; 'r': 8 KiB
  runs, read in place); the whole array on every device (P()) too."""
  state, host, entry = _save(tmp_path / 'tier', tmp_path / 'ckpt')
  w = next(a for a in entry.manifest.arrays if a.name == 'w')
  region = (64, 64) if spec == P('x', None) else (256, 64)
  _, run, count = chunk_read.runs(region, (0, 32), w.chunk_shape, 4)
  assert count > 1 and run < chunk_read.MIN_RUN_BYTES, (w.chunk_shape, run, count)
  mesh = state['w'].sharding.mesh
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=jax.sharding.NamedSharding(
                mesh, spec if v.ndim == 2 else P()))
            for k, v in host.items()}
  out, st = _restore(tmp_path / 'ckpt', target)
  _assert_exact(out, host)
  assert st.bytes_by_source.get('storage') == 0
  assert st.bytes_by_source['local'] == sum(v.nbytes for v in host.values())


def test_a_manifest_whose_dtype_was_edited_is_not_used(tmp_path, caplog):
  """Only the dtype edited (float32 -> int32, bytes unchanged, so every crc32c still matches):
  the restore must return storage's values, not the float bits converted as int32 values."""
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  state, host, entry = _save(tier, root)
  path = os.path.join(entry.path, tier_layout.MANIFEST)
  with open(path, 'rb') as f:
    m = tier_layout.decode(f.read())
  arrays = tuple(a if a.name != 'w' else type(a)(**{**a.__dict__, 'dtype': 'int32'})
                 for a in m.arrays)
  with open(path, 'wb') as f:
    f.write(tier_layout.encode(type(m)(**{**m.__dict__, 'arrays': arrays})))
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  out, st = _restore(root, state)
  _assert_exact(out, host)
  assert st.bytes_by_source['storage'] == host['w'].nbytes
  assert st.bytes_by_source['local'] == host['r'].nbytes + host['b'].nbytes
  lines = _chain_lines(caplog)
  assert len(lines) == 1, lines
  assert "'w'" in lines[0] and 'int32' in lines[0] and 'float32' in lines[0], lines[0]


def _replace(kind, path, other):
  """Puts ``kind`` where the chunk file ``path`` was; ``other`` holds the same bytes elsewhere."""
  data = open(path, 'rb').read()
  os.remove(path)
  if kind == 'fifo':
    os.mkfifo(path, 0o600)
  elif kind == 'symlink_to_dev_zero':
    os.symlink('/dev/zero', path)
  elif kind == 'symlink_to_the_same_bytes':  # content right, but the tier never follows a link
    with open(other, 'wb') as f:
      f.write(data)
    os.symlink(other, path)
  elif kind == 'truncated':
    with open(path, 'wb') as f:
      f.write(data[:-4])
  elif kind == 'longer':
    with open(path, 'wb') as f:
      f.write(data + b'\0' * 4)
  else:
    raise AssertionError(kind)


def _release(path):
  """Lets a reader blocked on the FIFO at ``path`` go on (it then reads end of file)."""
  try:
    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
  except OSError:
    pass


KINDS = ['fifo', 'symlink_to_dev_zero', 'symlink_to_the_same_bytes', 'truncated', 'longer']


@pytest.mark.parametrize('kind', KINDS)
def test_a_chunk_file_swapped_after_the_listing_is_refused(tmp_path, caplog, monkeypatch, kind):
  """The chunk file is replaced after the restore listed the tier (the window an attacker on the
  node would use, and one no listing-time check closes): the chunk comes from storage, the
  restore finishes, one log line."""
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  state, host, entry = _save(tier, root)
  w = next(a for a in entry.manifest.arrays if a.name == 'w')
  path = os.path.join(entry.path, w.files[0])
  real = tier_chain.for_restore

  def listed_then_swapped(*args, **kwargs):
    chain = real(*args, **kwargs)
    _replace(kind, path, str(tmp_path / 'elsewhere.bin'))
    return chain

  monkeypatch.setattr(tier_chain, 'for_restore', listed_then_swapped)
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  out, st = _bounded(lambda: _restore(root, state), lambda: _release(path))
  _assert_exact(out, host)
  assert st.bytes_by_source['storage'] == w.nbytes[0]
  assert st.bytes_by_source['local'] == sum(v.nbytes for v in host.values()) - w.nbytes[0]
  lines = _chain_lines(caplog)
  assert len(lines) == 1, lines
  assert path in lines[0], lines[0]


def test_a_fifo_planted_in_place_of_a_chunk_never_blocks_a_restore(tmp_path, caplog):
  """The case as a user meets it: the FIFO is there before the restore starts."""
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  state, host, entry = _save(tier, root)
  w = next(a for a in entry.manifest.arrays if a.name == 'w')
  path = os.path.join(entry.path, w.files[0])
  _replace('fifo', path, '')
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  out, st = _bounded(lambda: _restore(root, state), lambda: _release(path))
  _assert_exact(out, host)
  assert st.bytes_by_source['storage'] >= w.nbytes[0]
  assert _chain_lines(caplog)


# tier/chunk_read.py on real files: every layout of a chunk in a region buffer.

Box = chunk_read.Box
LAYOUTS = [  # (region shape, chunk start in the region, chunk shape, dtype)
    ((), (), (), 'float32'),  # a 0-d region
    ((64,), (16,), (16,), 'int32'),
    ((8, 64), (0, 0), (8, 64), 'float32'),  # the region is the chunk
    ((8, 64), (4, 0), (4, 64), 'float32'),  # whole rows: one run
    ((8, 64), (0, 32), (8, 32), 'float32'),  # a column block: 128-byte runs (staging)
    ((8, 2048), (0, 1024), (8, 1024), 'float32'),  # 4 KiB runs: read in place
    ((6, 4, 2048), (3, 1, 0), (3, 2, 2048), 'bfloat16'),  # 3-d, in place
    ((6, 4, 10), (0, 2, 5), (6, 2, 5), 'uint8'),  # 3-d, staging
    ((8, 64), (0, 0), (0, 64), 'float32'),  # empty
]


@pytest.mark.parametrize('region_shape,start,shape,dtype', LAYOUTS)
def test_a_chunk_file_lands_bit_exact_in_its_place(tmp_path, region_shape, start, shape, dtype):
  import ml_dtypes  # pylint: disable=g-import-not-at-top  (bfloat16)
  dt = np.dtype(ml_dtypes.bfloat16 if dtype == 'bfloat16' else dtype)
  rng = np.random.default_rng(1)
  # Random bits, NaN payloads included: nothing may be converted on the way.
  chunk = rng.integers(0, 256, int(np.prod(shape, dtype=np.int64)) * dt.itemsize,
                       dtype=np.uint8).view(dt).reshape(shape)
  path = str(tmp_path / 'c.bin')
  with open(path, 'wb') as f:
    f.write(np.ascontiguousarray(chunk).tobytes())
  region_box = Box.full(region_shape)
  box = Box(tuple(start), tuple(a + s for a, s in zip(start, shape)))
  for fill in ('file', 'array'):
    region = np.full(tuple(region_shape) + (dt.itemsize,), 0xAB, np.uint8).view(dt).reshape(
        region_shape)
    before = region.copy()
    place = chunk_read.Place(region, region_box, box)
    if fill == 'file':
      with open(path, 'rb', buffering=0) as f:
        place.fill_from_file(f.fileno(), path)
    else:
      place.fill_from_array(chunk)
    sl = box.relative_to(region_box) if region_shape else ...
    assert region[sl].tobytes() == chunk.tobytes(), fill
    rest = before.copy()
    rest[sl] = chunk
    assert region.tobytes() == rest.tobytes(), f'{fill}: bytes outside the chunk changed'
    assert place.crc32c == checksum.of_array(chunk), fill


def test_a_chunk_file_that_ends_early_is_an_error(tmp_path):
  path = str(tmp_path / 'c.bin')
  with open(path, 'wb') as f:
    f.write(b'\1' * 100)
  region = np.zeros((8, 64), np.float32)
  place = chunk_read.Place(region, Box.full((8, 64)), Box((0, 0), (8, 64)))
  with open(path, 'rb', buffering=0) as f, pytest.raises(OSError, match='ended after 100 of 2048'):
    place.fill_from_file(f.fileno(), path)


def test_an_array_of_another_dtype_or_shape_is_not_converted():
  region = np.zeros((4, 4), np.float32)
  place = chunk_read.Place(region, Box.full((4, 4)), Box((0, 0), (4, 4)))
  with pytest.raises(ValueError, match='int32 .* where the committed step stores float32'):
    place.fill_from_array(np.ones((4, 4), np.int32))
  with pytest.raises(ValueError, match=r'\[2, 8\]'):
    place.fill_from_array(np.ones((2, 8), np.float32))
  assert not region.any()


def test_runs_of_a_chunk_in_a_region():
  assert chunk_read.runs((8, 64), (4, 0), (4, 64), 4) == (4 * 256, 4 * 256, 1)
  assert chunk_read.runs((8, 64), (0, 32), (8, 32), 4) == (128, 128, 8)
  assert chunk_read.run_offsets((8, 64), (0, 32), (8, 32), 4) == [128 + 256 * i for i in range(8)]
  assert chunk_read.runs((6, 4, 10), (1, 2, 0), (2, 2, 10), 1) == (60, 20, 2)
  assert chunk_read.run_offsets((6, 4, 10), (1, 2, 0), (2, 2, 10), 1) == [60, 100]
  assert chunk_read.runs((6, 4, 10), (1, 2, 5), (2, 2, 5), 1) == (65, 5, 4)
  assert chunk_read.run_offsets((6, 4, 10), (1, 2, 5), (2, 2, 5), 1) == [65, 75, 105, 115]


def test_a_large_region_is_read_in_groups_and_a_bad_chunk_in_one_falls_back(tmp_path, caplog):
  """A region of more than ``GROUP_BYTES`` (one device holds a 40 MiB array of 4 MiB chunks) is
  filled by several threads at once; a damaged chunk in the last group still comes from
  storage, alone."""
  tier, root = tmp_path / 'tier', tmp_path / 'ckpt'
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), max_chunk_bytes=4 << 20))
  host = {'big': np.random.default_rng(2).standard_normal((2560, 4096), dtype=np.float32)}
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  state = {k: jax.device_put(v, dev) for k, v in host.items()}
  with ocp.CheckpointManager(root) as m:
    m.save(1, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
  tier_store.flush()
  (entry,) = tier_store.entries(str(tier), str(root))
  (big,) = entry.manifest.arrays
  assert host['big'].nbytes > tier_chain.GROUP_BYTES and len(big.files) >= 10, big.chunk_shape
  last = max(range(len(big.origins)), key=lambda c: big.origins[c])
  with open(os.path.join(entry.path, big.files[last]), 'r+b') as f:
    f.seek(100)
    byte = f.read(1)
    f.seek(100)
    f.write(bytes([byte[0] ^ 1]))
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  out, st = _restore(root, state)
  _assert_exact(out, host)
  assert st.bytes_by_source['storage'] == big.nbytes[last]
  assert st.bytes_by_source['local'] == host['big'].nbytes - big.nbytes[last]
  lines = _chain_lines(caplog)
  assert len(lines) == 1 and 'damaged' in lines[0], lines
  # Its chunks were mapped into the region buffer (``storage/pages``), the damaged one too,
  # before storage's bytes went over it: that write stayed private to the buffer.
  with open(os.path.join(entry.path, big.files[last]), 'rb') as f:
    f.seek(100)
    assert f.read(1)[0] == byte[0] ^ 1


def test_groups_cut_a_region_s_chunks_in_order():
  box = lambda i: Box((i,), (i + 1,))  # noqa: E731  (one element each)
  chunks = [(0, box(i)) for i in range(5)]
  assert tier_chain._groups([], 4, 8) == []
  assert tier_chain._groups(chunks, 4, 8) == [chunks[0:2], chunks[2:4], chunks[4:5]]
  assert tier_chain._groups(chunks, 4, 2) == [[c] for c in chunks]  # a chunk above the limit: alone
  assert tier_chain._groups(chunks, 4, 100) == [chunks]


@pytest.mark.parametrize('shape', [(16, 16), (1024, 2048), ()])
def test_region_buffers_are_aligned_and_reach_the_devices_without_a_copy(shape):
  """The reader's region buffers (below and above ``MAPPED_BYTES``: numpy's allocation, then an
  anonymous mapping of their own): aligned, writable, C-ordered, and aliased by
  ``jax.device_put`` on the CPU backend (no second pass over the bytes)."""
  from orbax_pathways.storage import reader  # pylint: disable=g-import-not-at-top
  a = reader.aligned_empty(shape, np.float32)
  assert a.shape == shape and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
  assert a.ctypes.data % 64 == 0
  a[...] = 3
  x = jax.device_put(a, jax.devices()[0])
  assert x.unsafe_buffer_pointer() == a.ctypes.data
  del a
  assert float(np.asarray(x).sum()) == 3 * int(np.prod(shape))
