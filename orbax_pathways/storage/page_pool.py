"""Pages of region buffers whose arrays all went, kept a few seconds for the next buffers of
this process.

Who calls what, on which host: ``storage/pages.anonymous`` (the restoring host, any thread)
asks ``take`` for a range before it maps fresh pages; a ``pages.Pages`` whose last array went
hands its range to ``give`` (from whatever thread the collector runs in); this module's own
daemon thread gives ranges idle for ``SECONDS`` back to the system. ``Ranges`` is the
bookkeeping alone (pure: addresses and lengths, no system call).

Why: a fresh anonymous mapping faults its pages in 4 KiB at a time on first touch, which costs
a restore about as much as decoding its bytes (1.1 GiB: ~0.6 s on this project's VMs). A
restore that follows another in the same process (a retry, a fall-back to an older step, the
same step onto other devices, an evaluator; on accelerators every restore, whose host buffers
go once on the devices) takes its buffers from pages the previous one already faulted in: no
fault at all. Freed ranges that touch are merged, so a restore whose regions have other sizes
than the previous one's (onto fewer devices) still finds room. At most ``MAX_BYTES`` (an eighth
of the host's memory, 8 GiB at most) are kept per process, each range for ``SECONDS`` (as
jemalloc lets freed pages decay over 10 s by default); a request no kept range fits first gives
the oldest ranges back, so that the fresh mapping gets the pages the system just got back
(recently freed memory is the cheapest to fault in again).
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
import time
from typing import Any, Callable

SECONDS = 10.0
MAX_BYTES = min(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 8, 8 << 30)


class Ranges:
  """Free address ranges, each with the time it was freed; ranges that touch are one."""

  def __init__(self):
    self.by_start: dict[int, tuple[int, float]] = {}  # start -> (length, freed at)
    self.by_end: dict[int, int] = {}  # end -> start
    self.total = 0

  def add(self, start: int, length: int, when: float) -> None:
    """Frees ``[start, start + length)``, merged with the free ranges it touches."""
    self.total += length
    before = self.by_end.pop(start, None)
    if before is not None:
      size, _ = self.by_start.pop(before)
      start, length = before, length + size
    after = self.by_start.pop(start + length, None)
    if after is not None:
      del self.by_end[start + length + after[0]]
      length += after[0]
    self.by_start[start] = (length, when)
    self.by_end[start + length] = start

  def _remove(self, start: int) -> tuple[int, float]:
    length, when = self.by_start.pop(start)
    del self.by_end[start + length]
    self.total -= length
    return length, when

  def take(self, length: int) -> int | None:
    """The start of ``length`` bytes carved from the smallest free range that holds them (the
    rest stays free), or None."""
    best = min(((size, start) for start, (size, _) in self.by_start.items() if size >= length),
               default=None)
    if best is None:
      return None
    size, start = best
    _, when = self._remove(start)
    if size > length:
      self.add(start + length, size - length, when)
    return start

  def expired(self, before: float) -> list[tuple[int, int]]:
    """Removes and returns (start, length) of every range freed before ``before``."""
    old = [s for s, (_, when) in self.by_start.items() if when < before]
    return [(s, self._remove(s)[0]) for s in old]

  def oldest(self, nbytes: int) -> list[tuple[int, int]]:
    """Removes and returns the oldest ranges, ``nbytes`` or more of them (all there are)."""
    out: list[tuple[int, int]] = []
    got = 0
    for s in sorted(self.by_start, key=lambda s: self.by_start[s][1]):
      if got >= nbytes:
        break
      length, _ = self._remove(s)
      out.append((s, length))
      got += length
    return out


_lock = threading.Lock()
_ranges = Ranges()
# Ranges handed back, waiting to be filed: ``give`` runs inside the collector, which may run
# while this thread holds _lock, so it only appends (atomic) and the next take or sweep files.
_returned: collections.deque[tuple[int, int, float]] = collections.deque()


class _State:
  """This module's process-wide state (one object: no `global` statement)."""

  sweeper: threading.Thread | None = None
  unmap: Callable[[int, int], Any] | None = None


_state = _State()


def _munmap(start: int, length: int) -> None:
  if _state.unmap is None:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.munmap.restype = ctypes.c_int
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _state.unmap = lib.munmap
  _state.unmap(start, length)


def give(start: int, length: int) -> None:
  """Hands back a page-aligned range of an anonymous private mapping that nothing uses any
  more; kept, or given back to the system, from here on."""
  _returned.append((start, length, time.monotonic()))


def _file_returned() -> list[tuple[int, int]]:
  """Files the handed-back ranges (under ``_lock``); returns those past ``MAX_BYTES``, to
  unmap."""
  over = []
  while _returned:
    start, length, when = _returned.popleft()
    if _ranges.total + length > MAX_BYTES:
      over.append((start, length))
    else:
      _ranges.add(start, length, when)
  return over


def take(length: int) -> int | None:
  """The start of ``length`` bytes (a multiple of the page size) of kept pages, or None: then,
  if the kept ranges hold that many bytes in pieces too small, the oldest of them go back to
  the system first, for the caller's fresh mapping to find."""
  _start_sweeper()
  with _lock:
    gone = _file_returned()
    start = _ranges.take(length)
    if start is None and _ranges.total >= length:
      gone += _ranges.oldest(length)
  for s, n in gone:
    _munmap(s, n)
  return start


def sweep(before: float) -> None:
  """Gives back the kept ranges freed before ``before`` (monotonic seconds)."""
  with _lock:
    gone = _file_returned() + _ranges.expired(before)
  for s, n in gone:
    _munmap(s, n)


def release() -> None:
  """Gives every kept range back now."""
  sweep(float('inf'))


def kept_bytes() -> int:
  """Bytes kept (filed ranges and those handed back since)."""
  with _lock:
    return _ranges.total + sum(n for _, n, _ in list(_returned))


def _sweeps() -> None:
  while True:
    time.sleep(SECONDS / 2)
    sweep(time.monotonic() - SECONDS)


def _start_sweeper() -> None:
  if _state.sweeper is None:
    with _lock:
      if _state.sweeper is None:
        _state.sweeper = threading.Thread(target=_sweeps, name='orbax_pathways_page_pool',
                                          daemon=True)
        _state.sweeper.start()


def _after_fork() -> None:
  _state.sweeper = None  # the child has the kept ranges but not the thread


os.register_at_fork(after_in_child=_after_fork)
