"""How long one storage request may take before we stop waiting for it: the pure policy.

No I/O, no clock of its own (callers pass ``time.monotonic()`` readings), no jax. The I/O side
(``storage/hedge.py``) asks ``Policy.begin(nbytes, now)`` for a deadline when it issues a request
and reports ``Policy.end(ticket, now, ok)`` when the request answers.

The deadline follows what this process observes:

- ``latency``: a high quantile (p90) of how long small requests (<= ``SMALL_BYTES``) took;
- ``throughput``: bytes answered per second of wall time during which requests were in flight
  (the aggregate rate storage gives this process, however many requests share it);
- a request issued while ``queued`` bytes are already in flight waits behind them (tensorstore
  bounds its concurrency per driver), so its expected time is
  ``latency + (queued + nbytes) / throughput``.

The deadline is ``FACTOR`` times that, clamped to ``[floor_s, cap_s]`` (both options:
``Options.request_deadline_floor_s`` / ``request_deadline_cap_s``). Before anything was observed
it assumes ``DEFAULT_LATENCY_S`` and ``DEFAULT_THROUGHPUT``, conservative for cloud storage.

One ``Policy`` per process (``POLICY``), shared by every reader and writer thread: what storage
answers is the process's observation, whoever asked (the lock is the only state shared across
threads). The floor and cap are the handler's: ``engine.Engine`` and the front doors run each
save and restore inside ``bounded(Bounds(...))`` (a context variable, so it follows the call's
tasks and ``asyncio.to_thread`` calls, and two handlers with other options never mix); outside
any, the policy's own (the defaults).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import threading
from typing import Any, Callable, Iterator

MiB = 1 << 20
SMALL_BYTES = 1 * MiB
FACTOR = 4.0
DEFAULT_LATENCY_S = 2.0
DEFAULT_THROUGHPUT = 16 * MiB  # bytes/s before any answer was observed
DEFAULT_FLOOR_S = 10.0
DEFAULT_CAP_S = 120.0
SAMPLES = 256  # latency samples kept
MIN_OBSERVED_BYTES = 4 * MiB  # below this much answered, keep the default throughput


@dataclasses.dataclass(frozen=True)
class Bounds:
  """The floor and cap of every deadline (``Options.request_deadline_floor_s`` / ``_cap_s``)."""
  floor_s: float = DEFAULT_FLOOR_S
  cap_s: float = DEFAULT_CAP_S

  def __post_init__(self):
    if not 0 < self.floor_s <= self.cap_s:
      raise ValueError(f'request deadline floor {self.floor_s!r} s and cap {self.cap_s!r} s: need '
                       '0 < floor <= cap.')


_bounds: contextvars.ContextVar[Bounds | None] = contextvars.ContextVar(
    'orbax_pathways_deadline_bounds', default=None)


@contextlib.contextmanager
def bounded(bounds: Bounds) -> Iterator[None]:
  """Deadlines of requests issued inside (this task, the tasks and threads it starts) use
  ``bounds``."""
  token = _bounds.set(bounds)
  try:
    yield
  finally:
    _bounds.reset(token)


def with_bounds(fn: Callable[..., Any]) -> Callable[..., Any]:
  """An ``async`` method of an object with a ``bounds`` attribute, run inside ``bounded``."""
  @functools.wraps(fn)
  async def run(self, *args, **kwargs):
    with bounded(self.bounds):
      return await fn(self, *args, **kwargs)
  return run


@dataclasses.dataclass(frozen=True)
class Ticket:
  """One request in flight: what it carries, when it started, its deadline (seconds)."""
  nbytes: int
  start: float
  deadline_s: float


class Policy:
  """Observed latency and throughput -> the deadline of the next request (thread-safe)."""

  def __init__(self, floor_s: float = DEFAULT_FLOOR_S, cap_s: float = DEFAULT_CAP_S):
    self._lock = threading.Lock()
    self.floor_s = floor_s
    self.cap_s = cap_s
    self.configure(floor_s, cap_s)
    self._latencies: collections.deque[float] = collections.deque(maxlen=SAMPLES)
    self._inflight_bytes = 0
    self._inflight = 0
    self._busy_since: float | None = None
    self._busy_s = 0.0
    self._answered_bytes = 0

  def configure(self, floor_s: float, cap_s: float) -> None:
    """This policy's own floor and cap (used outside any ``bounded``)."""
    b = Bounds(float(floor_s), float(cap_s))
    with self._lock:
      self.floor_s, self.cap_s = b.floor_s, b.cap_s

  # -- estimates ---------------------------------------------------------------------------------
  def latency_s(self) -> float:
    with self._lock:
      return self._latency_locked()

  def _latency_locked(self) -> float:
    if not self._latencies:
      return DEFAULT_LATENCY_S
    ordered = sorted(self._latencies)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]

  def _throughput_locked(self, now: float) -> float:
    busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
    if self._answered_bytes < MIN_OBSERVED_BYTES or busy <= 0:
      return DEFAULT_THROUGHPUT
    return max(self._answered_bytes / busy, 1.0)

  def throughput(self, now: float) -> float:
    with self._lock:
      return self._throughput_locked(now)

  def deadline_s(self, nbytes: int, now: float, queued_bytes: int = 0) -> float:
    """The deadline of a request of ``nbytes`` issued at ``now`` behind ``queued_bytes``."""
    with self._lock:
      return self._deadline_locked(nbytes, now, queued_bytes)

  def _deadline_locked(self, nbytes: int, now: float, queued_bytes: int) -> float:
    expected = (self._latency_locked()
                + (queued_bytes + max(nbytes, 0)) / self._throughput_locked(now))
    b = _bounds.get()
    floor, cap = (b.floor_s, b.cap_s) if b is not None else (self.floor_s, self.cap_s)
    return min(cap, max(floor, FACTOR * expected))

  def in_flight(self) -> tuple[int, int]:
    """(requests, bytes) begun and not yet ended: what a new request would queue behind."""
    with self._lock:
      return self._inflight, self._inflight_bytes

  # -- requests ----------------------------------------------------------------------------------
  def begin(self, nbytes: int, now: float) -> Ticket:
    """A request of ``nbytes`` is issued at ``now``: its ticket, with its deadline."""
    with self._lock:
      d = self._deadline_locked(nbytes, now, self._inflight_bytes)
      if self._inflight == 0:
        self._busy_since = now
      self._inflight += 1
      self._inflight_bytes += max(nbytes, 0)
      return Ticket(max(nbytes, 0), now, d)

  def end(self, ticket: Ticket, now: float, ok: bool) -> None:
    """The request of ``ticket`` answered (``ok``) or was given up at ``now``."""
    with self._lock:
      self._inflight = max(self._inflight - 1, 0)
      self._inflight_bytes = max(self._inflight_bytes - ticket.nbytes, 0)
      if ok:
        self._answered_bytes += ticket.nbytes
        if ticket.nbytes <= SMALL_BYTES:
          self._latencies.append(max(now - ticket.start, 0.0))
      if self._inflight == 0 and self._busy_since is not None:
        self._busy_s += max(now - self._busy_since, 0.0)
        self._busy_since = None


POLICY = Policy()
