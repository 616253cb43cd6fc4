"""Every agreement of the package is one key-value round (``coord/rounds.py``):
what one process asks of jax's coordination service per round does not grow with the fleet
(one directory read, then blocking reads only for the processes still missing), and a round
that some processes never answer names them, the round and the deadline.

The key-value client here is a stand-in for jax's coordination-service client (its interface,
not storage): it plays the process under test's part against a job of ``n`` processes whose
other members have published their key of any round already (but ``late`` ones, which arrive
``LATE_S`` after the first request, and ``silent`` ones, never), and whose leader has published
its verdict when the process under test is not the leader. It counts the requests by kind.
The agreements run as the package runs them: the preemption agreement, the resume agreement,
the resume's agreement on the node steps every process can restore, the writer-lease round, the
save liveness round and the tier's peer exchange. The same counts against jax's real service,
every member on time: ``test_agreement_scale.py``.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import types

import pytest

from orbax_pathways.coord import agreement
from orbax_pathways.coord import liveness
from orbax_pathways.coord import participants as participants_lib
from orbax_pathways.coord import rounds
from orbax_pathways.manager import lease
from orbax_pathways.multitier import node_steps
from orbax_pathways.preemption import decision
from orbax_pathways.preemption import notice
from orbax_pathways.multitier import resume as recovery
from orbax_pathways.peer import exchange
from orbax_pathways._compat import jax_distributed
from orbax_pathways._compat import orbax_manager_state as _oms

FLEETS = (4, 64, 1024)
LATE_S = 0.4


class FakeKV:
  """jax's distributed client as the process ``me`` of ``n`` sees it (see the module
  docstring). ``value(p)`` is what process ``p`` published."""

  def __init__(self, me: int, n: int, value, *, late=(), silent=(), verdict: str | None = None):
    self.me, self.n, self.value = me, n, value
    self.late, self.silent = set(late), set(silent)
    self.verdict = verdict  # the leader's verdict, when this process waits for one
    self.stored: dict[str, str] = {}
    self.calls: collections.Counter[str] = collections.Counter()
    self.values_read = 0  # the other processes' values this process was sent
    self.cond = threading.Condition()
    self.t0: float | None = None

  def _start(self, kind: str) -> None:
    self.calls[kind] += 1
    if self.t0 is None:
      self.t0 = time.monotonic()

  def _other(self, key: str) -> str | None:
    """The value of another process's key (``<round>/<p>``, ``<round>/verdict``) if it is there."""
    last = key.rpartition('/')[2]
    if last == rounds.VERDICT:
      return self.verdict
    if not last.isdigit() or not key.startswith(rounds.ROOT + '/'):
      return None
    p = int(last)
    if p == self.me or not 0 <= p < self.n or p in self.silent:
      return None
    if p in self.late and time.monotonic() < self.t0 + LATE_S:
      return None
    return self.value(p)

  def _get(self, key: str) -> str | None:
    return self.stored[key] if key in self.stored else self._other(key)

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
    self._start('set')
    if not allow_overwrite and self._get(key) is not None:
      raise RuntimeError(f'ALREADY_EXISTS: {key}')
    self.stored[key] = value

  def key_value_try_get(self, key: str) -> str:
    self._start('try_get')
    found = self._get(key)
    if found is None:
      raise RuntimeError(f'NOT_FOUND: {key}')
    self.values_read += 1
    return found

  def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
    self._start('blocking_get')
    end = time.monotonic() + timeout_ms / 1000
    while True:
      found = self._get(key)
      if found is not None:
        self.values_read += 1
        return found
      if time.monotonic() >= end:
        raise RuntimeError(f'DEADLINE_EXCEEDED: {key}')
      time.sleep(min(0.01, max(end - time.monotonic(), 0)))

  def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
    self._start('dir_get')
    base = prefix.rstrip('/')
    keys = {f'{base}/{p}' for p in range(self.n)} | {k for k in self.stored if k.startswith(prefix)}
    found = [(k, v) for k in sorted(keys) for v in [self._get(k)] if v is not None]
    self.values_read += len(found)
    return found

  def key_value_delete(self, key: str) -> None:
    self._start('delete')
    for k in [k for k in self.stored if k == key or k.startswith(key + '/')]:
      del self.stored[k]

  def requests(self) -> int:
    return sum(self.calls.values())


