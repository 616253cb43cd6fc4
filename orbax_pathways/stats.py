"""Counters of each save and restore, owned by the call they describe and looked up by step.

The engine creates one ``SaveStats`` per save call (one per checkpoint item) when the snapshot is
taken and publishes it at once with what ``save()`` itself did; the background write sets
``write`` once when it finishes, and the CheckpointManager commit hook sets ``commit_s`` once
when the step is committed. Each field is written by exactly one phase, never updated twice.
Restores are recorded when they finish. Hosts are keyed 'p<i>' for a process, 'w<id>' for a
Pathways worker. Users read ``last_save()`` / ``saves_for_step(step)``; tests assert them.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Optional

_KEEP = 64  # recent saves and restores kept per process


@dataclasses.dataclass(frozen=True)
class WriteStats:
  """What the writers did, set once when the background write of a save finished."""

  written_bytes: dict[str, int]
  chunks_written: dict[str, int]
  write_s: float  # first write to last record on storage
  storage_requests: int  # metadata objects the save wrote besides array data (records, Orbax's)


@dataclasses.dataclass
class SaveStats:
  """One save call (one checkpoint item). ``step`` and ``step_dir`` come from the item's path."""

  transport: str = ''
  arrays: int = 0
  snapshot: str = ''  # 'pinned' or 'host' (in-process transport): how save() copied to the host
  blocking_s: float = 0.0  # time save() spent in our serialize (planning + snapshot)
  # A local-only save run in the background (multitier/local_steps.py): the time the training
  # loop's save() spent copying this process's shards to host (transports/snapshots.take),
  # the save's whole part in the loop; its serialize (blocking_s) ran on the background thread.
  # None for every other save, whose snapshot is inside blocking_s.
  loop_snapshot_s: float | None = None
  d2h_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
  controller_tensor_bytes: int = 0  # tensor bytes that passed through the controller process
  step: int | None = None
  step_dir: str = ''  # the step directory's final path (without Orbax's temporary suffix)
  write: WriteStats | None = None  # set once by the background write
  commit_s: float | None = None  # set once by the commit hook: save() called -> step committed
  # Set when the background write finished or failed (``wait_written``).
  _written: threading.Event = dataclasses.field(default_factory=threading.Event, init=False,
                                                repr=False, compare=False)

  def wait_written(self, timeout: float | None = None) -> bool:
    """Waits until this save's background write (this process's bytes, the save's host
    copies) finished or failed, not for its commit; True once it has. The next local-only
    save's snapshot waits for this (``multitier/local_steps.py``)."""
    return self._written.wait(timeout)

  def mark_written(self) -> None:
    """Called once by the background write (``engine/core.PendingSave.write``), done or
    failed."""
    self._written.set()

  @property
  def written_bytes(self) -> dict[str, int]:
    return dict(self.write.written_bytes) if self.write else {}

  @property
  def chunks_written(self) -> dict[str, int]:
    return dict(self.write.chunks_written) if self.write else {}

  @property
  def write_s(self) -> float:
    return self.write.write_s if self.write else 0.0

  @property
  def storage_requests(self) -> int:
    return self.write.storage_requests if self.write else 0

  @property
  def total_written(self) -> int:
    return sum(self.written_bytes.values())


