"""Every agreement of the package is one key-value round (``coord/rounds.py``):
what one process asks of jax's coordination service per round does not grow with the fleet
(one directory read, then blocking reads only for the processes still missing), and a round
that some processes never answer names them, the round and the deadline.

Against jax's real coordination service (``support/kv_fleet.py``: the service of this test
process, one per test), the process under test plays its part in a job of ``n`` processes
whose other members cannot run here: their keys of a round are written into the service when
the process under test first touches it (but ``late`` ones, ``LATE_S`` later, and ``silent``
ones, never), and the leader's verdict where the process under test is not the leader. Its
requests are counted by kind. The agreements run as the package runs them: the preemption
agreement, the resume agreement, the resume's agreement on the node steps every process can
restore, the writer-lease round, the save liveness round and the tier's peer exchange. The same
counts every member on time, in a process with ``jax.distributed`` up:
``test_agreement_scale.py``.
"""

from __future__ import annotations

import json
import time
import types

import pytest

from orbax_pathways.coord import agreement
from orbax_pathways.coord import liveness
from orbax_pathways.coord import participants as participants_lib
from orbax_pathways.coord import rounds
from orbax_pathways.manager import lease
from orbax_pathways.multitier import node_round
from orbax_pathways.plan import node_verdict
from orbax_pathways.preemption import decision
from orbax_pathways.preemption import notice
from orbax_pathways.multitier import resume as recovery
from orbax_pathways.peer import exchange
from support import kv_fleet

FLEETS = (4, 64, 1024)
LATE_S = kv_fleet.LATE_S


@pytest.fixture
def service():
  """jax's coordination service, this test's own (a fresh store)."""
  with kv_fleet.Service() as s:
    yield s


@pytest.fixture
def fleet(service):
  """``fleet(me, n, value, late=, silent=, verdict=)``: a ``kv_fleet.Fleet`` on the service;
  ``value(p)`` is what process ``p`` publishes in every round."""
  made = []

  def make(me, n, value, **kwargs):
    f = kv_fleet.Fleet(service.client, me, n, lambda rnd, p: value(p), **kwargs)
    made.append(f)
    return f
  yield make
  for f in made:
    f.settle()


@pytest.fixture
def as_process(monkeypatch):
  """Makes this interpreter process ``client.me`` of ``client.n`` with ``client`` as its
  key-value client (the package reads them through ``_compat``)."""
  yield lambda client: kv_fleet.as_process(client, monkeypatch)
  decision.reset()


def _bounded(client: kv_fleet.Fleet, late: int) -> None:
  """One directory read (again only once late keys arrived), blocking reads only for the late
  ones, a few sets (a leader's progress, one per wave of arrivals) and deletes: nothing that
  grows with the fleet."""
  assert client.calls['dir_get'] <= 2, client.calls
  assert client.calls['blocking_get'] <= late + (1 if client.verdict is not None else 0), \
      client.calls
  assert client.calls['try_get'] == 0, client.calls
  assert client.requests() <= 4 + 2 * late, client.calls


def _preemption(client: kv_fleet.Fleet, monkeypatch, step: int) -> bool:
  del monkeypatch
  return decision._kv_agreement(step, participants_lib.Participants(None, 0),  # pylint: disable=protected-access
                                decision.Agreement(interval=1, timeout_s=30.0))


def _resume(client: kv_fleet.Fleet, monkeypatch, step: int) -> bool:
  monkeypatch.setattr(agreement._state, 'current', decision.Agreement(timeout_s=30.0))  # pylint: disable=protected-access
  return recovery.all_processes_ok(types.SimpleNamespace(), True, step)


def _node_steps(client: kv_fleet.Fleet, monkeypatch, step: int) -> list[int]:
  del client, monkeypatch, step
  options = types.SimpleNamespace(tier_dir=None, tier_peer_timeout_s=30.0)
  steps, fetch, elastic = node_round.agreed(types.SimpleNamespace(), options, [9, 7], {},
                                             timeout_s=30.0)
  assert fetch == {} and elastic == {}
  return steps


_HOLDS_9_7 = '{"steps":[9,7],"fetch":{}}'  # the verdict: every node holds 9 and 7


