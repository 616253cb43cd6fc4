"""The writer lease: one saving job per checkpoint directory.

Why: two jobs saving into one directory (two trainers with the same output path, or a job
restarted while its previous incarnation still runs) overwrite each other's steps; stock Orbax
reports at most one error, then both "succeed" and the kept steps hold whichever job wrote
last. The lease object ``<directory>/orbax-pathways-lease.json`` names the job that saves there
(``plan/lease.Owner``: host, pid, job, process count, start and renewal times); a second live
writer is refused with ``errors.WriterLeaseError`` naming both jobs, and a lease whose owner is
gone is taken over with one warning.

Who calls what, on which host:

- ``before_save`` (``LeaseHooks.before_save``, at the start of every
  ``CheckpointManager.save`` that Orbax's policy takes, on every process that calls the
  manager; a declined step writes nothing and costs no round): the manager's
  lease-writing process (its primary host) takes the lease at the job's first save into the
  directory, and at each later save checks that it still holds it (renewing it when due). Under
  multi-controller JAX the other processes *that call this manager* (its ``active_processes``,
  ``coord/participants.py``; never a process that does not, such as the other slices of Orbax's
  emergency manager) take the writer's answer through the coordination service's key-value
  store, so they all raise together (no process left waiting in Orbax's barriers) and the job
  is one owner. A manager with ``primary_host=None`` (every process saves a directory of its
  own: Orbax's local per-process managers) has every process take the lease of its own
  directory; the first of its processes gathers their answers and publishes one verdict. The
  round's keys are named by the manager's processes, primary host and barrier prefix, never by
  its directory (which then differs per process), so the managers of one job never read each
  other's answers. Only saving takes the lease: a manager that only lists and restores (an
  evaluator, ``preemption.resume``) never reads or writes it.
- A background thread of the lease-writing process renews the lease every ``timeout / 3``
  seconds while it is held (so also while an async commit runs, and between saves).
- ``after_close`` (the ``after_close`` manager hook): the last manager of this process on that
  directory releases the lease (a conditional delete); leases still held at interpreter exit are
  released too. A process killed outright leaves its lease: it is then stale.

Taking the lease (``Lease.acquire``; the decision itself is ``plan/lease.decide``, pure):
absent -> create it; held by a process of this host that is gone (pid dead or reused), or not
renewed for ``timeout`` seconds (``ORBAX_PATHWAYS_LEASE_TIMEOUT_S``, default 30) -> take it over
and warn once; held by a live process of this host -> refuse at once; held by another host and
renewed recently -> watch it (up to ``timeout``): a renewal seen means a live writer (refuse),
none means its owner is gone (take over). Every write is conditional on the storage generation
read just before (tensorstore's ``if_equal``: the file driver's lock, GCS ``ifGenerationMatch``),
so two jobs racing to take the lease cannot both win; each then reads it back to be sure.
``ORBAX_PATHWAYS_LEASE=0`` turns all of this off. ``retention.install`` (at ``import
orbax_pathways``) installs the hooks.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import threading
import time
import uuid
from typing import Any, ClassVar

from absl import logging
import tensorstore as ts

from orbax_pathways import errors
from orbax_pathways import options as options_lib
from orbax_pathways.manager import hooks as hooks_lib
from orbax_pathways.manager import processes as proc_lib
from orbax_pathways import version
from orbax_pathways.coord import rounds
from orbax_pathways._compat import jax_distributed
from orbax_pathways._compat import orbax_manager as _om
from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways.manager import lease_policy as plan
from orbax_pathways.storage import meta_io
from orbax_pathways.format import urls

LEASE_FILE = 'orbax-pathways-lease.json'
ENABLE_ENV = 'ORBAX_PATHWAYS_LEASE'
TIMEOUT_ENV = 'ORBAX_PATHWAYS_LEASE_TIMEOUT_S'
# tensorstore's storage generation of a missing key: a write conditional on it creates only.
_ABSENT = b'\x02'
# Scheduler variables that name the job, first found wins (recorded in the lease for humans).
_JOB_VARS = ('JOBSET_NAME', 'SLURM_JOB_ID', 'JOB_NAME')
_AGREE_KEEP = 16  # key-value entries of past saves kept per directory (multi-controller)

_lock = threading.RLock()
_leases: dict[str, Lease] = {}  # directory -> the lease this process holds there


def directory_key(directory) -> str:
  """The directory as one string (absolute for local paths) that names its lease."""
  d = os.fspath(directory).rstrip('/')
  return d if urls.is_url(d) else os.path.abspath(d)


def lease_path(directory) -> str:
  return f'{directory_key(directory)}/{LEASE_FILE}'


def timeout_s() -> float:
  return (_current.timeout if _current.timeout is not None
          else float(options_lib.env_value(TIMEOUT_ENV)))


def _job_name() -> str:
  for name in _JOB_VARS:
    value = os.environ.get(name, '').strip()
    if value:
      return value[:200]
  return ''


# ---------------------------------------------------------------------------------------------
# Storage: one object, conditional writes.


class _Store:
  """The lease object of one directory, through tensorstore's kvstore (file, gcs, s3)."""

  def __init__(self, directory: str):
    self._kv = ts.KvStore.open(meta_io.kvstore_spec(directory),
                               context=meta_io.context()).result()

  def read(self) -> tuple[bool, bytes, bytes]:
    """(present, content, storage generation)."""
    r = self._kv.read(LEASE_FILE).result()
    return r.state == 'value', bytes(r.value), bytes(r.stamp.generation)

  def write_if(self, data: bytes | None, generation: bytes,
               timeout_s: float | None = None) -> bytes | None:
    """Writes (None: deletes) only if the object's generation is still ``generation``
    (``_ABSENT``: only if there is none). The new generation, or None if the condition failed.
    ``timeout_s``: raise ``TimeoutError`` past it (the request may still complete)."""
    g = bytes(self._kv.write(LEASE_FILE, data, if_equal=generation).result(
        timeout=timeout_s).generation)
    return g or None


