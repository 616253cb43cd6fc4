"""One key-value round among processes: publish, gather under one deadline, a verdict, the
round's keys and their clean-up. Every agreement of the package is one of these.

Who runs rounds (each on every member process, through jax's key-value client; no jax here: the
client arrives as an object with ``key_value_set``, ``blocking_key_value_get``,
``key_value_try_get``, ``key_value_delete`` and, where it has it, ``key_value_dir_get``):

- ``manager/lease.py`` (at each ``CheckpointManager.save``): the lease-writing process
  publishes a verdict the others read; under ``primary_host=None`` every other member
  publishes its answer first and the first member gathers them;
- ``coord/liveness.SaveRound`` (Orbax's commit thread of each multi-process async save): every
  member publishes "my writes finished", the primary gathers and publishes the verdict;
- ``preemption/decision.py`` (every ``agreement_interval`` steps), ``multitier/resume.py``
  (each step ``resume`` tries) and ``multitier/node_steps.py`` (the node steps every node holds,
  once per resume): ``agree``, every member publishes its value and the leader publishes the
  verdict;
- ``peer/exchange.Exchange`` (each restore with the tier on): every process publishes what its
  node holds; a reader gathers the others' when it first needs a chunk, and takes whoever
  answered in time (``missing_ok``: a missing peer costs its chunks a storage read).

Beside rounds, a few single keys one process publishes for the others (its host name, the
job's peer secret, a tier server's address, a retention count: ``host_key`` and below), with
the one-request calls that set, read and wait for them (``put``, ``try_read``, ``wait_for``,
``poll``). No other module calls jax's key-value client (``tests/repo/test_boundaries.py``).

Keys, built here only: a round is ``orbax_pathways/<name>/<seq>``, where ``name`` says what
agrees among whom (``Participants.name(kind)``: the kind and a digest of the manager's
processes, primary host and barrier prefix; the tier's ``tier_peers/<item digest>``) and
``seq`` numbers this name's rounds on this process (``Sequence``: every member counts alike,
because every member runs the same rounds in the same order, as Orbax's own barrier keys
require). A member publishes ``<round>/<process index>``; the verdict is ``<round>/verdict``.
Old rounds are deleted here only (``Sequence.retire``, ``Round.delete``), once every member is
past them: who does it and how many rounds back is the caller's ``keep`` and ``whole``.

What a round costs each process, whatever the fleet: one set to publish; a gather reads the
key-value directory of the round first (one request: every key already there), then blocks
only on one process still missing at a time and reads the directory again after each arrival
and each ``SLICE_S`` without one (requests count the waves of arrivals); a verdict is one set
(its publisher) or one blocking read (the others). The publisher of a verdict and a gatherer
read one value per member; nothing else grows with the fleet.

The deadline of ``gather`` measures silence: it restarts whenever a key arrives, so a round
whose keys keep arriving is never cut off; only a whole ``timeout_s`` without any arrival
raises ``PeerTimeoutError``, which names the processes that did not answer, the round's key
and the deadline. (The tier's exchange bounds its wait in total instead, ``on_silence=False``:
a restore reads storage rather than wait longer for peers.)
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence as Seq

ROOT = 'orbax_pathways'
VERDICT = 'verdict'
# ``agree``'s leader sets ``<round>/progress`` to the number of values it has gathered after
# each wave of arrivals: a member waiting for the verdict tells a leader still gathering from
# one that is gone.
PROGRESS = 'progress'
# The start of ``agree``'s verdict when its leader's gather timed out, then the missing members
# (a verdict of ``decide`` never starts with it).
MISSING = 'missing:'
# How long one blocking key-value read of ``gather`` lasts before it reads the round's
# directory for keys that arrived meanwhile (progress). Silence is measured to within this.
SLICE_S = 1.0


class PeerTimeoutError(TimeoutError):
  """Some processes did not answer a round in time: ``missing`` lists their indices, ``found``
  the values of those that did, ``key`` is the round."""

  def __init__(self, message: str, missing: Seq[int], found: Mapping[int, str] | None = None,
               key: str = ''):
    super().__init__(message)
    self.missing = tuple(missing)
    self.found = dict(found or {})
    self.key = key


def round_key(name: str, seq: int | str) -> str:
  """The key of round ``seq`` of ``name``: ``orbax_pathways/<name>/<seq>``."""
  return f'{ROOT}/{name}/{seq}'


# ---- single keys: a value one process publishes for the others, outside any round ---------------
# Every key of the package is built here: the rounds above, and these.

def host_key(process: int) -> str:
  """Process ``process``'s host name, published once per lifetime (``coord/liveness.py``:
  read only to name a missing process)."""
  return f'{ROOT}/liveness/hosts/{process}'


SECRET_KEY = f'{ROOT}/tier_peer_secret'  # the job's peer secret (``peer/exchange.job_secret``)


def node_part_key(round_key_: str, step: int, writer: int, copy: bool = False) -> str:
  """Where a node steps round's member says its node holds ``writer``'s part of node ``step``
  (its process and server address: ``multitier/node_round.agreed``), beside the round: the
  part as saved, or with ``copy`` a partner's copy of it (so that a restore finding one of
  the two damaged can take the other)."""
  return f'{round_key_}.parts/{int(step)}/{int(writer)}' + ('.copy' if copy else '')


def partner_address_key(process: int) -> str:
  """Where process ``process``'s tier server takes partner copies (``fleet/partner_copy.py``)."""
  return f'{ROOT}/tier_partner/{process}'


