"""``storage/hedge``'s two runners, ``run`` (an event loop's coroutines) and ``run_sync`` (a
thread's tensorstore futures), behave alike: the same scenarios, run through each, give the same
answer or error, issue the same attempts, cancel the same ones and leave nothing counted in
flight (a ticket left in flight adds its bytes to every later deadline of the process)."""

from __future__ import annotations

import asyncio

import pytest
import tensorstore as ts

from orbax_pathways.storage import deadline
from orbax_pathways.storage import hedge

DEADLINE_S = 0.05  # floor == cap: every attempt's deadline, whatever was observed
NBYTES = 1 << 20


def _async(behaviours, policy, issued, cancelled):
  def attempt(n):
    issued.append(n)
    kind, value = behaviours[n]
    if kind == 'raise':  # issuing the request itself fails
      raise value

    async def request():
      try:
        if kind == 'hang':
          await asyncio.sleep(3600)
        if kind == 'fail':
          raise value
        return value
      except asyncio.CancelledError:
        cancelled.append(n)
        raise

    return request()

  return asyncio.run(hedge.run(attempt, nbytes=NBYTES, what='array x', kind='read',
                               policy=policy))


def _sync(behaviours, policy, issued, cancelled):
  pairs: list[tuple[ts.Promise, ts.Future]] = []  # the promises kept: a hung request stays open

  def attempt(n):
    issued.append(n)
    kind, value = behaviours[n]
    if kind == 'raise':
      raise value
    promise, future = ts.Promise.new()
    if kind == 'answer':
      promise.set_result(value)
    elif kind == 'fail':
      promise.set_exception(value)
    pairs.append((promise, future))
    return future

  try:
    return hedge.run_sync(attempt, nbytes=NBYTES, what='array x', kind='read', policy=policy)
  finally:
    cancelled.extend(n for n, (_, f) in enumerate(pairs) if f.cancelled())


RUNNERS = {'run': _async, 'run_sync': _sync}
HANG = ('hang', None)

SCENARIOS = {
    # behaviours of attempts 0, 1, 2 -> (answer or error, attempts issued, attempts cancelled)
    'first answers': ([('answer', b'a')], b'a', [0], []),
    'first hangs, second answers': ([HANG, ('answer', b'b')], b'b', [0, 1], [0]),
    'second fails, third answers': ([HANG, ('fail', OSError('no')), ('answer', b'c')], b'c',
                                    [0, 1, 2], [0]),
    'first fails': ([('fail', OSError('storage said no'))], OSError('storage said no'), [0], []),
    'every attempt hangs': ([HANG, HANG, HANG],
                            hedge.StorageDeadlineError('Reading array x: no answer from storage '
                                                       'after'), [0, 1, 2], [0, 1, 2]),
    'first cannot be issued': ([('raise', ValueError('bad spec'))], ValueError('bad spec'), [0],
                               []),
    'second cannot be issued': ([HANG, ('raise', ValueError('bad spec'))], ValueError('bad spec'),
                                [0, 1], [0]),
}


@pytest.mark.parametrize('scenario', list(SCENARIOS))
@pytest.mark.parametrize('runner', list(RUNNERS))
def test_both_runners_answer_alike_and_leave_nothing_in_flight(runner, scenario):
  behaviours, expected, want_issued, want_cancelled = SCENARIOS[scenario]
  policy = deadline.Policy(floor_s=DEADLINE_S, cap_s=DEADLINE_S)
  before = hedge.counts()
  issued: list[int] = []
  cancelled: list[int] = []
  if isinstance(expected, BaseException):
    with pytest.raises(type(expected), match=str(expected)) as e:
      RUNNERS[runner](behaviours, policy, issued, cancelled)
    if isinstance(expected, hedge.StorageDeadlineError):
      assert '3 identical requests' in str(e.value)
  else:
    assert RUNNERS[runner](behaviours, policy, issued, cancelled) == expected
  assert issued == want_issued
  assert sorted(cancelled) == want_cancelled
  assert policy.in_flight() == (0, 0)
  after = hedge.counts()
  delta = {k: after.get(k, 0) - before.get(k, 0) for k in ('read_hedged', 'read_won_by_retry')}
  hedged = len(issued) > 1
  won_by_retry = hedged and not isinstance(expected, BaseException)
  assert delta == {'read_hedged': int(hedged), 'read_won_by_retry': int(won_by_retry)}
