"""Storage requests with deadlines: a request past its deadline gets a second, identical one.

Called by ``storage/reader.py`` (each region read), ``storage/writer.py`` (each piece written)
and ``storage/meta_io.py`` (each record, index and listing), on whichever host does the I/O
(the process, or a Pathways worker). The deadline comes from ``storage/deadline.POLICY``.

``attempt(n)`` issues the request; ``n`` is 0 for the first and 1, 2, ... for the later ones,
which the callers issue through a fresh tensorstore context (``fresh_context``): a fresh driver
opens fresh connections and has its own chunk cache, so the second request cannot queue behind
the stuck one or join its pending cache entry. When an attempt passes its deadline without an
answer, the next one is issued and the first complete answer (of any attempt) wins; the others
are cancelled. A read's bytes are still verified by the caller (checksums), whichever attempt
answered. Object writes are idempotent (same key, same bytes), so a write is retried the same
way. An attempt that fails is not retried here (tensorstore already retried it); its error is
raised once no other attempt can still answer.

After ``MAX_ATTEMPTS`` attempts have each passed their deadline, ``StorageDeadlineError`` names
what was being read or written, how long it waited and what to do.

Requests we do not issue get a stall deadline instead (``stall_timeout_s``: ``STALL_FACTOR`` times
the floor). Orbax's own tensorstore requests (its ``_sharding`` file, the OCDBT merge) and the
writer lease's share tensorstore's HTTP transport, which by default waits for a stalled transfer
for a long time (reads: indefinitely); Orbax's gcsfs and google-cloud-storage requests get it
from ``_compat/storage_clients.py`` (docs/architecture.md, "Storage requests and their
deadlines"). At import this module sets tensorstore's stall timeout,
``TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS``, to ``STALL_FACTOR`` times the deadline floor
(``ORBAX_PATHWAYS_REQUEST_DEADLINE_FLOOR_S``; 20 s by default) unless it is set: a transfer
that moves no byte for that long is aborted and retried by tensorstore (gcs_request_retries).
Tensorstore reads the variable once, when its transport starts (the first HTTP request of the
process), so it applies when ``orbax_pathways`` is imported before any storage I/O.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import threading
import time
from typing import Any, Awaitable, Callable

import tensorstore as ts

from orbax_pathways import options as options_lib
from orbax_pathways.storage import deadline as deadline_lib

logger = logging.getLogger('orbax_pathways')

MAX_ATTEMPTS = 3
STALL_ENV = 'TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS'
STALL_FACTOR = 2.0


def stall_timeout_s(floor_s: float) -> int:
  """How long a transfer we do not hedge ourselves may stay silent (no byte moving) before its
  client aborts and retries it: ``STALL_FACTOR`` times the deadline floor, whole seconds.
  Tensorstore's transport (below) and gcsfs / google-cloud-storage (``_compat/storage_clients``)
  get it."""
  return max(1, math.ceil(STALL_FACTOR * floor_s))


def set_stall_timeout(environ=None) -> str:
  """Sets tensorstore's stall timeout (seconds) unless the user set it; returns its value."""
  environ = os.environ if environ is None else environ
  if not environ.get(STALL_ENV, '').strip():
    try:
      floor = options_lib.env_value('ORBAX_PATHWAYS_REQUEST_DEADLINE_FLOOR_S', environ)
    except ValueError:  # reported by install(), which parses every variable
      floor = deadline_lib.DEFAULT_FLOOR_S
    environ[STALL_ENV] = str(stall_timeout_s(floor))
  return environ[STALL_ENV]


set_stall_timeout()

# Requests that passed their deadline, and which attempt answered, by kind: for tests and logs.
_counts_lock = threading.Lock()
_counts: dict[str, int] = {}


class StorageDeadlineError(TimeoutError):
  """No attempt of a storage request answered within its deadlines."""


def counts() -> dict[str, int]:
  """``'<kind>_hedged'``: requests that got a second attempt; ``'<kind>_won_by_retry'``: those
  a later attempt answered first (kind: read, write, meta)."""
  with _counts_lock:
    return dict(_counts)


def _count(key: str) -> None:
  with _counts_lock:
    _counts[key] = _counts.get(key, 0) + 1


