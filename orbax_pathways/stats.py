"""Counters of one save or restore, exposed to users and asserted by tests.

Filled by the handler on the controller (bytes the controller itself moved) and by each writer or
reader host (bytes it moved), keyed by host: 'p<i>' for a process, 'w<id>' for a Pathways worker.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Optional


@dataclasses.dataclass
class SaveStats:
  transport: str = ''
  arrays: int = 0
  snapshot: str = ''  # 'pinned' or 'host' (local transport): how save() copied to the host
  blocking_s: float = 0.0  # time save() spent in our serialize (planning + device-to-host)
  write_s: float = 0.0  # background: first write to last checksum
  commit_s: float = 0.0  # CheckpointManager.save() called -> step committed (manager saves)
  d2h_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
  written_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
  chunks_written: dict[str, int] = dataclasses.field(default_factory=dict)
  controller_tensor_bytes: int = 0  # tensor bytes that passed through the controller process
  storage_requests: int = 0  # metadata objects we wrote (our record + array metadatas)

  @property
  def total_written(self) -> int:
    return sum(self.written_bytes.values())


@dataclasses.dataclass
class RestoreStats:
  transport: str = ''
  arrays: int = 0
  read_s: float = 0.0
  bytes_read: dict[str, int] = dataclasses.field(default_factory=dict)
  bytes_needed: dict[str, int] = dataclasses.field(default_factory=dict)
  chunks_verified: int = 0


_lock = threading.Lock()
_last_save: Optional[SaveStats] = None
_last_restore: Optional[RestoreStats] = None


def record_save(s: SaveStats) -> None:
  global _last_save
  with _lock:
    _last_save = s


def record_restore(s: RestoreStats) -> None:
  global _last_restore
  with _lock:
    _last_restore = s


def last_save() -> Optional[SaveStats]:
  """Stats of the most recent save whose serialize ran in this process (background fields fill
  in when its commit finishes: call ``CheckpointManager.wait_until_finished()`` first)."""
  return _last_save


def last_restore() -> Optional[RestoreStats]:
  return _last_restore