# ---------------------------------------------------------------------------------------------
# One held lease.


class Lease:
  """This process's lease on one directory (its job's, under multi-controller JAX)."""

  def __init__(self, directory: str, *, timeout: float, processes: int):
    self.directory = directory
    self.path = f'{directory}/{LEASE_FILE}'
    self.timeout_s = timeout
    self._store = _Store(directory)
    now = time.time()
    pid = os.getpid()
    self.me = plan.Owner(
        token=uuid.uuid4().hex, host=socket.gethostname(), host_id=proc_lib.host_id(), pid=pid,
        pid_start=proc_lib.process_start(pid), job=_job_name(), processes=processes,
        started=now, renewed=now, timeout_s=timeout, library_version=version.VERSION)
    self.holders: set[int] = set()  # id() of the managers of this process that saved here
    self._generation: bytes | None = None
    self._renewed_mono = 0.0
    self._lost: str | None = None
    self._io_lock = threading.Lock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  # -- taking it

  def acquire(self) -> None:
    """Takes the lease or raises ``WriterLeaseError``; may watch a lease of another host for up
    to ``timeout`` seconds first. Called on the lease-writing process at the job's first save."""
    watched_since: float | None = None
    seen: bytes | None = None
    changed = False
    poll = min(1.0, max(self.timeout_s / 10, 0.05))
    give_up = time.monotonic() + 3 * self.timeout_s + 60  # a lease changing all the time
    while True:
      present, data, generation = self._store.read()
      held = plan.Owner.decode(data) if present else None
      mono = time.monotonic()
      if watched_since is None or (seen != generation and present):
        if watched_since is not None:
          changed = True
        watched_since, seen = mono, generation
      alive = None
      if held is not None and held.host_id == self.me.host_id:
        alive = proc_lib.process_alive(held.pid, held.pid_start)
      decision = plan.decide(
          held, present=present, my_token=self.me.token, my_host_id=self.me.host_id,
          now=time.time(), timeout_s=self.timeout_s, owner_alive=alive,
          unchanged_for_s=mono - watched_since if mono > watched_since else None,
          changed_while_watched=changed)
      if decision.action == plan.REFUSE or (decision.action == plan.WAIT and mono > give_up):
        raise errors.WriterLeaseError(self._refusal(held, decision.reason))
      if decision.action == plan.WAIT:
        time.sleep(poll)
        continue
      fresh = self.me.renewed_at(time.time())
      if decision.action == plan.KEEP:
        condition = generation
      elif decision.action == plan.TAKE:
        condition = _ABSENT
      else:  # TAKEOVER
        condition = generation
      new = self._store.write_if(fresh.encode(), condition)
      if new is None or not self._reads_back_ours(fresh):
        time.sleep(poll / 10)
        continue  # another job won the race: look again
      self.me, self._generation = fresh, new
      self._renewed_mono = time.monotonic()
      if decision.action == plan.TAKEOVER:
        who = held.describe() if held is not None else 'an unreadable lease'
        logging.warning(
            'orbax_pathways: took over the writer lease %s from %s: %s. Its owner counts as gone; '
            'if it is in fact still saving into %s, it will be refused at its next save.',
            self.path, who, decision.reason, self.directory)
      else:
        logging.info('orbax_pathways: took the writer lease %s.', self.path)
      self._start_renewer()
      return

  def _reads_back_ours(self, fresh: plan.Owner) -> bool:
    """A store that ignores write conditions (some emulators) lets two racers both "win"; the
    content read back tells who did."""
    present, data, _ = self._store.read()
    held = plan.Owner.decode(data) if present else None
    return held is not None and held.token == fresh.token

  def _refusal(self, held: plan.Owner | None, reason: str) -> str:
    who = held.describe() if held is not None else 'an owner whose lease cannot be read'
    return (
        f'orbax_pathways: refusing to save into {self.directory}: another job is saving into it. '
        f'The writer lease {self.path} is held by {who}; this job is {self.me.describe(holder=False)}. '
        f'({reason}.) Two jobs saving into one directory overwrite each other\'s steps. Stop '
        'the other job (or let it finish and close its CheckpointManager), or save into another '
        'directory. If the other job is gone, its lease is taken over automatically once not '
        f'renewed for {self.timeout_s:g} s ({TIMEOUT_ENV}); deleting {self.path} by hand takes '
        'it over at once.')

  # -- keeping it

  def _start_renewer(self) -> None:
    self._stop.clear()
    self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                    name=f'orbax_pathways-lease-{self.directory}')
    self._thread.start()

  def _renew_loop(self) -> None:
    while not self._stop.wait(self.timeout_s / 3):
      if self._lost is not None:
        return
      self.renew()

  def renew(self) -> None:
    """Renews the lease if it is still ours; otherwise remembers who took it (``check`` raises).
    A storage error is logged and retried at the next renewal."""
    with self._io_lock:
      if self._lost is not None or self._generation is None:
        return
      fresh = self.me.renewed_at(time.time())
      try:
        new = self._store.write_if(fresh.encode(), self._generation)
        if new is not None:
          self.me, self._generation = fresh, new
          self._renewed_mono = time.monotonic()
          return
        present, data, generation = self._store.read()
      except Exception as e:  # pylint: disable=broad-except
        logging.warning('orbax_pathways: renewing the writer lease %s failed (%s: %s); retrying '
                        'in %.0f s.', self.path, type(e).__name__, e, self.timeout_s / 3)
        return
      held = plan.Owner.decode(data) if present else None
      if held is not None and held.token == self.me.token:
        self._generation = generation  # our write went through after all
        return
      if not present:
        # Deleted while held: by hand (the documented way to hand the directory to another job
        # at once), or with the directory itself (a wiped node-local directory). Either way
        # another job may take it now, so this job stops saving here.
        self._lost = (
            f'orbax_pathways: refusing to save into {self.directory}: this job '
            f'({self.me.describe()}) no longer holds its writer lease {self.path}: the lease was '
            'deleted while this job held it (by hand, or with the directory), which lets '
            'another job take the directory. To resume saving here, close this '
            'CheckpointManager and construct a new one (it takes the lease again unless another '
            'job holds it by then).')
        logging.warning('%s', self._lost)
        return
      who = held.describe() if held is not None else 'an unreadable lease'
      self._lost = (
          f'orbax_pathways: refusing to save into {self.directory}: this job '
          f'({self.me.describe()}) no longer holds its writer lease {self.path}: it is now held '
          f'by {who}. Another job took it over because this job did not renew it for '
          f'{self.timeout_s:g} s ({TIMEOUT_ENV}; a stalled process or storage outage), and may '
          'be saving into the same directory. Stop one of the two jobs; to resume saving here, '
          'construct a new CheckpointManager once the other job is gone.')
      logging.error('%s', self._lost)

  def check(self) -> None:
    """At each save on the lease-writing process: raises ``WriterLeaseError`` if the lease was
    taken over; renews it first only when the background renewer (every third of the timeout)
    is overdue by another third: a healthy renewer keeps storage requests out of ``save()``."""
    if self._lost is None and time.monotonic() - self._renewed_mono > 2 * self.timeout_s / 3:
      self.renew()
    if self._lost is not None:
      raise errors.WriterLeaseError(self._lost)

  # -- giving it back

  def release(self, timeout_s: float | None = None) -> None:
    """Stops renewing and deletes the lease if it is still ours (conditional delete).
    ``timeout_s`` (at exit): give up after that long (a storage request that does not answer, a
    renewal stuck in one) with a warning; the lease then goes stale after its timeout."""
    self._stop.set()
    thread = self._thread
    if thread is not None and thread is not threading.current_thread():
      thread.join(timeout=10 if timeout_s is None else min(10.0, timeout_s))
    if not self._io_lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
      logging.warning('orbax_pathways: the writer lease %s is not released: its renewal is stuck '
                      'in storage; the next job takes it over once it is stale (%g s).',
                      self.path, self.timeout_s)
      return
    try:
      if self._lost is not None or self._generation is None:
        return
      generation, self._generation = self._generation, None
      try:
        if self._store.write_if(None, generation, timeout_s=timeout_s) is None:
          if not self._store.read()[0]:
            logging.info('orbax_pathways: the writer lease %s was already deleted (by hand, or '
                         'with its directory).', self.path)
          else:
            logging.warning('orbax_pathways: the writer lease %s changed under this job; left '
                            'it in place.', self.path)
        else:
          logging.info('orbax_pathways: released the writer lease %s.', self.path)
      except Exception as e:  # pylint: disable=broad-except  (TimeoutError at exit, storage errors)
        logging.warning('orbax_pathways: releasing the writer lease %s failed (%s: %s); the next '
                        'job takes it over once it is stale (%g s).', self.path,
                        type(e).__name__, e, self.timeout_s)
    finally:
      self._io_lock.release()


