"""This host's processes as /proc shows them: a host id that also names the PID namespace, a
process's start time, and whether a process that started then still runs.

Who calls it: ``manager/retention.py`` (who owns a step being deleted) and ``manager/lease.py``
(who holds a directory's writer lease), on the process that asks. Linux /proc; elsewhere the
answers degrade to "unknown" (start 0, alive).
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return ''


@functools.lru_cache(maxsize=1)
def host_id() -> str:
  """8 hex digits naming this host *and* PID namespace: two containers with the same host name
  see different PIDs, so a PID is only meaningful next to its namespace."""
  try:
    pidns = os.readlink('/proc/self/ns/pid')
  except OSError:
    pidns = ''
  key = f'{socket.gethostname()}|{_read("/proc/sys/kernel/random/boot_id")}|{pidns}'
  return hashlib.sha1(key.encode()).hexdigest()[:8]


def _proc_stat(pid: int) -> tuple[str, int] | None:
  """(state, start time in clock ticks since boot) of ``pid`` from /proc, None if unknown."""
  text = _read(f'/proc/{pid}/stat')
  if not text or ')' not in text:
    return None
  fields = text.rsplit(')', 1)[1].split()
  try:
    return fields[0], int(fields[19])
  except (IndexError, ValueError):
    return None


def process_start(pid: int) -> int:
  """Start time of ``pid`` on this host (clock ticks since boot; 0: unknown)."""
  stat = _proc_stat(pid)
  return stat[1] if stat else 0


def process_alive(pid: int, start: int) -> bool:
  """Whether process ``pid`` of this host (and PID namespace) that started at ``start`` (clock
  ticks; 0: unknown) still runs."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # exists, owned by someone else
  except OSError:
    return True  # cannot tell: assume alive
  stat = _proc_stat(pid)
  if stat is None:
    return True
  state, started = stat
  if state in ('Z', 'X'):
    return False
  return not (start and started and started != start)  # a different process got the PID
