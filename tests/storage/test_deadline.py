"""The storage deadline policy (orbax_pathways/storage/deadline.py): pure, no I/O, time passed in.

What a user relies on: a request is never given up sooner than the floor nor waited for longer
than the cap, and a request issued behind many queued bytes, or on slow storage, gets more time
than one on an idle, fast one.
"""

from __future__ import annotations

import pytest

import orbax_pathways
from orbax_pathways.storage import deadline

MiB = 1 << 20


def test_without_observations_small_requests_get_the_floor_and_huge_ones_the_cap():
  p = deadline.Policy(floor_s=10, cap_s=120)
  assert p.deadline_s(0, now=0.0) == 10
  assert p.deadline_s(64 * 1024, now=0.0) == 10
  assert p.deadline_s(10 << 30, now=0.0) == 120


def test_deadline_follows_observed_throughput():
  fast, slow = deadline.Policy(floor_s=1, cap_s=1000), deadline.Policy(floor_s=1, cap_s=1000)
  for policy, seconds in ((fast, 0.1), (slow, 10.0)):  # 64 MiB answered in 0.1 s vs 10 s
    t = 0.0
    for _ in range(4):
      ticket = policy.begin(16 * MiB, t)
      t += seconds / 4
      policy.end(ticket, t, ok=True)
  assert fast.throughput(now=100) == pytest.approx(640 * MiB)
  assert slow.throughput(now=100) == pytest.approx(6.4 * MiB)
  n = 256 * MiB
  assert slow.deadline_s(n, now=100) > 10 * fast.deadline_s(n, now=100)
  assert slow.deadline_s(n, now=100) == pytest.approx(4 * (2.0 + 40.0))  # default latency


def test_latency_is_the_p90_of_small_requests():
  p = deadline.Policy(floor_s=0.01, cap_s=1000)
  t = 0.0
  for i in range(100):
    ticket = p.begin(1024, t)
    t += 0.05 if i < 90 else 3.0  # ten slow answers in a hundred
    p.end(ticket, t, ok=True)
  assert p.latency_s() == 3.0
  assert p.deadline_s(0, now=t) == pytest.approx(4 * 3.0)


def test_a_request_queued_behind_others_gets_their_transfer_time_too():
  p = deadline.Policy(floor_s=1, cap_s=10_000)
  alone = p.deadline_s(16 * MiB, now=0.0)
  tickets = [p.begin(64 * MiB, 0.0) for _ in range(16)]  # 1 GiB in flight
  behind = p.begin(16 * MiB, 0.0)
  assert behind.deadline_s > alone + 4 * (1 << 30) / deadline.DEFAULT_THROUGHPUT * 0.99
  for t in tickets + [behind]:
    p.end(t, 1.0, ok=False)
  assert p.deadline_s(16 * MiB, now=1.0) == alone  # given up: nothing queued, nothing learned


def test_floor_and_cap_come_from_options_and_environment(monkeypatch):
  with pytest.raises(ValueError, match='request_deadline_floor_s'):
    orbax_pathways.Options(request_deadline_floor_s=30, request_deadline_cap_s=20)
  with pytest.raises(ValueError, match='ORBAX_PATHWAYS_REQUEST_DEADLINE_CAP_S'):
    orbax_pathways.Options.from_env({'ORBAX_PATHWAYS_REQUEST_DEADLINE_CAP_S': 'soon'})
  opts = orbax_pathways.Options.from_env({'ORBAX_PATHWAYS_REQUEST_DEADLINE_FLOOR_S': '2.5',
                                          'ORBAX_PATHWAYS_REQUEST_DEADLINE_CAP_S': '30'})
  assert (opts.request_deadline_floor_s, opts.request_deadline_cap_s) == (2.5, 30)
  handler = orbax_pathways.install(opts)
  try:
    assert handler.bounds == deadline.Bounds(2.5, 30)
  finally:
    orbax_pathways.install(orbax_pathways.Options.from_env())
  # Per handler, not per process: another handler's options leave the process's policy alone.
  assert (deadline.POLICY.floor_s, deadline.POLICY.cap_s) == (10, 120)


def test_bounds_apply_inside_their_call_only_and_follow_its_tasks_and_threads():
  import asyncio  # pylint: disable=g-import-not-at-top
  p = deadline.Policy()
  huge = 1 << 40  # the cap applies
  assert p.deadline_s(huge, now=0.0) == deadline.DEFAULT_CAP_S

  async def call():
    with deadline.bounded(deadline.Bounds(1.0, 9.0)):
      in_task = await asyncio.create_task(asyncio.sleep(0, p.deadline_s(huge, now=0.0)))
      in_thread = await asyncio.to_thread(p.deadline_s, huge, 0.0)
      small = p.deadline_s(0, now=0.0)
    return in_task, in_thread, small, p.deadline_s(huge, now=0.0)

  async def other():
    return p.deadline_s(huge, now=0.0)

  async def both():
    return await asyncio.gather(call(), other())

  (in_task, in_thread, small, after), elsewhere = asyncio.run(both())
  assert (in_task, in_thread, after, elsewhere) == (9.0, 9.0, deadline.DEFAULT_CAP_S,
                                                    deadline.DEFAULT_CAP_S)
  assert small == min(9.0, max(1.0, deadline.FACTOR * deadline.DEFAULT_LATENCY_S))
  with pytest.raises(ValueError, match='floor 5 s and cap 2 s'):
    deadline.Bounds(5, 2)