# Later attempts' contexts, per (caller's context, attempt number): every request of one save or
# restore that needs a second attempt shares one fresh context (one more OCDBT writer per
# database, not one per array). Holds the caller's context, so its id is not reused.
FRESH_CONTEXTS = 16
_fresh_lock = threading.Lock()
_fresh: collections.OrderedDict[tuple[int, int], tuple[Any, ts.Context]] = (
    collections.OrderedDict())


def fresh_context(context: ts.Context | None, attempt: int = 1) -> ts.Context:
  """A context with the same resources as ``context`` (Orbax's, with ours) but none of its
  drivers, connections or cache entries: the same one for every request of attempt number
  ``attempt`` through ``context``."""
  key = (id(context), attempt)
  with _fresh_lock:
    hit = _fresh.get(key)
    if hit is not None and hit[0] is context:
      _fresh.move_to_end(key)
      return hit[1]
    try:
      fresh = ts.Context() if context is None else ts.Context(context.spec)
    except Exception:  # pylint: disable=broad-except  (a context built without a spec)
      fresh = ts.Context()
    _fresh[key] = (context, fresh)
    while len(_fresh) > FRESH_CONTEXTS:
      _fresh.popitem(last=False)
    return fresh


def _error(what: str, kind: str, waited: float, attempts: int) -> StorageDeadlineError:
  verb = {'read': 'Reading', 'write': 'Writing'}.get(kind, 'Accessing')
  return StorageDeadlineError(
      f'{verb} {what}: no answer from storage after {waited:.1f}s and {attempts} identical '
      f'requests, each past its deadline (Options.request_deadline_floor_s / '
      f'request_deadline_cap_s). Storage is unreachable or stuck for this object: check the '
      'bucket and network, or raise ORBAX_PATHWAYS_REQUEST_DEADLINE_CAP_S if requests this '
      'large are normally this slow')


def _say_hedged(kind: str, what: str, waited_s: float, n: int) -> None:
  """Counts and logs that request ``n + 1`` of ``what`` is being issued (both runners)."""
  if n == 1:
    _count(f'{kind}_hedged')
  logger.warning('orbax_pathways: %s %s: no answer after %.1fs; issuing request %d of at most %d '
                 '(the first complete answer wins).', kind, what, waited_s, n + 1, MAX_ATTEMPTS)


def _answered(f: Any) -> bool:
  """Whether ``f`` (an asyncio or tensorstore future) finished with an answer."""
  return f.done() and not f.cancelled() and f.exception() is None