@pytest.fixture
def as_process(monkeypatch):
  """Makes this interpreter process ``me`` of ``n`` with ``client`` as its key-value client
  (the package reads them through ``_compat``)."""
  def become(client: FakeKV):
    monkeypatch.setattr(jax_distributed, 'distributed_client', lambda: client)
    monkeypatch.setattr(jax_distributed, 'process_count', lambda: client.n)
    monkeypatch.setattr(_oms, 'process_index', lambda: client.me)
  yield become
  decision.reset()


def _bounded(client: FakeKV, late: int) -> None:
  """One directory read (again only once late keys arrived), blocking reads only for the late
  ones, a few sets (a leader's progress, one per wave of arrivals) and deletes: nothing that
  grows with the fleet."""
  assert client.calls['dir_get'] <= 2, client.calls
  assert client.calls['blocking_get'] <= late + (1 if client.verdict is not None else 0), \
      client.calls
  assert client.calls['try_get'] == 0, client.calls
  assert client.requests() <= 4 + 2 * late, client.calls


def _preemption(client: FakeKV, monkeypatch, step: int) -> bool:
  del monkeypatch
  return decision._kv_agreement(step, participants_lib.Participants(None, 0),  # pylint: disable=protected-access
                                decision.Agreement(interval=1, timeout_s=30.0))


def _resume(client: FakeKV, monkeypatch, step: int) -> bool:
  monkeypatch.setattr(agreement._state, 'current', decision.Agreement(timeout_s=30.0))  # pylint: disable=protected-access
  return recovery.all_processes_ok(types.SimpleNamespace(), True, step)


def _node_steps(client: FakeKV, monkeypatch, step: int) -> list[int]:
  del client, monkeypatch, step
  options = types.SimpleNamespace(tier_dir=None, tier_peer_timeout_s=30.0)
  steps, fetch, elastic = node_steps._agreed(types.SimpleNamespace(), options, [9, 7], {},  # pylint: disable=protected-access
                                             timeout_s=30.0)
  assert fetch == {} and elastic == {}
  return steps


_HOLDS_9_7 = '{"steps":[9,7],"fetch":{}}'  # the verdict: every node holds 9 and 7


@pytest.mark.parametrize('n', FLEETS)
@pytest.mark.parametrize('me', [0, 1])
@pytest.mark.parametrize('late', [2])
@pytest.mark.parametrize('agreement', [_preemption, _resume, _node_steps])
def test_every_process_agreement_requests_do_not_grow(agreement, late, me, n, as_process,
                                                      monkeypatch):
  """The leader (process 0) gathers the others' values, two of them late, and publishes the
  verdict; every other process publishes its value and reads the verdict: two requests and
  one value, whatever the fleet. (With every member on time, against jax's real service:
  ``test_agreement_scale.py``.)"""
  # No notice anywhere (a True answer would notify this process): all answer '0'; every
  # process restored the step: all answer '1'; every node holds steps 9 and 7: '9,7'.
  flag = {_preemption: '0', _resume: '1', _node_steps: _HOLDS_9_7}[agreement]
  value = ((lambda p: node_steps.holdings(p, [7, 9], {}, '')) if agreement is _node_steps
           else (lambda p: flag))
  client = FakeKV(me, n, value, late=range(n - late, n),
                  verdict=None if me == 0 else flag)
  as_process(client)
  assert agreement(client, monkeypatch, step=7 + n) == {'0': False, '1': True}.get(flag, [9, 7])
  _bounded(client, late)
  if me == 0:
    assert client.values_read == n - 1, client.values_read
    assert 1 <= client.calls['set'] <= 1 + late, client.calls  # the verdict, progress
  else:
    assert client.values_read == 1 and client.requests() == 2, client.calls


