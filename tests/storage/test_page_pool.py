"""Region buffers reuse the pages of freed ones (``storage/page_pool``): a restore that follows
another in the same process takes its buffers from pages already faulted in, whatever the
sizes of its regions, and the pool gives them back to the system when idle or over its cap.
Real mappings (``storage/pages.anonymous``, the reader's ``aligned_empty``); the bookkeeping
(``page_pool.Ranges``) checked on random sequences against a byte-level model.
"""

from __future__ import annotations

import gc

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from orbax_pathways.storage import page_pool
from orbax_pathways.storage import pages
from orbax_pathways.storage import reader

MiB = 1 << 20
pytestmark = pytest.mark.skipif(not pages.enabled(), reason='mappings are Linux-only')


@pytest.fixture(autouse=True)
def _empty_pool():
  gc.collect()
  page_pool.release()
  yield
  gc.collect()
  page_pool.release()


def _maps_addresses() -> list[tuple[int, int]]:
  out = []
  with open('/proc/self/maps', encoding='utf-8') as f:
    for line in f:
      lo, hi = line.split()[0].split('-')
      out.append((int(lo, 16), int(hi, 16)))
  return out


def _mapped(start: int, length: int) -> bool:
  return any(lo <= start and start + length <= hi for lo, hi in _maps_addresses())


@pytest.fixture
def unmapped(monkeypatch):
  """The ranges the pool gives back to the system (its real munmap calls), as ``(start,
  length)``: whether a range is still in /proc/self/maps says nothing once another thread of
  the process may have mapped something new at the same addresses."""
  gone = []
  real = page_pool._munmap

  def munmap(start, length):
    gone.append((start, length))
    real(start, length)
  monkeypatch.setattr(page_pool, '_munmap', munmap)
  return gone


def _given_back(gone, start: int, length: int) -> bool:
  return any(s <= start and start + length <= s + n for s, n in gone)


def test_a_later_restore_s_buffers_lie_on_the_pages_of_freed_ones_of_other_sizes():
  first = [reader.aligned_empty((8 * MiB,), np.float32) for _ in range(2)]  # 32 MiB each
  for b in first:
    b[:] = 1.0  # faulted in
  spans = [(b.ctypes.data, b.nbytes) for b in first]
  del first, b
  gc.collect()
  assert page_pool.kept_bytes() == 64 * MiB
  # Onto other devices: regions of other sizes, odd ones too, carved from those pages.
  second = [reader.aligned_empty((4 * MiB,), np.float32),
            reader.aligned_empty((3 * MiB + 7,), np.float32),
            reader.aligned_empty((2 * MiB, 3), np.float32)]

  freed = {page for s, n in spans for page in range(s, s + n, pages.PAGE)}

  def inside(b):  # every page of ``b`` was a page of a freed buffer
    first = b.ctypes.data - b.ctypes.data % pages.PAGE
    return all(p in freed for p in range(first, b.ctypes.data + b.nbytes, pages.PAGE))
  assert all(inside(b) for b in second), (spans, [b.ctypes.data for b in second])
  assert all(b.ctypes.data % 64 == 0 for b in second)  # device_put still aliases them
  for i, b in enumerate(second):
    b[...] = i
  assert [float(b.min()) for b in second] == [float(b.max()) for b in second] == [0, 1, 2]


def test_idle_pages_go_back_to_the_system(unmapped):
  buf = reader.aligned_empty((2 * MiB,), np.float32)
  buf[:] = 1.0
  start, length = buf.ctypes.data, buf.nbytes
  del buf
  gc.collect()
  page_pool.sweep(float('-inf'))  # nothing is old enough
  assert page_pool.kept_bytes() == length and _mapped(start, length)
  page_pool.sweep(float('inf'))  # what the pool's thread does SECONDS after they came back
  assert page_pool.kept_bytes() == 0 and _given_back(unmapped, start, length)


def test_the_pool_keeps_at_most_its_cap(monkeypatch, unmapped):
  monkeypatch.setattr(page_pool, 'MAX_BYTES', 24 * MiB)
  bufs = [reader.aligned_empty((4 * MiB,), np.float32) for _ in range(3)]  # 3 x 16 MiB
  spans = [(b.ctypes.data, b.nbytes) for b in bufs]
  del bufs
  gc.collect()
  page_pool.take(page_pool.MAX_BYTES * 2)  # files what came back; fits nothing
  assert page_pool.kept_bytes() <= 24 * MiB
  assert sum(_given_back(unmapped, s, n) for s, n in spans) >= 2


def test_a_buffer_with_a_tier_file_mapped_in_never_goes_to_the_pool(tmp_path):
  path = tmp_path / 'chunk'
  data = np.arange(MiB, dtype=np.float32)
  path.write_bytes(data.tobytes())
  region = reader.aligned_empty((2 * MiB,), np.float32)
  with open(path, 'rb', buffering=0) as f:
    assert pages.map_file(region, 0, data.nbytes, f.fileno()) is not None
  np.testing.assert_array_equal(region[:MiB], data)
  start, length = region.ctypes.data, region.nbytes
  del region
  gc.collect()
  assert page_pool.kept_bytes() == 0 and not _mapped(start, length)


# ---- the bookkeeping alone -------------------------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(('take', 'give')), st.integers(1, 8)), max_size=60)


@settings(max_examples=200, deadline=None, database=None)
@given(ops=OPS)
def test_ranges_hand_out_each_free_page_once_and_merge_what_touches(ops):
  """A model of 64 pages: taken ranges never overlap each other or a free range, the total is
  the free pages' count, and no two free ranges touch (they would have been merged)."""
  ranges = page_pool.Ranges()
  ranges.add(0, 64, 0.0)
  free = set(range(64))
  taken: list[tuple[int, int]] = []
  for op, n in ops:
    if op == 'take':
      start = ranges.take(n)
      if start is None:
        assert not any(all(p + i in free for i in range(n)) for p in free)
        continue
      pages_taken = set(range(start, start + n))
      assert pages_taken <= free
      free -= pages_taken
      taken.append((start, n))
    elif taken:
      start, size = taken.pop(n % len(taken))
      ranges.add(start, size, float(n))
      free |= set(range(start, start + size))
    assert ranges.total == len(free)
    spans = sorted((s, length) for s, (length, _) in ranges.by_start.items())
    assert {p for s, length in spans for p in range(s, s + length)} == free
    assert all(a + la < b for (a, la), (b, _) in zip(spans, spans[1:])), spans
