"""Waits on other processes or workers whose deadline measures silence, not total time, and
errors that name who went silent.

A wait that is still making progress never times out: its deadline is the time since the last
sign of progress (a process's key arriving, a worker finishing its share or moving bytes),
not since the wait began. Only a whole deadline without any sign raises, naming those that
gave none.

- ``gather`` (every process of a multi-controller job, through our key-value agreements:
  ``preemption/decision.py``'s preemption-step agreement, ``preemption/recovery.py``'s resume
  agreement, ``coord/liveness.py``'s "my writes finished" round). ``client`` is jax's distributed
  client (``blocking_key_value_get``, ``key_value_try_get``, ``key_value_dir_get`` where it
  has it); each process publishes ``<prefix>/<process index>`` and every process reads all of
  them. A plain loop of ``blocking_key_value_get(key, timeout)`` waits up to ``timeout`` per
  process (n times the deadline when several are gone) and its error says only "timed out".
  ``gather`` waits until no key has arrived for ``timeout_s`` and then raises
  ``PeerTimeoutError`` listing the process indices whose key never appeared, so the operator
  knows which host to look at.
- ``Progress`` (``transports/colocated_calls.call_with_deadline``, on the controller): the signs
  of progress of one colocated call, which its workers report as they go (where they run in
  the controller's process: the CPU backend) and the controller adds as their results become
  ready; the call's waiter raises once it has been silent for its deadline.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Sequence

# How long one blocking key-value read of ``gather`` lasts before it looks whether any other
# process's key arrived meanwhile (progress). Silence is measured to within this.
SLICE_S = 1.0


class PeerTimeoutError(TimeoutError):
  """Some processes did not answer before the deadline; ``missing`` lists their indices."""

  def __init__(self, message: str, missing: Sequence[int]):
    super().__init__(message)
    self.missing = tuple(missing)


class Progress:
  """The signs of progress of one wait, by participant (a worker host's name).

  ``start(who)`` when a participant begins its part, ``beat(who)`` whenever it moves bytes,
  ``finish(who)`` when its part is done; ``beat()`` without a name is progress no participant
  is named for (a result became ready). Thread-safe: bumped by whoever does the work, read by
  the waiter. The clock is ``time.monotonic``. What it keeps is one timestamp per participant:
  bounded by the wait's own participants."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self.began = time.monotonic()
    self._last = self.began
    self._beats = 0
    self._started: dict[str, float] = {}  # who -> the time of its last sign (running)
    self._finished: set[str] = set()

  def start(self, who: str) -> None:
    with self._lock:
      self._last = self._started[who] = time.monotonic()
      self._beats += 1

  def beat(self, who: str | None = None) -> None:
    with self._lock:
      self._last = now = time.monotonic()
      self._beats += 1
      if who is not None and who not in self._finished:
        self._started[who] = now

  def finish(self, who: str) -> None:
    with self._lock:
      self._last = time.monotonic()
      self._beats += 1
      self._started.pop(who, None)
      self._finished.add(who)

  @property
  def beats(self) -> int:
    """Signs of progress so far."""
    with self._lock:
      return self._beats

  def silent_for(self, now: float | None = None) -> float:
    """Seconds since the last sign of progress (since the wait began when none came)."""
    with self._lock:
      return (time.monotonic() if now is None else now) - self._last

  def running(self) -> list[str]:
    """Participants that started and did not finish, the longest silent first."""
    with self._lock:
      return [w for w, _ in sorted(self._started.items(), key=lambda kv: kv[1])]

  def finished(self) -> set[str]:
    with self._lock:
      return set(self._finished)

  def silent(self, names: Iterable[str]) -> list[str]:
    """Of ``names`` (every participant, in order), those that went silent: the ones running
    (started, not finished); when none is (the wait never reached them, or nothing reports
    from where they run), every one that did not finish."""
    names = list(names)
    running = set(self.running())
    if running:
      return [n for n in names if n in running]
    done = self.finished()
    return [n for n in names if n not in done]


def _try_get(client: Any, key: str) -> str | None:
  try:
    return client.key_value_try_get(key)
  except Exception:  # pylint: disable=broad-except  (NOT_FOUND: not published yet)
    return None


def _arrived(client: Any, prefix: str, wanted: Sequence[int]) -> dict[int, str]:
  """The keys of ``wanted`` already published under ``prefix``: one directory read where the
  client has it, else one read per key."""
  dir_get = getattr(client, 'key_value_dir_get', None)
  if dir_get is not None:
    try:
      got = {}
      wanted_set = set(wanted)
      for key, value in dir_get(f'{prefix}/'):
        head, _, last = key.rstrip('/').rpartition('/')
        if last.isdigit() and int(last) in wanted_set and head in ('', prefix.strip('/')):
          got[int(last)] = value
      return got
    except Exception:  # pylint: disable=broad-except  (an older client, a dead service)
      pass
  out = {}
  for p in wanted:
    v = _try_get(client, f'{prefix}/{p}')
    if v is not None:
      out[p] = v
  return out


def gather(client: Any, prefix: str, num_processes: int, timeout_s: float, *,
           what: str, processes: Sequence[int] | None = None) -> list[str]:
  """The values every process published under ``<prefix>/<i>``, in process order, waiting
  while they arrive: it raises only once ``timeout_s`` passed without any new key (a key
  arriving is progress; to within ``SLICE_S``). ``processes``: the indices to wait for
  (default ``range(num_processes)``; ``num_processes`` is then only what the error says).
  Raises ``PeerTimeoutError`` naming the processes still missing."""
  ids = list(range(num_processes)) if processes is None else list(processes)
  began = time.monotonic()
  last = began  # the last sign of progress: a key that arrived
  values: dict[int, str] = {}
  error: Exception | None = None
  while len(values) < len(ids):
    p = next(q for q in ids if q not in values)
    remaining = last + timeout_s - time.monotonic()
    if remaining <= 0:
      break
    asked = time.monotonic()
    wait_s = min(remaining, SLICE_S)
    try:
      values[p] = client.blocking_key_value_get(f'{prefix}/{p}', max(1, int(wait_s * 1000)))
      last = time.monotonic()
    except Exception as e:  # pylint: disable=broad-except  (DEADLINE_EXCEEDED, or a dead service)
      error = e
      got = _arrived(client, prefix, [q for q in ids if q not in values])
      if got:
        values.update(got)
        last = time.monotonic()
      elif time.monotonic() - asked < wait_s / 2:  # not a slice that ran out: the service failed
        break
  missing = [q for q in ids if q not in values]
  if missing:
    got = _arrived(client, prefix, missing)  # the deadline raced the last keys
    values.update(got)
    missing = [q for q in missing if q not in got]
  if missing:
    shown = ', '.join(map(str, missing[:16])) + (' ...' if len(missing) > 16 else '')
    cause = f'; {type(error).__name__}: {error}' if error is not None else ''
    raise PeerTimeoutError(
        f'{what}: process(es) {shown} of {num_processes} did not answer within '
        f'{timeout_s:g}s of the last process that did ({time.monotonic() - began:.0f}s in all; '
        f'key prefix {prefix}{cause}). Those processes are gone, stuck, or not running the '
        'same code path: check their logs; every process must call '
        'CheckpointManager.should_save/save at every step.', missing) from error
  return [values[p] for p in ids]