# ---------------------------------------------------------------------------------------------
# The CheckpointManager hooks.


def _hold(directory: str, mngr) -> None:
  with _lock:
    lease = _leases.get(directory)
    if lease is None:
      lease = Lease(directory, timeout=timeout_s(), processes=jax_distributed.process_count())
      lease.acquire()
      _leases[directory] = lease
    lease.holders.add(id(mngr))
  lease.check()


def before_save(mngr, step: int) -> None:
  """``LeaseHooks.before_save``: see the module docstring. Raises ``WriterLeaseError`` on every process
  that calls ``mngr`` when the lease is held by another live job or was taken over from this
  one; never waits for a process that does not call ``mngr``."""
  if not options_lib.env_value(ENABLE_ENV):
    return
  directory = directory_key(mngr.directory)
  part = _oms.manager_participants(mngr)
  me, count = _oms.process_index(), jax_distributed.process_count()
  error: Exception | None = None
  if part.writes(me):
    try:
      _hold(directory, mngr)
    except errors.WriterLeaseError as e:
      error = e
      if part.every_process_writes:
        error = errors.WriterLeaseError(
            f'{e} (This manager has primary_host=None: every process saves into a directory of '
            'its own and holds its lease; two processes of one job given the same directory '
            'refuse each other.)')
    except Exception as e:  # pylint: disable=broad-except  # storage errors: shared below
      error = errors.keeping_type(
          errors.SaveError, e,
          f'orbax_pathways: saving step {step} into {directory} failed before writing anything: '
          f'the writer lease {directory}/{LEASE_FILE} could not be checked: '
          f'{type(e).__name__}: {e}. Retry the save once storage answers again.')
      error.__cause__ = e
  client = jax_distributed.distributed_client()
  if count > 1 and client is not None and part.includes(me, count) and part.size(count) > 1:
    outcome = _agree(client, part, me, count, None if error is None else str(error))
    if outcome is not None and error is None:
      error = errors.WriterLeaseError(outcome)
  if error is not None:
    raise error