class _Race:
  """The algorithm both runners share (``run`` waits with asyncio, ``run_sync`` on a thread):
  the attempts issued, their tickets, the first error, when the next attempt is due. It never
  waits itself; each runner waits for ``unsettled()`` until ``wait_s()`` and then calls
  ``take()`` (something finished) or ``issue_next()`` (nothing did in time).

  ``start(n)`` issues attempt ``n`` and returns its future (an asyncio task or a tensorstore
  future: both have ``done``, ``cancelled``, ``exception``, ``result`` and ``cancel``)."""

  def __init__(self, start: Callable[[int], Any], *, nbytes: int, what: str, kind: str,
               policy: deadline_lib.Policy):
    self._start, self._nbytes, self._what, self._kind = start, nbytes, what, kind
    self._policy = policy
    self._t0 = time.monotonic()
    self._futures: list[Any] = []
    self._tickets: list[deadline_lib.Ticket] = []
    self._ended: set[int] = set()
    self._first_error: BaseException | None = None
    self._due = self._t0  # when the latest attempt passes its deadline

  def issue_next(self) -> None:
    """Issues the next attempt; past ``MAX_ATTEMPTS`` raises ``StorageDeadlineError``."""
    n = len(self._futures)
    if n >= MAX_ATTEMPTS:
      raise _error(self._what, self._kind, time.monotonic() - self._t0, n)
    if n:
      _say_hedged(self._kind, self._what, time.monotonic() - self._t0, n)
    ticket = self._policy.begin(self._nbytes, time.monotonic())
    try:
      future = self._start(n)
    except BaseException:
      self._policy.end(ticket, time.monotonic(), ok=False)
      raise
    self._futures.append(future)
    self._tickets.append(ticket)
    self._due = time.monotonic() + ticket.deadline_s

  def unsettled(self) -> list[Any]:
    """The attempts issued whose outcome was not taken yet."""
    return [f for i, f in enumerate(self._futures) if i not in self._ended]

  def wait_s(self) -> float:
    """How long until the latest attempt passes its deadline (0: it has)."""
    return max(self._due - time.monotonic(), 0.0)

  def any_done(self) -> bool:
    return any(f.done() for f in self.unsettled())

  def take(self) -> tuple[bool, Any]:
    """Takes the outcome of every attempt that finished, in the order issued: ``(True,
    answer)`` for the first that answered; ``(False, None)`` while others may still answer;
    the first error once every attempt failed."""
    for i, f in enumerate(self._futures):
      if i in self._ended or not f.done():
        continue
      self._end(i)
      error = f.exception()
      if error is None:
        if i:
          _count(f'{self._kind}_won_by_retry')
        return True, f.result()
      self._first_error = self._first_error or error
    if len(self._ended) == len(self._futures):
      assert self._first_error is not None
      raise self._first_error
    return False, None

  def cancel(self) -> list[Any]:
    """Cancels every attempt still running and returns them. Cancelling on an event loop that
    closed under this request ('Event loop is closed') is skipped: nothing can run there."""
    running = [f for f in self.unsettled() if not f.done()]
    for f in running:
      try:
        f.cancel()
      except RuntimeError:
        pass
    return running

  def end(self) -> None:
    """Ends every ticket not ended yet (an attempt cancelled, failed, or answered unread)."""
    for i in range(len(self._futures)):
      if i not in self._ended:
        self._end(i)

  def _end(self, i: int) -> None:
    self._ended.add(i)
    self._policy.end(self._tickets[i], time.monotonic(), ok=_answered(self._futures[i]))


async def run(attempt: Callable[[int], Awaitable[Any]], *, nbytes: int, what: str, kind: str,
              policy: deadline_lib.Policy | None = None) -> Any:
  """The first answer of ``attempt(0)``, ``attempt(1)``, ...: each later attempt is issued when
  all earlier ones passed their deadline. Cancels the others before returning. However it ends
  (an answer, an error, cancelled, or closed with its event loop), every attempt's ticket is
  ended: a request left counted in flight would add its bytes to every later deadline of the
  process (``storage/deadline.py``)."""
  race = _Race(lambda n: asyncio.ensure_future(attempt(n)), nbytes=nbytes, what=what, kind=kind,
               policy=policy or deadline_lib.POLICY)

  async def settle() -> None:
    try:
      running = race.cancel()
      if running:
        await asyncio.gather(*running, return_exceptions=True)
    finally:
      race.end()

  try:
    race.issue_next()
    while True:
      done, _ = await asyncio.wait(race.unsettled(), timeout=race.wait_s(),
                                   return_when=asyncio.FIRST_COMPLETED)
      if not done:
        race.issue_next()
        continue
      answered, answer = race.take()
      if answered:
        await settle()
        return answer
  except GeneratorExit:
    # This coroutine is being closed, not cancelled: its event loop ended under it (an event
    # loop closed while this read was in flight). Nothing may be awaited now, and cancelling
    # schedules callbacks, which a closed loop refuses.
    race.cancel()
    raise
  except BaseException:
    await settle()
    raise
  finally:
    race.end()


def run_sync(attempt: Callable[[int], ts.Future], *, nbytes: int, what: str, kind: str,
             policy: deadline_lib.Policy | None = None) -> Any:
  """``run`` for a thread without an event loop: ``attempt(n)`` returns a tensorstore future."""
  changed = threading.Condition()

  def notify(_) -> None:
    with changed:
      changed.notify_all()

  def start(n: int) -> ts.Future:
    future = attempt(n)
    future.add_done_callback(notify)
    return future

  race = _Race(start, nbytes=nbytes, what=what, kind=kind, policy=policy or deadline_lib.POLICY)
  try:
    race.issue_next()
    while True:
      with changed:
        changed.wait_for(race.any_done, timeout=race.wait_s())
      if race.any_done():
        answered, answer = race.take()
        if answered:
          return answer
      elif not race.wait_s():
        race.issue_next()
  finally:
    race.cancel()
    race.end()