@dataclasses.dataclass(frozen=True)
class RestoreStats:
  """One restore call (one checkpoint item), recorded when it finished."""

  transport: str = ''
  arrays: int = 0
  read_s: float = 0.0
  bytes_read: dict[str, int] = dataclasses.field(default_factory=dict)
  bytes_needed: dict[str, int] = dataclasses.field(default_factory=dict)
  chunks_verified: int = 0
  step: int | None = None
  step_dir: str = ''
  # Per source ('local': this node's tier, 'peer': other hosts' tiers, 'relay': read from storage
  # by another process that needed the same lost chunk, and passed on; 'node': a node step's
  # own directory on this node, multitier/node_steps.py; 'storage'), over every
  # reading host of this process: bytes delivered, and seconds spent reading them (summed over
  # concurrent reads, so they may add up to more than ``read_s``).
  bytes_by_source: dict[str, int] = dataclasses.field(default_factory=dict)
  seconds_by_source: dict[str, float] = dataclasses.field(default_factory=dict)

  def sources_text(self) -> str:
    """'local 12.0 MiB in 0.01 s, storage 0.0 MiB in 0.00 s' for the restore's log line."""
    order = ('local', 'node', 'peer', 'relay', 'storage')
    names = sorted(self.bytes_by_source, key=lambda n: (order.index(n) if n in order else 9, n))
    return ', '.join(f'{n} {self.bytes_by_source[n] / 2**20:.1f} MiB in '
                     f'{self.seconds_by_source.get(n, 0.0):.2f} s' for n in names) or 'storage'


def by_source(outcomes) -> dict[str, dict]:
  """``bytes_by_source`` / ``seconds_by_source`` of reading hosts' outcomes (a host that
  counted no sources read everything from storage)."""
  nbytes: dict[str, int] = {}
  seconds: dict[str, float] = {}
  for o in outcomes:
    counted = dict(o.bytes_by_source) or {'storage': o.bytes_read}
    for k, v in counted.items():
      nbytes[k] = nbytes.get(k, 0) + int(v)
    for k, v in dict(o.seconds_by_source).items():
      seconds[k] = seconds.get(k, 0.0) + float(v)
  return {'bytes_by_source': nbytes, 'seconds_by_source': seconds}


_lock = threading.Lock()
_saves: collections.deque[SaveStats] = collections.deque(maxlen=_KEEP)
_restores: collections.deque[RestoreStats] = collections.deque(maxlen=_KEEP)


def record_save(s: SaveStats) -> None:
  with _lock:
    _saves.append(s)


def record_restore(s: RestoreStats) -> None:
  with _lock:
    _restores.append(s)


def last_save() -> Optional[SaveStats]:
  """The most recent save whose snapshot ran in this process (its ``write`` and ``commit_s``
  fill in when the background commit finishes: call ``wait_until_finished()`` first)."""
  with _lock:
    return _saves[-1] if _saves else None


def last_restore() -> Optional[RestoreStats]:
  with _lock:
    return _restores[-1] if _restores else None


def _matches(s, step: int, directory: str | None) -> bool:
  if s.step != step:
    return False
  return directory is None or s.step_dir.rstrip('/').rsplit('/', 1)[0] == str(directory).rstrip('/')


def saves_for_step(step: int, directory: str | None = None) -> list[SaveStats]:
  """This process's saves of ``step`` (one per checkpoint item), oldest first; ``directory``
  (the CheckpointManager's root) narrows them to one manager."""
  with _lock:
    return [s for s in _saves if _matches(s, step, directory)]


def restores_for_step(step: int, directory: str | None = None) -> list[RestoreStats]:
  with _lock:
    return [s for s in _restores if _matches(s, step, directory)]


# Why this process's node-local tier servers (``peer/server.py``) closed connections unread.
PEER_REFUSED = ('unauthenticated', 'oversized', 'idle', 'busy')
_peer_refused: dict[str, int] = dict.fromkeys(PEER_REFUSED, 0)


def count_peer_refused(reason: str) -> None:
  """One connection closed unread by this process's tier server (``peer/server.py``, its
  thread)."""
  with _lock:
    _peer_refused[reason] = _peer_refused.get(reason, 0) + 1


def peer_server() -> dict[str, int]:
  """Connections this process's node-local tier servers (``peer/server.py``) closed unread, by
  reason: 'unauthenticated' (no or a wrong proof of the job's secret, or a request with a wrong
  MAC: something outside the job reaches the port), 'oversized' (a request above the server's
  cap), 'idle' (silent past its idle deadline), 'busy' (beyond its connections)."""
  with _lock:
    return dict(_peer_refused)