def test_a_members_wait_names_the_processes_its_leader_missed(as_process):
  """The leader's gather times out: it names the silent processes, and so does every member,
  at once (from the leader's verdict), not at its own deadline."""
  leader = FakeKV(0, 64, lambda p: '1', silent=[5, 9])
  as_process(leader)
  with pytest.raises(rounds.PeerTimeoutError) as e:
    rounds.agree(leader, rounds.Sequence('test/agree', keep=1), 'orbax_pathways/test/agree/1',
                 me=0, members=range(64), count=64, leader=0, what='orbax_pathways: test',
                 value='1', decide=lambda v: '1', timeout_s=0.3)
  assert e.value.missing == (5, 9)
  verdict = leader.stored[f'orbax_pathways/test/agree/1/{rounds.VERDICT}']
  member = FakeKV(1, 64, lambda p: '1', verdict=verdict)
  began = time.monotonic()
  with pytest.raises(rounds.PeerTimeoutError) as e:
    rounds.agree(member, rounds.Sequence('test/agree', keep=1), 'orbax_pathways/test/agree/1',
                 me=1, members=range(64), count=64, leader=0, what='orbax_pathways: test',
                 value='1', decide=lambda v: '1', timeout_s=30.0)
  assert time.monotonic() - began < 5
  assert e.value.missing == (5, 9)
  assert str(e.value).startswith('orbax_pathways: test: process(es) 5, 9 of 64 did not answer '
                                 'process 0, which answers for this round'), str(e.value)


def test_a_member_whose_leader_is_gone_names_it():
  member = FakeKV(1, 8, lambda p: '1', silent=[0])
  with pytest.raises(rounds.PeerTimeoutError) as e:
    rounds.agree(member, rounds.Sequence('test/gone', keep=1), 'orbax_pathways/test/gone/1',
                 me=1, members=range(8), count=8, leader=0, what='orbax_pathways: test',
                 value='1', decide=lambda v: '1', timeout_s=0.3)
  assert e.value.missing == (0,)
  assert 'process 0, which answers for this round, did not publish its verdict within 0.3s' \
      in str(e.value), str(e.value)


@pytest.mark.parametrize('n', FLEETS)
@pytest.mark.parametrize('late', [0, 2])
def test_save_liveness_round_requests_do_not_grow(late, n):
  client = FakeKV(0, n, lambda p: liveness.OK, late=range(n - late, n))
  rnd = liveness.SaveRound(client, f'{rounds.ROOT}/save/test/{n}/{late}', 0, range(n), 0,
                           '/ckpt/1', n, timeout_s=30.0)
  rnd.writes_done(None, 0.0)  # the primary: every process reported ok
  _bounded(client, late)
  other = FakeKV(1, n, lambda p: liveness.OK, verdict=liveness.OK)
  liveness.SaveRound(other, rnd.key, 1, range(n), 0, '/ckpt/1', n, timeout_s=30.0).writes_done(
      None, 0.0)
  _bounded(other, 0)


@pytest.mark.parametrize('n', FLEETS)
@pytest.mark.parametrize('me', [0, 1])
@pytest.mark.parametrize('primary', [None, 0])
def test_lease_round_requests_do_not_grow(primary, me, n):
  part = participants_lib.Participants(None, primary)
  leader = part.leader(n)
  client = FakeKV(me, n, lambda p: 'ok', verdict=None if me == leader else 'ok')
  assert lease._agree(client, part, me, n, None) is None  # pylint: disable=protected-access
  _bounded(client, 0)


