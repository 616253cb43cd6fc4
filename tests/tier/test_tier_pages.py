"""A chunk of this node's tier mapped into its region buffer instead of copied there
(``storage/pages``): the bytes are the file's, checked where they lie; a write
into the buffer never reaches the tier's file; the mapping goes with the last array on it; a
chunk that cannot be mapped is copied, bit for bit. Real files, real mappings
(``/proc/self/maps`` is what is checked), real jax CPU buffers.
"""

from __future__ import annotations

import gc
import os

import jax
import numpy as np
import pytest

from orbax_pathways.format import checksum
from orbax_pathways.storage import pages
from orbax_pathways.storage import reader
from orbax_pathways.tier import chunk_read

Box = chunk_read.Box

pytestmark = pytest.mark.skipif(not pages.enabled(), reason='mappings are Linux-only')


def _maps() -> str:
  with open('/proc/self/maps', encoding='utf-8') as f:
    return f.read()


def _chunk_file(tmp_path, shape, dtype=np.float32, name='c.bin'):
  data = np.random.default_rng(3).standard_normal(shape).astype(dtype)
  path = str(tmp_path / name)
  with open(path, 'wb') as f:
    f.write(data.tobytes())
  return path, data


def _fill(region, region_box, box, path):
  place = chunk_read.Place(region, region_box, box)
  with open(path, 'rb', buffering=0) as f:
    place.fill_from_file(f.fileno(), path)
  return place


@pytest.mark.parametrize('region_shape,start', [
    ((1024, 1024), 512),  # page-aligned, a whole number of pages
    ((1000, 1100), 256),  # starts on a page (256 rows of 4400 bytes), ends at the buffer's end
])
def test_a_chunk_is_the_file_s_pages_and_writes_never_reach_the_file(tmp_path, region_shape,
                                                                     start):
  rows, cols = region_shape
  path, data = _chunk_file(tmp_path, (rows - start, cols))
  gc.collect()  # buffers an earlier test left to the collector: not counted in what follows
  before = pages.live()
  region = reader.aligned_empty(region_shape, np.float32)
  place = _fill(region, Box.full(region_shape), Box((start, 0), region_shape), path)
  assert pages.live() == before + 1
  assert path in _maps(), 'the chunk file is not mapped into the region buffer'
  np.testing.assert_array_equal(region[start:], data)
  assert place.crc32c == checksum.of_array(data)

  # The restored array on the CPU backend is that buffer (no copy)...
  x = jax.device_put(region, jax.devices()[0])
  assert x.unsafe_buffer_pointer() == region.ctypes.data
  # ...and a write into it is private: the tier's file keeps its bytes.
  region[start + 5, 7] = -1.0
  region[-1, -1] = -2.0
  with open(path, 'rb') as f:
    assert f.read() == data.tobytes()
  assert region[start + 5, 7] == -1.0 and region[start + 6, 7] == data[6, 7]

  del region, place, x
  gc.collect()
  assert pages.live() == before
  assert path not in _maps(), 'the mapping outlived every array on it'


@pytest.mark.parametrize('case', ['unaligned', 'small', 'numpy_buffer', 'strided', 'off'])
def test_a_chunk_that_cannot_be_mapped_is_copied_bit_exact(tmp_path, monkeypatch, case):
  region_shape, box = (1024, 1024), Box((512, 0), (1024, 1024))
  if case == 'unaligned':  # 512 rows of 4000 bytes: not on a page boundary
    region_shape, box = (1024, 1000), Box((512, 0), (1024, 1000))
  elif case == 'small':  # one page-aligned run under MIN_BYTES
    box = Box((512, 0), (512 + pages.MIN_BYTES // 4096 - 1, 1024))
  elif case == 'numpy_buffer':  # a region under reader.MAPPED_BYTES: numpy's memory
    region_shape, box = (256, 1024), Box((0, 0), (256, 1024))
  elif case == 'strided':  # a column block: runs of half a row
    box = Box((0, 0), (1024, 512))
  elif case == 'off':
    monkeypatch.setenv(pages.ENV, '0')
    monkeypatch.setattr(pages._state, 'enabled', None)  # pylint: disable=protected-access
  path, data = _chunk_file(tmp_path, box.shape)
  gc.collect()  # as above: only this test's mappings are counted
  before = pages.live()
  region = reader.aligned_empty(region_shape, np.float32)
  region[...] = 7.0
  place = _fill(region, Box.full(region_shape), box, path)
  assert pages.live() == before and path not in _maps()
  np.testing.assert_array_equal(region[box.relative_to(Box.full(region_shape))], data)
  assert place.crc32c == checksum.of_array(data)
  rest = np.full(region_shape, 7.0, np.float32)
  rest[box.relative_to(Box.full(region_shape))] = data
  np.testing.assert_array_equal(region, rest)


def test_a_file_shorter_than_its_chunk_is_never_mapped(tmp_path):
  """A mapping past a file's end would fault on read: a short file is refused, as the copy
  refuses it."""
  path, _ = _chunk_file(tmp_path, (256, 1024))
  region = reader.aligned_empty((1024, 1024), np.float32)
  place = chunk_read.Place(region, Box.full((1024, 1024)), Box((512, 0), (1024, 1024)))
  with open(path, 'rb', buffering=0) as f, pytest.raises(OSError, match='ended after'):
    place.fill_from_file(f.fileno(), path)
  assert path not in _maps()


def test_the_budget_of_mappings_falls_back_to_copies(tmp_path, monkeypatch):
  """Past ``MAX_MAPPED`` live mappings a chunk is copied; the budget comes back when the
  buffers go."""
  path, data = _chunk_file(tmp_path, (512, 1024))
  monkeypatch.setattr(pages, 'MAX_MAPPED', pages.live() + 1)
  regions = [reader.aligned_empty((1024, 1024), np.float32) for _ in range(2)]
  for r in regions:
    _fill(r, Box.full((1024, 1024)), Box((512, 0), (1024, 1024)), path)
    np.testing.assert_array_equal(r[512:], data)
  assert _maps().count(path) == 1
  del regions, r
  gc.collect()
  region = reader.aligned_empty((1024, 1024), np.float32)
  _fill(region, Box.full((1024, 1024)), Box((512, 0), (1024, 1024)), path)
  assert _maps().count(path) == 1