def retention_key(directory_digest: str, instance: int) -> str:
  """How many retention deletions the primary host ran for one hidden manager of local-only
  steps (``multitier/trailing_deleter.py``), overwritten."""
  return f'{ROOT}/local_retention/{directory_digest}/{instance}'


def put(client: Any, key: str, value: str, *, overwrite: bool = True) -> None:
  """Publishes ``value`` under ``key`` (one set); ``overwrite=False`` raises the client's
  ``ALREADY_EXISTS`` if the key is there."""
  client.key_value_set(key, value, allow_overwrite=overwrite)


def try_read(client: Any, key: str) -> str | None:
  """``key``'s value if it is there now (one read), else None (not published, or the service
  failed)."""
  try:
    return client.key_value_try_get(key)
  except Exception:  # pylint: disable=broad-except  (NOT_FOUND)
    return None


def wait_for(client: Any, key: str, timeout_s: float) -> str:
  """``key``'s value, once published (one blocking read); the client's ``DEADLINE_EXCEEDED``
  (or the service's failure) past ``timeout_s``: the caller says what it waited for."""
  return client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))


def poll(client: Any, key: str, done: Callable[[str | None], bool], timeout_s: float,
         max_pause_s: float = 0.2) -> str | None:
  """Reads ``key`` (``try_read``) until ``done`` of its value, pausing 5 ms doubling to
  ``max_pause_s`` between reads; the last value read, whether or not it was done after
  ``timeout_s`` (for a key its publisher overwrites, such as a count)."""
  deadline = time.monotonic() + timeout_s
  pause = 0.005
  while not done(value := try_read(client, key)) and time.monotonic() <= deadline:
    time.sleep(pause)
    pause = min(pause * 2, max_pause_s)
  return value


def _shown(processes: Seq[int]) -> str:
  return ', '.join(map(str, processes[:16])) + (' ...' if len(processes) > 16 else '')


def delete_quietly(client: Any, key: str) -> None:
  """Deletes ``key`` (one request); a failure is ignored (a key left behind is never read:
  every key names its round)."""
  _quietly(client.key_value_delete, key)


def _quietly(fn, *args) -> None:
  try:
    fn(*args)
  except Exception:  # pylint: disable=broad-except  (a leftover key costs memory, nothing else)
    pass