def _agree(client, part, me: int, count: int, outcome: str | None) -> str | None:
  """The round that makes every process calling the manager (``part``) raise together:
  ``None`` (go ahead) or the refusal that stands (``coord/rounds.py``).

  One writer (``primary_host`` set): it publishes its answer as the round's verdict; the
  others wait for that one key. Every process a writer (``primary_host=None``, a directory per
  process): each but the leader (the first member) publishes its answer; the leader gathers
  them (one deadline) and publishes the verdict, which the others wait for. The leader deletes
  the round of ``_AGREE_KEEP`` saves ago (every member is past it)."""
  leader = part.leader(count)
  seq = rounds.sequence(part.name('lease'), keep=_AGREE_KEEP)
  rnd = rounds.Round(client, seq.next(), me=me, members=part.members(count), count=count,
                     what='orbax_pathways: the writer lease round', leader=leader)
  wait_s = 3 * timeout_s() + 300  # a writer may watch another host's lease for `timeout`
  if me != leader:
    if part.every_process_writes:
      rnd.publish('ok' if outcome is None else 'refused:' + outcome)
    try:
      value = rnd.await_verdict(wait_s)
    except rounds.PeerTimeoutError as e:
      cause = e.__cause__
      return (f'orbax_pathways: process {leader}, which answers for the writer lease of this '
              f'manager ({part.describe(count)}), did not say within {wait_s:.0f} s whether the '
              f'save may go ahead ({type(cause).__name__}: {cause}). Every process that calls a '
              'CheckpointManager must call its save at every step.')
    if outcome is not None:
      return outcome  # this process's own refusal (the verdict then names it, or another)
    return None if value == 'ok' else value.split(':', 1)[1]
  if part.every_process_writes and outcome is None:  # a refusing leader answers at once
    others = [p for p in part.members(count) if p != me]
    try:
      answers = rnd.gather(wait_s, processes=others)
      refused = [(p, v.split(':', 1)[1]) for p, v in answers.items() if v != 'ok']
      if refused:
        p, text = refused[0]
        outcome = f'process {p}: {text}'
    except rounds.PeerTimeoutError as e:
      outcome = str(e)
  rnd.publish_verdict('ok' if outcome is None else 'refused:' + outcome)
  seq.retire(client, me, whole=True)
  return outcome