@pytest.mark.parametrize('n', FLEETS)
@pytest.mark.parametrize('me', [0, 1])
@pytest.mark.parametrize('late', [2])
@pytest.mark.parametrize('agreement', [_preemption, _resume, _node_steps])
def test_every_process_agreement_requests_do_not_grow(agreement, late, me, n, as_process,
                                                      monkeypatch, fleet):
  """The leader (process 0) gathers the others' values, two of them late, and publishes the
  verdict; every other process publishes its value and reads the verdict: two requests and
  one value, whatever the fleet. (With every member on time, against jax's real service:
  ``test_agreement_scale.py``.)"""
  # No notice anywhere (a True answer would notify this process): all answer '0'; every
  # process restored the step: all answer '1'; every node holds steps 9 and 7: '9,7'.
  flag = {_preemption: '0', _resume: '1', _node_steps: _HOLDS_9_7}[agreement]
  value = ((lambda p: node_verdict.holdings(p, [7, 9], {}, '')) if agreement is _node_steps
           else (lambda p: flag))
  client = fleet(me, n, value, late=range(n - late, n),
                  verdict=None if me == 0 else flag)
  as_process(client)
  assert agreement(client, monkeypatch, step=7 + n) == {'0': False, '1': True}.get(flag, [9, 7])
  _bounded(client, late)
  if me == 0:
    assert client.values_read == n - 1, client.values_read
    assert 1 <= client.calls['set'] <= 1 + late, client.calls  # the verdict, progress
  else:
    assert client.values_read == 1 and client.requests() == 2, client.calls


def test_a_members_wait_names_the_processes_its_leader_missed(as_process, fleet, service):
  """The leader's gather times out: it names the silent processes, and so does every member,
  at once (from the leader's verdict), not at its own deadline."""
  leader = fleet(0, 64, lambda p: '1', silent=[5, 9])
  as_process(leader)
  with pytest.raises(rounds.PeerTimeoutError) as e:
    rounds.agree(leader, rounds.Sequence('test/agree', keep=1), 'orbax_pathways/test/agree/1',
                 me=0, members=range(64), count=64, leader=0, what='orbax_pathways: test',
                 value='1', decide=lambda v: '1', timeout_s=0.3)
  assert e.value.missing == (5, 9)
  verdict = service.client.key_value_try_get(f'orbax_pathways/test/agree/1/{rounds.VERDICT}')
  member = fleet(1, 64, lambda p: '1', verdict=verdict)
  began = time.monotonic()
  with pytest.raises(rounds.PeerTimeoutError) as e:
    rounds.agree(member, rounds.Sequence('test/agree', keep=1), 'orbax_pathways/test/agree/1',
                 me=1, members=range(64), count=64, leader=0, what='orbax_pathways: test',
                 value='1', decide=lambda v: '1', timeout_s=30.0)
  assert time.monotonic() - began < 5
  assert e.value.missing == (5, 9)
  assert str(e.value).startswith('orbax_pathways: test: process(es) 5, 9 of 64 did not answer '
                                 'process 0, which answers for this round'), str(e.value)


def test_a_member_whose_leader_is_gone_names_it(fleet):
  member = fleet(1, 8, lambda p: '1', silent=[0])
  with pytest.raises(rounds.PeerTimeoutError) as e:
    rounds.agree(member, rounds.Sequence('test/gone', keep=1), 'orbax_pathways/test/gone/1',
                 me=1, members=range(8), count=8, leader=0, what='orbax_pathways: test',
                 value='1', decide=lambda v: '1', timeout_s=0.3)
  assert e.value.missing == (0,)
  assert 'process 0, which answers for this round, did not publish its verdict within 0.3s' \
      in str(e.value), str(e.value)


@pytest.mark.parametrize('n', FLEETS)
@pytest.mark.parametrize('late', [0, 2])
def test_save_liveness_round_requests_do_not_grow(late, n, fleet):
  client = fleet(0, n, lambda p: liveness.OK, late=range(n - late, n))
  rnd = liveness.SaveRound(client, f'{rounds.ROOT}/save/test/{n}/{late}', 0, range(n), 0,
                           '/ckpt/1', n, timeout_s=30.0)
  rnd.writes_done(None, 0.0)  # the primary: every process reported ok
  _bounded(client, late)
  other = fleet(1, n, lambda p: liveness.OK, verdict=liveness.OK)
  liveness.SaveRound(other, rnd.key, 1, range(n), 0, '/ckpt/1', n, timeout_s=30.0).writes_done(
      None, 0.0)
  _bounded(other, 0)


@pytest.mark.parametrize('n', FLEETS)
@pytest.mark.parametrize('me', [0, 1])
@pytest.mark.parametrize('primary', [None, 0])
def test_lease_round_requests_do_not_grow(primary, me, n, fleet):
  part = participants_lib.Participants(None, primary)
  leader = part.leader(n)
  client = fleet(me, n, lambda p: 'ok', verdict=None if me == leader else 'ok')
  assert lease._agree(client, part, me, n, None) is None  # pylint: disable=protected-access
  _bounded(client, 0)


