"""The relay's parts that need no second process (``fleet/relay.py``, ``plan/sources.py``): who
needs a lost chunk, who reads it for whom, and the cache that turns concurrent asks into one
storage read. The multi-process behaviour (bytes by source, a failing fetcher) is in
``test_tier_peer.py``; the storage bytes it saves are measured in ``benchmarks/tier.py``.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import pytest

from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import sources
from orbax_pathways.fleet import relay

Box = boxes_lib.Box


def _box(*pairs):
  return Box(tuple(a for a, _ in pairs), tuple(b for _, b in pairs))


# ---- planning ------------------------------------------------------------------------------------


def test_a_replicated_sharding_has_one_box_whatever_the_fleet():
  for processes in (4, 1024):
    owned = sources.owners((_box((0, 96), (0, 64)), p) for p in range(processes)
                           for _ in range(4))  # 4 devices per process, all hold everything
    assert len(owned) == 1
    assert owned[0][1] == frozenset(range(processes))


def test_needers_are_the_processes_whose_boxes_touch_the_chunk():
  # rows split over 3 processes (32 rows each), columns over 2 devices of each process
  pairs = [(_box((32 * p, 32 * p + 32), (32 * d, 32 * d + 32)), p)
           for p in range(3) for d in range(2)]
  owned = sources.owners(pairs)
  assert sources.needers(_box((32, 64), (0, 32)), owned) == {1}
  assert sources.needers(_box((16, 48), (0, 64)), owned) == {0, 1}  # straddles two
  assert sources.needers(_box((96, 128), (0, 64)), owned) == frozenset()


def test_the_fetcher_is_the_same_pick_on_every_process_and_spreads_the_reads():
  group = (0, 3, 5)
  picks = [sources.fetcher(f'item/a/[{i}, 0]', group) for i in range(300)]
  # Same answer however the candidates arrive, in every call (no per-process hash seed).
  assert picks == [sources.fetcher(f'item/a/[{i}, 0]', reversed(group)) for i in range(300)]
  counts = {p: picks.count(p) for p in group}
  assert set(counts) == set(group) and min(counts.values()) > 60, counts
  with pytest.raises(ValueError, match='no process to read item/a'):
    sources.fetcher('item/a', ())


def test_groups_bound_what_one_fetcher_sends_at_any_fleet_size():
  live = list(range(1000))
  for me in (0, 7, 8, 999):
    group = relay._group(live, me)
    assert me in group and len(group) <= relay.GROUP
    assert all(relay._group(live, other) == group for other in group)  # everyone agrees
  assert relay._group([0, 2], 1) == ()  # a process that does not need the chunk has no group


# ---- the cache: one storage read however many ask ------------------------------------------------


def test_concurrent_asks_share_one_read_and_the_entry_goes_after_the_last_use():
  cache = relay.Cache(cap=1 << 20, ttl_s=60)
  reads = []
  release = threading.Event()

  def read():
    reads.append(1)
    release.wait(10)
    return np.arange(256, dtype=np.float32)

  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    futures = [pool.submit(cache.get, ('p', 'a', (0,)), read, uses=3, timeout_s=10)
               for _ in range(3)]
    time.sleep(0.2)
    release.set()
    got = [f.result() for f in futures]
  assert len(reads) == 1
  for g in got:
    np.testing.assert_array_equal(g, np.arange(256, dtype=np.float32))
  assert cache.bytes == 0 and cache.storage_bytes == 1024  # taken 3 times of 3: dropped


def test_a_failed_read_reaches_every_waiter_and_is_not_cached():
  cache = relay.Cache()

  def broken():
    time.sleep(0.2)
    raise OSError('storage said no')

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    futures = [pool.submit(cache.get, ('p', 'a', (0,)), broken, uses=2, timeout_s=10)
               for _ in range(2)]
    for f in futures:
      with pytest.raises(relay.RelayError, match='OSError: storage said no'):
        f.result()
  ok = cache.get(('p', 'a', (0,)), lambda: np.ones(4, np.int8), uses=1, timeout_s=1)
  assert ok.tolist() == [1, 1, 1, 1]  # the next ask reads again


def test_a_waiter_gives_up_at_its_deadline():
  cache = relay.Cache()
  started = threading.Event()

  def slow():
    started.set()
    time.sleep(3)
    return np.zeros(1)

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    pool.submit(cache.get, ('p', 'a', (0,)), slow, uses=2, timeout_s=10)
    started.wait(5)
    with pytest.raises(relay.RelayError, match='did not finish within 0.5 s'):
      cache.get(('p', 'a', (0,)), slow, uses=2, timeout_s=0.5)


def test_the_cache_keeps_at_most_its_cap_and_drops_the_least_recently_used():
  cache = relay.Cache(cap=3000, ttl_s=60)
  for i in range(5):
    cache.get(('p', 'a', (i,)), lambda: np.zeros(1000, np.uint8), uses=2, timeout_s=1)
  assert cache.bytes == 3000
  reads = []
  cache.get(('p', 'a', (0,)), lambda: reads.append(1) or np.zeros(1000, np.uint8), uses=2,
            timeout_s=1)
  assert reads == [1]  # evicted: read again
  cache.get(('p', 'a', (4,)), lambda: reads.append(2) or np.zeros(1000, np.uint8), uses=2,
            timeout_s=1)
  assert reads == [1]  # still held


def test_an_entry_nobody_asks_for_again_expires():
  cache = relay.Cache(cap=1 << 20, ttl_s=0.3)
  cache.get(('p', 'a', (0,)), lambda: np.zeros(1000, np.uint8), uses=5, timeout_s=1)
  assert cache.bytes == 1000
  deadline = time.monotonic() + 10
  while cache.bytes and time.monotonic() < deadline:  # the janitor's timer, no further ask
    time.sleep(0.05)
  assert cache.bytes == 0


def test_a_server_answers_only_restores_this_process_registered():
  with pytest.raises(relay.RelayError, match="no restore 'orbax_pathways/tier_peers/x/1'"):
    relay.answer({'op': 'relay', 'prefix': 'orbax_pathways/tier_peers/x/1', 'array': 'a',
                  'origin': [0], 'shape': [4]})


def test_a_server_reads_only_one_whole_recorded_chunk_per_request():
  """A request names a restore, an array and one chunk (origin and shape); a box that is not
  exactly one recorded chunk of the stored grid is refused before anything is read."""
  target = relay.Target(name='a', tspec={}, context=None, chunks={(0, 0): object(), (4, 0): object()},
                        owners=lambda: (), shape=(6, 3), chunk_shape=(4, 3))
  assert target.chunk_at((4, 0), (2, 3)) == Box((4, 0), (6, 3))  # the clipped last chunk
  with pytest.raises(relay.RelayError, match=r'has shape \[4, 3\], not \[6, 3\]'):
    target.chunk_at((0, 0), (6, 3))  # two chunks' worth
  with pytest.raises(relay.RelayError, match=r'no recorded chunk at \[2, 0\]'):
    target.chunk_at((2, 0), (2, 3))  # off the grid