def after_close(mngr) -> None:
  """``LeaseHooks.close``: the last manager of this process that saved into the directory
  releases the lease."""
  directory = directory_key(mngr.directory)
  with _lock:
    lease = _leases.get(directory)
    if lease is None or id(mngr) not in lease.holders:
      return
    lease.holders.discard(id(mngr))
    if lease.holders:
      return
    del _leases[directory]
  lease.release()


def held_leases() -> dict[str, plan.Owner]:
  """The leases this process holds now: directory -> owner as last written."""
  with _lock:
    return {d: lease.me for d, lease in _leases.items()}


EXIT_RELEASE_S = 10.0  # at exit, how long releasing one lease may wait for storage


def release_all(timeout_s: float | None = EXIT_RELEASE_S) -> None:
  """Releases every lease this process holds (at interpreter exit: each waits at most
  ``timeout_s`` for storage, and no longer than its own lease timeout, so a storage request that
  never answers cannot keep the process alive; the lease then goes stale, and a lease not
  renewed for its timeout is taken over whether or not the delete ever answers). ``None``: no
  limit."""
  with _lock:
    leases = list(_leases.values())
    _leases.clear()
  for lease in leases:
    lease.release(None if timeout_s is None else min(timeout_s, lease.timeout_s))


def _after_fork_in_child() -> None:
  global _lock
  _lock = threading.RLock()
  _leases.clear()  # the parent's; the child takes its own if it saves


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(release_all)


@dataclasses.dataclass(frozen=True)
class LeaseHooks(hooks_lib.ManagerHooks):
  """The writer lease's calls around a CheckpointManager (``manager/hooks.py``): checked before
  each save, released at close. ``timeout``: seconds without renewal after which a lease is
  stale (None: ``ORBAX_PATHWAYS_LEASE_TIMEOUT_S``)."""

  name: ClassVar[str] = 'lease'
  timeout: float | None = None

  def before_save(self, mngr: Any, step: int) -> None:
    before_save(mngr, step)

  def close(self, mngr: Any) -> None:
    after_close(mngr)


_current = LeaseHooks()  # the registered one (its settings apply), else the defaults


def install(*, timeout: float | None = None) -> None:
  """Activates the lease for every CheckpointManager save (idempotent). ``timeout``: seconds
  without renewal after which a lease is stale (None: ``ORBAX_PATHWAYS_LEASE_TIMEOUT_S``)."""
  global _current
  if timeout is not None and not timeout > 0:
    raise ValueError(f'timeout={timeout!r} must be > 0 seconds.')
  with _lock:
    _current = LeaseHooks(timeout=timeout)
    _om.register(_current)


def uninstall() -> None:
  """No lease for later saves; the leases held now are released."""
  global _current
  release_all(None)
  with _lock:
    _om.unregister(_current)
    _current = LeaseHooks()


def installed() -> bool:
  return any(h is _current for h in _om.registered())
