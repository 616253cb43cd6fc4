"""Waits on worker hosts whose deadline measures silence, not total time: the signs of
progress of one colocated call.

A wait that is still making progress never times out: its deadline is the time since the last
sign of progress (a worker starting, finishing its share or moving bytes), not since the wait
began. Only a whole deadline without any sign raises, naming those that gave none.

``Progress`` (``transports/colocated_calls.call_with_deadline``, on the controller): the signs
of progress of one colocated call, which its workers report as they go (where they run in the
controller's process: the CPU backend) and the controller adds as their results become ready;
the call's waiter raises once it has been silent for its deadline. Waits on other *processes*
through jax's key-value store are rounds: ``coord/rounds.py``.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable


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