class Sequence:
  """The rounds of one ``name`` on this process, in the order they began: ``next`` numbers the
  next one (or takes the caller's ``tag``, e.g. ``<notice generation>/<step>``, which every
  member derives alike) and ``retire`` deletes the round that began ``keep`` rounds before the
  latest. One per name per process (``sequence``): the counting is this process's own."""

  def __init__(self, name: str, keep: int):
    self.name = name
    self.keep = keep
    self._lock = threading.Lock()
    self._count = 0
    self._keys: collections.deque[str] = collections.deque(maxlen=keep + 1)

  def next(self, tag: str | None = None, *, suffix: str | None = None) -> str:
    """The key of this process's next round of ``name``: numbered (``<n>``, with ``/<suffix>``
    when given) or named by ``tag``."""
    with self._lock:
      self._count += 1
      seq = tag if tag is not None else str(self._count)
      key = round_key(self.name, seq if suffix is None else f'{seq}/{suffix}')
      if not self._keys or self._keys[-1] != key:
        self._keys.append(key)
      return key

  def retire(self, client: Any, me: int, *, whole: bool, subdirs: Seq[str] = ()) -> None:
    """Deletes the round that began ``keep`` rounds before the latest: all of it (``whole``:
    one request, by the process the caller says answers for the round) or only this process's
    own key and the round's ``subdirs`` (``Round.publish_at``'s directories: one request each,
    from every member; a second delete of a directory deletes nothing). Call it once every
    member is past that round."""
    with self._lock:
      if self.keep <= 0 or len(self._keys) <= self.keep:
        return
      old = self._keys.popleft()
    _quietly(client.key_value_delete, old if whole else f'{old}/{me}')
    if not whole:
      for sub in subdirs:
        _quietly(client.key_value_delete, f'{old}.{sub}')


class _Registry:
  """This process's sequences, by name."""

  def __init__(self) -> None:
    self.reset()

  def reset(self) -> None:
    self.lock = threading.Lock()
    self.sequences: dict[str, Sequence] = {}


_registry = _Registry()


def sequence(name: str, keep: int = 0) -> Sequence:
  """This process's ``Sequence`` of ``name`` (made at its first use, with its ``keep``).
  Process-wide by nature: the rounds a process took part in."""
  with _registry.lock:
    found = _registry.sequences.get(name)
    if found is None:
      found = _registry.sequences[name] = Sequence(name, keep)
    return found


# A forked child takes part in no round of its parent (and the parent's lock may be held).
os.register_at_fork(after_in_child=_registry.reset)