def test_tensorstore_stall_timeout_is_twice_the_floor_unless_set():
  from orbax_pathways.storage import hedge  # pylint: disable=g-import-not-at-top
  env = {'ORBAX_PATHWAYS_REQUEST_DEADLINE_FLOOR_S': '4'}
  assert hedge.set_stall_timeout(env) == '8'
  assert hedge.set_stall_timeout({hedge.STALL_ENV: '300'}) == '300'
  assert hedge.set_stall_timeout({}) == '20'


def test_a_hedged_read_whose_event_loop_closes_under_it_leaves_no_unraisable_error():
  """Orbax ends a restore whose other read failed by closing its event loop while our hedged
  reads are still in flight: the suspended ``hedge.run`` coroutine is then closed, not
  cancelled. It used to try to cancel its requests through the closed loop ('Event loop is
  closed', printed as an ignored exception at garbage collection)."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  from orbax_pathways.storage import hedge  # pylint: disable=g-import-not-at-top

  async def never_answers(n):
    del n
    await asyncio.sleep(3600)

  async def read():
    return await hedge.run(never_answers, nbytes=0, what='array x', kind='read')

  unraisable = []
  previous, sys.unraisablehook = sys.unraisablehook, lambda u: unraisable.append(u.exc_value)
  asyncio_log = logging.getLogger('asyncio')
  level, asyncio_log.level = asyncio_log.level, logging.CRITICAL  # 'Task was destroyed' lines
  try:
    loop = asyncio.new_event_loop()
    task = loop.create_task(read())
    loop.run_until_complete(asyncio.sleep(0.05))
    loop.close()
    del task
    gc.collect()
  finally:
    sys.unraisablehook = previous
    asyncio_log.setLevel(level)
  assert not unraisable, unraisable


def test_a_hedged_request_cancelled_as_its_answer_came_leaves_nothing_counted_in_flight():
  """A read cancelled (its restore failed elsewhere) in the instant its attempt answered: the
  answer was never taken, and the attempt's ticket used to stay counted in flight, so every
  later request of the process queued behind its bytes: after one failed restore, deadlines
  grew towards the cap and a hung request was no longer hedged."""
  import asyncio  # pylint: disable=g-import-not-at-top
  from orbax_pathways.storage import hedge  # pylint: disable=g-import-not-at-top

  policy = deadline.Policy(floor_s=1, cap_s=120)

  async def answers_at_once(n):
    del n
    return b'bytes'

  async def main():
    read = asyncio.ensure_future(hedge.run(answers_at_once, nbytes=8 * MiB, what='array x',
                                           kind='read', policy=policy))
    await asyncio.sleep(0)  # the read issues its attempt and waits for it
    await asyncio.sleep(0)  # the attempt answers; the read is due to wake up
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
      await read

  asyncio.run(main())
  assert policy.in_flight() == (0, 0)
  import time  # pylint: disable=g-import-not-at-top
  now = time.monotonic()  # the next request queues behind nothing
  assert policy.begin(0, now).deadline_s == deadline.Policy(floor_s=1, cap_s=120).begin(0, now).deadline_s


def test_a_hedged_read_closed_with_its_event_loop_leaves_nothing_counted_in_flight():
  import asyncio  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  from orbax_pathways.storage import hedge  # pylint: disable=g-import-not-at-top

  policy = deadline.Policy(floor_s=1, cap_s=120)

  async def never_answers(n):
    del n
    await asyncio.sleep(3600)

  asyncio_log = logging.getLogger('asyncio')
  level, asyncio_log.level = asyncio_log.level, logging.CRITICAL  # 'Task was destroyed' lines
  try:
    loop = asyncio.new_event_loop()
    task = loop.create_task(hedge.run(never_answers, nbytes=8 * MiB, what='array x', kind='read',
                                      policy=policy))
    loop.run_until_complete(asyncio.sleep(0.05))
    assert policy.in_flight() == (1, 8 * MiB)
    loop.close()
    del task
    gc.collect()
  finally:
    asyncio_log.setLevel(level)
  assert policy.in_flight() == (0, 0)


def test_a_retried_write_on_local_ocdbt_gets_a_complete_database_of_its_own():
  """Orbax's local-filesystem OCDBT spec names the manifest's location apart from the data
  files. A retried write (storage/writer.retry_spec) must move both: with only the data moved,
  the retry committed its manifest into the original database, whose own writer commits there
  too (two drivers racing for one manifest), and left its own database without one."""
  from orbax_pathways.storage import writer  # pylint: disable=g-import-not-at-top
  db = '/ckpt/1.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp/ocdbt.process_3/'
  spec = {'driver': 'zarr', 'kvstore': {
      'driver': 'ocdbt', 'path': 'x',
      'base': {'driver': 'file', 'path': db, 'file_io_locking': {'mode': 'non_atomic'}},
      'manifest': {'driver': 'file', 'path': db}}}
  retry = writer.retry_spec(spec, 2)['kvstore']
  want = db.replace('ocdbt.process_3/', 'ocdbt.process_3retry2/')
  assert retry['base']['path'] == want and retry['manifest']['path'] == want
  assert spec['kvstore']['manifest']['path'] == db  # the caller's spec is untouched
  gcs = {'driver': 'zarr', 'kvstore': {'driver': 'ocdbt', 'path': 'x',
                                       'base': 'gs://b/ckpt/1/default/ocdbt.process_0'}}
  assert writer.retry_spec(gcs, 1)['kvstore']['base'] == 'gs://b/ckpt/1/default/ocdbt.process_0retry1'
  assert 'manifest' not in writer.retry_spec(gcs, 1)['kvstore']
