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


async def run(attempt: Callable[[int], Awaitable[Any]], *, nbytes: int, what: str, kind: str,
              policy: deadline_lib.Policy | None = None) -> Any:
  """The first answer of ``attempt(0)``, ``attempt(1)``, ...: each later attempt is issued when
  all earlier ones passed their deadline. Cancels the others before returning. However it ends
  (an answer, an error, cancelled, or closed with its event loop), every attempt's ticket is
  ended: a request left counted in flight would add its bytes to every later deadline of the
  process (``storage/deadline.py``)."""
  policy = policy or deadline_lib.POLICY
  t0 = time.monotonic()
  tasks: dict[asyncio.Future, deadline_lib.Ticket] = {}
  ended: set[asyncio.Future] = set()
  first_error: BaseException | None = None

  def end(t: asyncio.Future, ok: bool) -> None:
    if t not in ended:
      ended.add(t)
      policy.end(tasks[t], time.monotonic(), ok=ok)

  def end_all() -> None:
    for t in tasks:
      end(t, ok=t.done() and not t.cancelled() and t.exception() is None)

  def issue(n: int) -> float:
    ticket = policy.begin(nbytes, time.monotonic())
    try:
      task = asyncio.ensure_future(attempt(n))
    except BaseException:
      policy.end(ticket, time.monotonic(), ok=False)
      raise
    tasks[task] = ticket
    return ticket.deadline_s

  async def settle() -> None:
    pending = [p for p in tasks if not p.done()]
    for p in pending:
      p.cancel()
    try:
      if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
      end_all()

  try:
    wait_s = issue(0)
    n = 1
    while True:
      pending = {t for t in tasks if not t.done()}
      if not pending:  # every attempt failed
        assert first_error is not None
        raise first_error
      done, _ = await asyncio.wait(pending, timeout=wait_s,
                                   return_when=asyncio.FIRST_COMPLETED)
      for t in done:
        if t.exception() is None:
          end(t, ok=True)
          if tasks[t] is not next(iter(tasks.values())):
            _count(f'{kind}_won_by_retry')
          await settle()
          return t.result()
        end(t, ok=False)
        first_error = first_error or t.exception()
      if done:
        continue  # an attempt failed: keep waiting for the others (or raise if none is left)
      if n >= MAX_ATTEMPTS:
        await settle()
        raise _error(what, kind, time.monotonic() - t0, n)
      _say_hedged(kind, what, time.monotonic() - t0, n)
      wait_s = issue(n)
      n += 1
  except GeneratorExit:
    # This coroutine is being closed, not cancelled: its event loop ended under it (an event
    # loop closed while this read was in flight). Nothing may be awaited now, and cancelling
    # schedules callbacks, which a closed loop refuses.
    for p in tasks:
      if not p.done():
        try:
          p.cancel()
        except RuntimeError:  # 'Event loop is closed'
          pass
    raise
  except BaseException:
    await settle()
    raise
  finally:
    end_all()


def run_sync(attempt: Callable[[int], ts.Future], *, nbytes: int, what: str, kind: str,
             policy: deadline_lib.Policy | None = None) -> Any:
  """``run`` for a thread without an event loop: ``attempt(n)`` returns a tensorstore future."""
  policy = policy or deadline_lib.POLICY
  t0 = time.monotonic()
  changed = threading.Condition()
  futures: list[tuple[ts.Future, deadline_lib.Ticket]] = []
  ended: set[int] = set()

  def issue(n: int) -> float:
    ticket = policy.begin(nbytes, time.monotonic())
    f = attempt(n)
    futures.append((f, ticket))

    def notify(_):
      with changed:
        changed.notify_all()

    f.add_done_callback(notify)
    return ticket.deadline_s

  def settle() -> None:
    now = time.monotonic()
    for i, (f, ticket) in enumerate(futures):
      if i not in ended:
        f.cancel()
        policy.end(ticket, now, ok=False)
        ended.add(i)

  first_error: BaseException | None = None
  try:
    wait_until = time.monotonic() + issue(0)
    n = 1
    while True:
      with changed:
        changed.wait_for(lambda: any(f.done() for i, (f, _) in enumerate(futures)
                                     if i not in ended),
                         timeout=max(wait_until - time.monotonic(), 0))
      progressed = False
      for i, (f, ticket) in enumerate(futures):
        if i in ended or not f.done():
          continue
        ended.add(i)
        progressed = True
        error = f.exception()
        policy.end(ticket, time.monotonic(), ok=error is None)
        if error is None:
          if i:
            _count(f'{kind}_won_by_retry')
          settle()
          return f.result()
        first_error = first_error or error
      if progressed:
        if len(ended) == len(futures):
          assert first_error is not None
          raise first_error
        continue
      if time.monotonic() < wait_until:
        continue
      if n >= MAX_ATTEMPTS:
        raise _error(what, kind, time.monotonic() - t0, n)
      _say_hedged(kind, what, time.monotonic() - t0, n)
      wait_until = time.monotonic() + issue(n)
      n += 1
  finally:
    settle()
