"""A lower CPU priority for one background thread (Linux: a thread's nice value is its own, and
threads it starts inherit it).

Who calls it: the tier's copy thread (``tier/store.submit``'s initializer), on itself, first
thing: the copy into node memory then takes the cores the training loop leaves idle rather than
sharing them with it. (A background local-only save at this priority was measured and not kept:
on 2026-12-04, a 2-core VM, ``benchmarks/local_steps.py --train-only`` with a local-only save
every 1 s step, two alternating runs each gave no lower overhead, 0.38 and 0.35 s against 0.53
and 0.20 s at normal priority, and longer ``save()`` waits for the previous save, max 1.24 and
0.92 s against 0.61 and 0.35 s.)
"""

from __future__ import annotations

import os
import threading

BACKGROUND_NICE = 10  # CFS weight 110 against the loop's 1024 at nice 0


def lower_this_thread(nice: int = BACKGROUND_NICE) -> None:
  """Sets the calling thread's nice value. Best effort: elsewhere it keeps its priority."""
  try:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
  except (AttributeError, OSError):
    pass