class Round:
  """One round on this process (``me``) among ``members`` (process indices, in order).

  ``count`` is the job's process count (for messages); ``what`` says what the round agrees on
  (the start of every error's text); ``leader`` is the member that publishes the verdict."""

  def __init__(self, client: Any, key: str, *, me: int, members: Iterable[int], count: int,
               what: str, leader: int | None = None):
    self.client = client
    self.key = key
    self.me = me
    self.members = tuple(members)
    self.count = count
    self.what = what
    self.leader = self.members[0] if leader is None and self.members else leader

  @property
  def is_leader(self) -> bool:
    return self.me == self.leader

  # ---- this process's value ------------------------------------------------------------------
  def publish(self, value: str, *, overwrite: bool = True) -> None:
    """Publishes this process's value (``<key>/<me>``: one set)."""
    self.client.key_value_set(f'{self.key}/{self.me}', value, allow_overwrite=overwrite)

  def publish_at(self, subdir: str, value: str) -> None:
    """Publishes this process's value in a directory beside the round's own
    (``<key>.<subdir>/<me>``: one set; beside it, so that a ``gather`` of the round never reads
    it), for readers that want only some members' values and do not know which members those
    are (the tier's holders of one writer's chunks: ``listing``)."""
    self.client.key_value_set(f'{self.key}.{subdir}/{self.me}', value, allow_overwrite=True)

  def listing(self, subdir: str) -> dict[int, str]:
    """The values published in ``<key>.<subdir>/`` now, by process index: one directory read
    (an empty answer where the client has none or the service fails). What it returns is what
    was published there, not what the round's members number."""
    dir_get = getattr(self.client, 'key_value_dir_get', None)
    if dir_get is None:
      return {}
    base = f'{self.key}.{subdir}'.strip('/')
    try:
      found = dir_get(f'{self.key}.{subdir}/')
    except Exception:  # pylint: disable=broad-except  (an older client, a dead service)
      return {}
    out = {}
    for key, value in found:
      head, _, last = key.rstrip('/').rpartition('/')
      if last.isdigit() and head.strip('/') == base:
        out[int(last)] = value
    return out

  def read(self, name: str) -> str | None:
    """``<key>/<name>`` if it is there now (one read), else None."""
    return try_read(self.client, f'{self.key}/{name}')

  def put(self, name: str, value: str) -> None:
    """Sets ``<key>/<name>`` (one set, overwriting): a value of the round beside the members'
    (the save round's ``commit`` outcome and ``alive`` marks)."""
    put(self.client, f'{self.key}/{name}', value)

  def wait_for(self, name: str, timeout_s: float) -> str:
    """``<key>/<name>``, once set (one blocking read); the client's error past ``timeout_s``."""
    return wait_for(self.client, f'{self.key}/{name}', timeout_s)

  # ---- the others' values --------------------------------------------------------------------
  def _arrived(self, wanted: Seq[int], *, first: bool) -> dict[int, str]:
    """The values of ``wanted`` already published: one directory read where the client has it;
    else one read per key (not for the ``first`` look: the blocking reads follow anyway)."""
    dir_get = getattr(self.client, 'key_value_dir_get', None)
    if dir_get is not None:
      try:
        got: dict[int, str] = {}
        wanted_set = set(wanted)
        own = self.key.strip('/')
        for key, value in dir_get(f'{self.key}/'):
          head, _, last = key.rstrip('/').rpartition('/')
          if last.isdigit() and int(last) in wanted_set and head in ('', own):
            got[int(last)] = value
        return got
      except Exception:  # pylint: disable=broad-except  (an older client, a dead service)
        pass
    if first:
      return {}
    out = {}
    for p in wanted:
      v = self.read(str(p))
      if v is not None:
        out[p] = v
    return out

  def gather(self, timeout_s: float, *, processes: Seq[int] | None = None,
             on_silence: bool = True, missing_ok: bool = False,
             on_arrival: Callable[[int], None] | None = None) -> dict[int, str]:
    """The values of ``processes`` (default: every member), by process index in their order.

    Reads the round's directory first, then blocks on one process still missing; when its key
    arrives, one more directory read takes every other key that came meanwhile (so the requests
    count the waves of arrivals, not the processes). A key that arrives restarts the deadline
    (``on_silence``; else it is ``timeout_s`` in all, to within ``SLICE_S``). Past it:
    ``PeerTimeoutError`` naming the processes that did not answer, or (``missing_ok``) the
    values that came. ``on_arrival(n)``: called after each wave with the number of values
    gathered so far."""
    ids = list(self.members if processes is None else processes)
    began = time.monotonic()
    last = began  # the last sign of progress: a key that arrived
    values = self._arrived(ids, first=True) if ids else {}
    error: Exception | None = None
    while len(values) < len(ids):
      p = next(q for q in ids if q not in values)
      remaining = (last if on_silence else began) + timeout_s - time.monotonic()
      if remaining <= 0:
        break
      asked = time.monotonic()
      wait_s = min(remaining, SLICE_S)
      try:
        values[p] = self.client.blocking_key_value_get(f'{self.key}/{p}',
                                                       max(1, int(wait_s * 1000)))
        last = time.monotonic()
        if len(values) < len(ids) - 1:  # the others that came meanwhile: one directory read
          values.update(self._arrived([q for q in ids if q not in values], first=True))
        if on_arrival is not None:
          on_arrival(len(values))
      except Exception as e:  # pylint: disable=broad-except  (DEADLINE_EXCEEDED, a dead service)
        error = e
        got = self._arrived([q for q in ids if q not in values], first=False)
        if got:
          values.update(got)
          last = time.monotonic()
          if on_arrival is not None:
            on_arrival(len(values))
        elif time.monotonic() - asked < wait_s / 2:  # not a slice that ran out: the service failed
          break
    missing = [q for q in ids if q not in values]
    if missing:
      values.update(self._arrived(missing, first=False))  # the deadline raced the last keys
      missing = [q for q in missing if q not in values]
    ordered = {p: values[p] for p in ids if p in values}
    if missing and not missing_ok:
      cause = f'; {type(error).__name__}: {error}' if error is not None else ''
      within = 'of the last process that did' if on_silence else 'in all'
      raise PeerTimeoutError(
          f'{self.what}: process(es) {_shown(missing)} of {self.count} did not answer within '
          f'{timeout_s:g}s {within} ({time.monotonic() - began:.0f}s in all; key prefix '
          f'{self.key}{cause}). Those processes are gone, stuck, or not running the same code '
          'path: check their logs; every process must call CheckpointManager.should_save/save '
          'at every step.', missing, ordered, self.key) from error
    return ordered

  # ---- the verdict ---------------------------------------------------------------------------
  def publish_verdict(self, value: str, *, once: bool = False) -> str:
    """The leader's verdict (``<key>/verdict``: one set); ``once``: unless another was set first
    (then that one stands: one more read). Returns the verdict that stands."""
    if not once:
      self.client.key_value_set(f'{self.key}/{VERDICT}', value, allow_overwrite=True)
      return value
    try:
      self.client.key_value_set(f'{self.key}/{VERDICT}', value, allow_overwrite=False)
      return value
    except Exception:  # pylint: disable=broad-except  (ALREADY_EXISTS: another verdict won)
      found = self.read(VERDICT)
      return value if found is None else found

  def await_verdict(self, timeout_s: float, *, while_progress: bool = False) -> str:
    """The verdict, once published (one blocking read); ``PeerTimeoutError`` naming the leader
    if none came within ``timeout_s``. ``while_progress``: the wait restarts while the leader's
    ``<key>/progress`` changes between deadlines (one read each: the leader still gathers a
    round whose keys keep arriving, as its own deadline measures silence)."""
    seen = None
    while True:
      try:
        return self.client.blocking_key_value_get(f'{self.key}/{VERDICT}',
                                                  max(1, int(timeout_s * 1000)))
      except Exception as e:  # pylint: disable=broad-except  (DEADLINE_EXCEEDED, a dead service)
        error = e
      now = self.read(PROGRESS) if while_progress else None
      if now is None or now == seen:
        break
      seen = now
    raise PeerTimeoutError(
        f'{self.what}: process {self.leader}, which answers for this round, did not publish '
        f'its verdict within {timeout_s:g}s (key {self.key}/{VERDICT}; {type(error).__name__}: '
        f'{error})', [self.leader] if self.leader is not None else [], {}, self.key) from error

  # ---- clean-up ------------------------------------------------------------------------------
  def delete(self) -> None:
    """Deletes the whole round (one request), once every member is past it."""
    _quietly(self.client.key_value_delete, self.key)


