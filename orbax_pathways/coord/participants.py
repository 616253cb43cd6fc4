"""Who takes part in one CheckpointManager's rounds, and the name of its rounds. Pure: no jax,
no I/O.

Orbax's ``MultiprocessingOptions`` say which processes call a manager (``active_processes``;
None: every process of the job), which of them is its primary host (``primary_host``; None:
every process is primary and saves into a directory of its own, as Orbax's local per-process
managers do) and its barrier key prefix. Orbax's emergency ``CheckpointManager`` runs one
manager per slice (the persistent one on the primary slice, ``primary_host`` its first process;
the local one on the other slices, ``primary_host=None``), so a job holds managers that the
other slices never call.

Every round our manager hooks run through jax's key-value store (the writer lease,
``lease.before_save``; the preemption agreement, ``preemption/decision``; ``resume``'s
agreement, ``preemption/recovery``; the save liveness round, ``_compat/orbax_liveness``)
involves exactly ``members`` and never waits for another process. ``_compat/orbax_manager``
builds a ``Participants`` once per manager (``manager_participants``), on every process that
calls it.

Names: ``name`` is the same on every member (it is built from what they all pass Orbax: the
prefix, the processes, the primary host; never from the directory, which differs per process
for ``primary_host=None``) and differs between the managers of one job that differ in any of
those (the emergency manager's local and persistent managers). Two managers alike in all three
share the name; their rounds then take turns in one numbered sequence, the same on every member,
because every member calls their saves in the same order (which Orbax's own barrier keys require
too).
"""

from __future__ import annotations

import dataclasses
import hashlib


@dataclasses.dataclass(frozen=True)
class Participants:
  """The processes that call one manager (process indices as Orbax numbers them)."""

  processes: tuple[int, ...] | None  # sorted ``active_processes``; None: every process
  primary: int | None  # ``primary_host``; None: every process saves its own directory
  prefix: str = ''  # ``barrier_sync_key_prefix`` ('' when none)

  @classmethod
  def of(cls, active_processes, primary_host: int | None, prefix: str | None) -> Participants:
    """From Orbax's ``MultiprocessingOptions`` fields."""
    processes = (None if active_processes is None
                 else tuple(sorted({int(p) for p in active_processes})))
    return cls(processes, None if primary_host is None else int(primary_host), prefix or '')

  def members(self, count: int) -> tuple[int, ...]:
    """Every process that takes part, in order (``count``: the job's process count)."""
    return tuple(range(count)) if self.processes is None else self.processes

  def size(self, count: int) -> int:
    return count if self.processes is None else len(self.processes)

  def includes(self, process: int, count: int) -> bool:
    return 0 <= process < count if self.processes is None else process in self.processes

  @property
  def every_process_writes(self) -> bool:
    """``primary_host=None``: each process is the writer of its own directory."""
    return self.primary is None

  def writes(self, process: int) -> bool:
    """Whether ``process`` writes the manager's directory (takes its writer lease)."""
    return self.primary is None or process == self.primary

  def leader(self, count: int) -> int:
    """The process that answers for a round: the primary host, else the first member."""
    if self.primary is not None:
      return self.primary
    return self.members(count)[0]

  def name(self, kind: str) -> str:
    """``kind`` (``'lease'``, ``'preemption'``, ...) and a digest of the prefix, processes and
    primary host: a key-value path segment, the same on every member, of constant size."""
    processes = 'all' if self.processes is None else ','.join(map(str, self.processes))
    primary = 'each' if self.primary is None else str(self.primary)
    digest = hashlib.sha1(f'{self.prefix}|{processes}|{primary}'.encode()).hexdigest()[:16]
    return f'{kind}/{digest}'

  def describe(self, count: int) -> str:
    """For messages: which processes these are."""
    if self.processes is None:
      who = f'all {count} processes'
    else:
      shown = ', '.join(map(str, self.processes[:16]))
      who = f'processes {shown}' + (' ...' if len(self.processes) > 16 else '')
    if self.prefix:
      who += f' (barrier prefix {self.prefix!r})'
    return who