@pytest.mark.parametrize('n', FLEETS)
@pytest.mark.parametrize('late', [0, 2])
def test_peer_exchange_requests_do_not_grow(late, n):
  client = FakeKV(0, n, lambda p: json.dumps({'addr': f'h{p}:1', 'entries': []}),
                  late=range(n - late, n))
  ex = exchange.Exchange(client, 0, n, timeout_s=30.0)
  prefix = ex.prefix(f'/ckpt/{n}/{late}/item')
  ex.publish(prefix, 'h0:1', [])
  found, missing = ex.gather(prefix)
  assert (sorted(found), missing) == (list(range(1, n)), [])
  assert found[n - 1]['addr'] == f'h{n - 1}:1'
  _bounded(client, late)


@pytest.mark.parametrize('n', [64, 1024])
def test_silent_processes_are_named(n):
  silent = [5, 9] if n == 64 else list(range(100, 120))
  client = FakeKV(0, n, lambda p: '0', silent=silent)
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


def test_old_rounds_are_deleted_once_everyone_is_past_them():
  client = FakeKV(0, 3, lambda p: '0')
  seq = rounds.Sequence('test/retire', keep=2)
  keys = []
  for _ in range(4):
    rnd = rounds.Round(client, seq.next(), me=0, members=range(3), count=3, what='t')
    keys.append(rnd.key)
    rnd.publish('0')
    rnd.gather(5.0)
    seq.retire(client, 0, whole=True)
  assert keys == [f'{rounds.ROOT}/test/retire/{i}' for i in range(1, 5)]
  assert sorted(client.stored) == [f'{k}/0' for k in keys[2:]]  # rounds 1 and 2 are gone
  assert notice.pending() is False  # nothing here touched the process's notice


class SharedKV:
  """One store that every simulated process of a job publishes into (jax's service semantics);
  counts the requests and the keys returned while ``counting``."""

  def __init__(self) -> None:
    self.store: dict[str, str] = {}
    self.calls: collections.Counter[str] = collections.Counter()
    self.values_read = 0  # the other processes' values this process was sent
    self.keys = 0
    self.counting = False

  def key_value_set(self, key, value, allow_overwrite=False):
    if not allow_overwrite and key in self.store:
      raise RuntimeError(f'ALREADY_EXISTS: {key}')
    self.store[key] = value

  def key_value_try_get(self, key):
    self.calls['try_get'] += self.counting
    if key not in self.store:
      raise RuntimeError(f'NOT_FOUND: {key}')
    return self.store[key]

  def blocking_key_value_get(self, key, timeout_ms):
    self.calls['blocking_get'] += self.counting
    if key not in self.store:
      raise RuntimeError(f'DEADLINE_EXCEEDED: {key}')
    return self.store[key]

  def key_value_dir_get(self, prefix):
    found = [(k, v) for k, v in self.store.items() if k.startswith(prefix)]
    self.calls['dir_get'] += self.counting
    self.keys += len(found) * self.counting
    return found

  def key_value_delete(self, key):
    for k in [k for k in self.store if k == key or k.startswith(key + '/')]:
      del self.store[k]


@pytest.mark.parametrize('n', FLEETS)
def test_a_reader_reads_only_the_holders_of_the_writer_it_lacks(n):
  """Each of ``n`` processes publishes its key and one holder key for its own writer; a reader
  that lacks writer p1's chunks reads one key in one request, whatever ``n``; a gather of the
  round reads the processes' keys only (the holder keys sit beside the round); the holder
  keys of the restore before last go with it."""
  kv = SharedKV()
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
  assert (dict(kv.calls), kv.keys) == ({'dir_get': 1}, 1)
  got, missing = reader.gather(prefixes[-1])
  assert (len(got), missing, kv.keys) == (n - 1, [], 1 + n)
  assert not [k for k in kv.store if k.startswith(prefixes[0] + '.h/')]  # retired by the third
  assert f'{prefixes[0]}/0' not in kv.store
  assert len([k for k in kv.store if k.startswith(prefixes[1] + '.h/')]) == n  # before last: kept