def agree(client: Any, seq: Sequence, key: str, *, me: int, members: Iterable[int], count: int,
          leader: int | None, what: str, value: str, decide: Callable[[list[str]], str],
          timeout_s: float) -> str:
  """One round the leader decides, on every member: each member but the leader publishes
  ``value`` and waits for the verdict (two requests, whatever the fleet); the leader gathers
  theirs (``gather``: a directory read, then one blocking read and one directory read per wave
  of arrivals, each wave also counted in ``<key>/progress``), publishes ``decide`` of every
  member's value (its own first, then by process index), and retires the round of ``seq``
  before (every member published this one, so all are past it). Returns the verdict. Silence
  of ``timeout_s`` raises ``PeerTimeoutError`` naming the members that did not publish, on
  the leader and (through its verdict) on every member; a member whose leader is gone raises
  one naming the leader (its wait restarts while the leader still gathers). A member reads
  one value, the leader one per member: what the coordination service carries per round
  grows with the fleet once, not once per member.
  The preemption agreement and the resume's agreements (on a step, on the node steps every
  node holds) are this round."""
  rnd = Round(client, key, me=me, members=members, count=count, what=what, leader=leader)
  if not rnd.is_leader:
    rnd.publish(value)
    verdict = rnd.await_verdict(timeout_s, while_progress=True)
    if verdict.startswith(MISSING):
      missing = [int(p) for p in verdict[len(MISSING):].split(',') if p]
      raise PeerTimeoutError(
          f'{what}: process(es) {_shown(missing)} of {count} did not answer process '
          f'{rnd.leader}, which answers for this round, within {timeout_s:g}s of the last '
          f'process that did (key prefix {key}). Those processes are gone, stuck, or not '
          'running the same code path: check their logs.', missing, {}, key)
    return verdict
  others = [p for p in rnd.members if p != me]

  def progress(n: int) -> None:
    _quietly(client.key_value_set, f'{key}/{PROGRESS}', str(n), True)

  try:
    values = rnd.gather(timeout_s, processes=others, on_arrival=progress) if others else {}
  except PeerTimeoutError as e:  # the members learn who is missing now, not at their deadline
    _quietly(rnd.publish_verdict, MISSING + ','.join(map(str, e.missing)))
    raise
  verdict = rnd.publish_verdict(decide([value, *values.values()]))
  seq.retire(client, me, whole=True)
  return verdict