@pytest.mark.parametrize('n', FLEETS)
@pytest.mark.parametrize('late', [0, 2])
def test_peer_exchange_requests_do_not_grow(late, n, fleet):
  client = fleet(0, n, lambda p: json.dumps({'addr': f'h{p}:1', 'entries': []}),
                  late=range(n - late, n))
  ex = exchange.Exchange(client, 0, n, timeout_s=30.0)
  prefix = ex.prefix(f'/ckpt/{n}/{late}/item')
  ex.publish(prefix, 'h0:1', [])
  found, missing = ex.gather(prefix)
  assert (sorted(found), missing) == (list(range(1, n)), [])
  assert found[n - 1]['addr'] == f'h{n - 1}:1'
  _bounded(client, late)


@pytest.mark.parametrize('n', [64, 1024])
def test_silent_processes_are_named(n, fleet):
  silent = [5, 9] if n == 64 else list(range(100, 120))
  client = fleet(0, n, lambda p: '0', silent=silent)
  rnd = rounds.Round(client, rounds.round_key('test/silent', n), me=0, members=range(n),
                     count=n, what='orbax_pathways: test agreement')
  rnd.publish('0')
  with pytest.raises(rounds.PeerTimeoutError) as e:
    rnd.gather(0.3)
  assert e.value.missing == tuple(silent)
  assert sorted(e.value.found) == sorted(set(range(n)) - set(silent))
  text = str(e.value)
  shown = ', '.join(map(str, silent[:16])) + (' ...' if len(silent) > 16 else '')
  assert text.startswith(f'orbax_pathways: test agreement: process(es) {shown} of {n} did not '
                         'answer within 0.3s'), text
  assert f'key prefix {rounds.ROOT}/test/silent/{n}' in text, text
  # the wait stops at the silent ones: one blocking read each slice, not one per process
  assert client.calls['blocking_get'] <= 2 and client.calls['try_get'] == 0, client.calls


def test_old_rounds_are_deleted_once_everyone_is_past_them(fleet):
  client = fleet(0, 3, lambda p: '0')
  seq = rounds.Sequence('test/retire', keep=2)
  keys = []
  for _ in range(4):
    rnd = rounds.Round(client, seq.next(), me=0, members=range(3), count=3, what='t')
    keys.append(rnd.key)
    rnd.publish('0')
    rnd.gather(5.0)
    seq.retire(client, 0, whole=True)
  assert keys == [f'{rounds.ROOT}/test/retire/{i}' for i in range(1, 5)]
  # rounds 1 and 2 are gone, every member's key; 3 and 4 are kept
  assert client.keys(f'{rounds.ROOT}/test/retire/') == [f'{k}/{p}' for k in keys[2:]
                                                        for p in range(3)]
  assert notice.pending() is False  # nothing here touched the process's notice


@pytest.mark.parametrize('n', FLEETS)
def test_a_reader_reads_only_the_holders_of_the_writer_it_lacks(n, service):
  """Each of ``n`` processes publishes its key and one holder key for its own writer; a reader
  that lacks writer p1's chunks reads one key in one request, whatever ``n``; a gather of the
  round reads the processes' keys only (the holder keys sit beside the round); the holder
  keys of the restore before last go with it."""
  kv = kv_fleet.Counted(service.client)  # every simulated process publishes through it
  kv.counting = False
  exchanges = [exchange.Exchange(kv, me, n, timeout_s=1.0) for me in range(n)]
  prefixes = []
  for _ in range(3):  # three restores of the item: the first one's keys are retired by the third
    # One interpreter plays every process, so one of them numbers the rounds (and retires them).
    prefix = exchanges[0].prefix(f'/ckpt/holders/{n}/item')
    for me, ex in enumerate(exchanges):
      ex.publish(prefix, f'h{me}:1', [(f'p{me}', f's{me}')], holds={f'p{me}': [(f'p{me}', f's{me}')]})
    prefixes.append(prefix)
  reader = exchanges[0]
  kv.counting = True
  found = reader.holders(prefixes[-1], 'p1')
  assert found == {1: {'addr': 'h1:1', 'entries': [('p1', 's1')]}}
  assert exchange.to_ask(found, {'p1': 's1'}, me=0) == [1]
  assert exchange.to_ask(found, {'p1': 'another save'}, me=0) == []  # a stale entry is not asked
  assert (dict(kv.calls), kv.values_read) == ({'dir_get': 1}, 1)
  got, missing = reader.gather(prefixes[-1])
  assert (len(got), missing, kv.values_read) == (n - 1, [], 1 + n)
  assert not kv.keys(prefixes[0] + '.h/')  # retired by the third
  assert f'{prefixes[0]}/0' not in kv.keys(prefixes[0] + '/')
  assert len(kv.keys(prefixes[1] + '.h/')) == n  # before last: kept
