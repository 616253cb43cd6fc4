"""The writer lease's content and the decision "may this job take it?". Pure: no I/O, no clock.

``orbax_pathways.manager.lease`` (on the lease-writing host of a saving job: its primary process) reads
the lease object, gathers the facts it can check (is the owner's process alive, when did the
object last change), and asks ``decide``; it then does the storage write the decision asks for.
The content is JSON (``Owner.encode``), readable by hand and by any version.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

SCHEMA = 1

TAKE = 'take'  # no lease: create it
KEEP = 'keep'  # it is ours: renew it
TAKEOVER = 'takeover'  # its owner is gone: replace it, with a warning
WAIT = 'wait'  # held by an owner we cannot check yet: watch it
REFUSE = 'refuse'  # a live writer holds it: refuse the save


@dataclasses.dataclass(frozen=True)
class Owner:
  """Who holds a lease: one job (its lease-writing process), from ``started`` on."""

  token: str  # random, one per process and directory: tells our lease from another's
  host: str  # host name
  host_id: str  # host + boot + PID namespace (``processes.host_id``): where ``pid`` means something
  pid: int
  pid_start: int  # the process's start time (clock ticks since boot; 0: unknown)
  job: str  # the scheduler's job name or id, '' when none is known
  processes: int  # JAX processes in the job (the job is one owner)
  started: float  # Unix seconds when it took the lease
  renewed: float  # Unix seconds of its last renewal
  timeout_s: float  # its staleness timeout
  library_version: str = ''

  def encode(self) -> bytes:
    return json.dumps({'schema': SCHEMA, 'kind': 'orbax-pathways-writer-lease',
                       **dataclasses.asdict(self)}, indent=1, sort_keys=True).encode()

  @classmethod
  def decode(cls, data: bytes) -> Owner | None:
    """The owner recorded in ``data``; None if it is not a lease we can read (then the caller
    treats it as held by an unknown owner)."""
    try:
      raw: Any = json.loads(data.decode())
      fields = {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw}
      owner = cls(**fields)
      float(owner.renewed), float(owner.started), int(owner.pid)  # pylint: disable=expression-not-assigned
      return owner
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
      return None

  def renewed_at(self, now: float) -> Owner:
    return dataclasses.replace(self, renewed=now)

  def describe(self, *, holder: bool = True) -> str:
    """One line naming the owner, for errors and warnings (``holder``: with its lease times)."""
    job = f'job {self.job!r}' if self.job else 'a job'
    procs = f', {self.processes} processes' if self.processes > 1 else ''
    times = (f'; lease taken {_when(self.started)}, last renewed {_when(self.renewed)}'
             if holder else '')
    return f'{job} on host {self.host} (pid {self.pid}{procs}{times})'


def _when(t: float) -> str:
  return time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(t))


@dataclasses.dataclass(frozen=True)
class Decision:
  action: str  # TAKE, KEEP, TAKEOVER, WAIT or REFUSE
  reason: str


def decide(held: Owner | None, *, present: bool, my_token: str, my_host_id: str, now: float,
           timeout_s: float, owner_alive: bool | None, unchanged_for_s: float | None,
           changed_while_watched: bool) -> Decision:
  """What the job with ``my_token`` may do with the lease object found in storage.

  Args:
    held: the owner read from the object (None: no object, or one we cannot decode).
    present: whether the object exists.
    my_token: this job's token.
    my_host_id: this host's id (``processes.host_id``).
    now: Unix seconds now (this host's clock).
    timeout_s: renewal age after which the owner counts as gone.
    owner_alive: on the owner's host, whether its process still runs (None: another host).
    unchanged_for_s: for how long (this host's monotonic clock) the object was seen unchanged,
      None if not watched yet; robust to clock skew between hosts.
    changed_while_watched: the object changed (a renewal) while we watched it: a live owner.
  """
  if not present:
    return Decision(TAKE, 'no lease')
  if held is not None and held.token == my_token:
    return Decision(KEEP, 'ours')
  if held is None:
    # Unreadable: a torn or foreign object. Treated like an owner on another host.
    if unchanged_for_s is not None and unchanged_for_s > timeout_s:
      return Decision(TAKEOVER, f'unreadable and unchanged for {unchanged_for_s:.0f} s')
    if changed_while_watched:
      return Decision(REFUSE, 'an unreadable lease that keeps changing')
    return Decision(WAIT, 'unreadable lease')
  if held.host_id == my_host_id and owner_alive is False:
    return Decision(TAKEOVER, f'its owner, process {held.pid} on this host, is gone')
  age = now - held.renewed
  if age > timeout_s:
    return Decision(TAKEOVER, f'not renewed for {age:.0f} s (timeout {timeout_s:g} s)')
  if unchanged_for_s is not None and unchanged_for_s > timeout_s:
    return Decision(TAKEOVER, f'not renewed for {unchanged_for_s:.0f} s as seen from this '
                    f'host (timeout {timeout_s:g} s)')
  if changed_while_watched:
    return Decision(REFUSE, 'its owner renewed it while this job waited')
  if held.host_id == my_host_id and owner_alive:
    return Decision(REFUSE, f'its owner, process {held.pid} on this host, is running and '
                    f'renewed it {max(age, 0):.0f} s ago')
  return Decision(WAIT, f'renewed {max(age, 0):.0f} s ago by another host')
