"""Orbax's background commit of a multi-process async save, with a liveness round before its
barriers. The round itself is ``orbax_pathways/liveness.py``.

SUPPORTED: orbax-checkpoint ``supported.ORBAX`` (written against 0.12.8), like the other patches.

Stock: ``_AsyncManager`` runs ``_background_wait_for_commit_futures`` in its ``async_save``
thread: wait for this process's commit futures, barrier ``async_write_complete`` (every
process), the primary host's commit callback, barrier ``async_commit_complete``. A process that
died never reaches the first barrier; the others wait in it until jax's heartbeat timeout aborts
them (SIGABRT, no Python error; measured ~105 s with jax's default 100 s).

Patches, installed by ``install(make_round)`` and restored exactly by ``uninstall()`` (both
idempotent):

- ``AsyncCheckpointer.__init__``: after Orbax's, tags its ``_AsyncManager`` with the processes
  its barriers span (``MultiprocessingOptions.active_processes``; all when None). A checkpointer
  built with its own ``AsyncOptions.barrier_sync_fn`` is left stock (its barrier is not jax's).
- ``_AsyncManager.start_async_commit(directory, commit_futures, on_commit_callback)`` (the
  controller's thread, at the end of ``save()``): for a tagged manager spanning several
  processes, with a hook set, hands Orbax one future in place of the commit futures: it waits
  for them all, then runs ``round.writes_done`` (publish, wait for the verdict; raises naming
  who is missing or failed) before Orbax's ``async_write_complete`` barrier; on the primary the
  commit callback reports its progress and outcome (``commit_started`` / ``commit_done``); the
  manager's barrier function (``_sync_fn``, wrapped once per manager) makes the other processes
  ``await_commit`` before ``async_commit_complete``, and the primary ``cleanup`` after it.
  The round factory gets the checkpointer's participants (``coord/participants.py``: the barrier
  prefix, ``active_processes``, ``primary_host``) and names the round from them and the number
  of async saves this process started among them, and the step directory's name
  (``coord/liveness.save_round``): unique per save and the same on every process of the
  checkpointer. Not Orbax's operation id: that
  counter is per process, and the slices of Orbax's emergency manager run different numbers of
  saves (a local one every step, a persistent one every few), so it differs between the
  processes of a manager that spans them (its ``non_replicated`` manager).

- ``multihost.sync_global_processes`` and ``multihost.get_barrier_sync_fn`` (the barriers of
  Orbax's CheckpointManager and checkpointers: the manager's finalize thread, ``close()``, the
  next ``save()``): once this process found peers lost, they raise that ``PeerLostError`` at once
  instead of waiting for the lost peers until jax's heartbeat timeout aborts the process.

``exit_without_waiting_for_lost()`` is registered with ``atexit`` by ``install`` (after jax's own
exit handler, so it runs first): when this process found peers lost, jax's
``distributed.shutdown`` would wait for them in its shutdown barrier (300 s, or the heartbeat
abort); their client and service are then dropped without that barrier (kept referenced, never
destroyed: their destructor would wait the same way). The process exits at once, with its own
exit status.

Who calls it: ``orbax_pathways._install`` (``install()``), on every process.
"""

from __future__ import annotations

from orbax_pathways._compat import seam
from orbax_pathways._compat import src

import atexit
import ctypes
import dataclasses
import functools
import threading
import time
from typing import Any, Callable, Sequence

import jax

from orbax_pathways import errors
from orbax_pathways.coord import participants as participants_lib

_ac = src.orbax('checkpointers.async_checkpointer')
_future = src.orbax('futures.future')
_multihost = src.orbax('multihost.multihost')


_SCOPE = '_orbax_pathways_liveness_scope'
_PARTICIPANTS = '_orbax_pathways_liveness_participants'
_SYNC_WRAPPED = '_orbax_pathways_liveness_sync'
_COMMIT_COMPLETE = 'async_commit_complete'
_WRITE_COMPLETE = 'async_write_complete'

_lock = threading.Lock()


class _State:
  """This module's process-wide state (one object: no `global` statement)."""

  make_round: Callable[..., Any] | None = None
  lost_error: Callable[[str], BaseException | None] | None = None
  atexit_registered = False


_state = _State()
_local = threading.local()  # .round: the round of the async_save thread running it
_kept: list[Any] = []  # jax's distributed client/service, dropped at exit without shutdown


@dataclasses.dataclass(frozen=True)
class _Scope:
  processes: tuple[int, ...] | None  # None: every process
  prefix: str


def _wrap_init(original):
  @functools.wraps(original)
  def __init__(self, *args, **kwargs):
    original(self, *args, **kwargs)
    async_options = kwargs.get('async_options')
    if async_options is not None and getattr(async_options, 'barrier_sync_fn', None) is not None:
      return  # the user's own barrier: not ours to drive
    manager = self.__dict__.get('_async_manager')
    if manager is None:
      return
    active = getattr(self, '_active_processes', None)
    manager.__dict__[_SCOPE] = _Scope(
        tuple(sorted(active)) if active else None,
        str(getattr(self, '_barrier_sync_key_prefix', '') or ''))
  return __init__


class _LivenessFuture:
  """Orbax's commit futures of one save, then the liveness round (in the async_save thread)."""

  def __init__(self, futures: Sequence[Any], rnd: Any, started: float):
    self._futures = list(futures)
    self._round = rnd
    self._started = started

  def result(self, timeout: float | None = None) -> None:
    """``timeout``: Orbax's own timeout of the save (``timeout_secs``, counted from the start
    of its background thread); the liveness round waits no longer than what is left of it."""
    _local.round = self._round
    error: BaseException | None = None
    try:
      _future.ChainedFuture(self._futures, cb=lambda: None).result(timeout=timeout)
    except BaseException as e:  # pylint: disable=broad-except  (published, then raised)
      error = e
    own_s = time.monotonic() - self._started
    limit = None
    if timeout is not None:  # ends a little early: Orbax raises its own bare "Timed out after"
      left = timeout - own_s  # before its barrier if none is left, and ours names who was slow
      limit = left - min(0.5, 0.1 * max(left, 0.0))
    try:
      self._round.writes_done(error, own_s, limit)
    except errors.SaveTimeoutError as e:
      if error is not None:
        raise
      # Raised at Orbax's next barrier, where stock raises its TimeoutError (raised here,
      # Orbax's ChainedFuture would replace it with its own "timed out" for this future).
      self._round.timed_out = e
    if error is not None:
      raise error

  def cancel(self) -> None:
    for f in self._futures:
      f.cancel()


def _commit_callback(callback: Callable[[], None], rnd: Any) -> Callable[[], None]:
  def on_commit() -> None:
    rnd.commit_started()
    try:
      callback()
    except BaseException as e:
      try:
        rnd.commit_done(e)
      except Exception:  # pylint: disable=broad-except  (the commit's own error is what counts)
        pass
      raise
    rnd.commit_done(None)
  return on_commit


def _wrap_sync_fn(sync_fn: Callable[[str, int], None]) -> Callable[[str, int], None]:
  def sync(key: str, timeout_ms: int) -> None:
    rnd: Any = getattr(_local, 'round', None)
    if rnd is not None and (_WRITE_COMPLETE in key or _COMMIT_COMPLETE in key):
      timed_out = getattr(rnd, 'timed_out', None)
      if timed_out is not None:
        rnd.timed_out = None
        raise timed_out
    if rnd is None or _COMMIT_COMPLETE not in key:
      sync_fn(key, timeout_ms)
      return
    if not rnd.is_primary and rnd.commits_alone:
      rnd.await_commit(timeout_ms / 1000)  # what is left of Orbax's timeout of the save
    sync_fn(key, timeout_ms)
    if rnd.is_primary:
      rnd.cleanup()
  return sync


def _wrap_start(original):
  @functools.wraps(original)
  def start_async_commit(self, directory, commit_futures, on_commit_callback):
    make = _state.make_round
    scope = self.__dict__.get(_SCOPE)
    if make is None or scope is None:
      return original(self, directory, commit_futures, on_commit_callback)
    count = jax.process_count()
    processes = scope.processes if scope.processes is not None else tuple(range(count))
    if len(processes) <= 1:
      return original(self, directory, commit_futures, on_commit_callback)
    primary_host = getattr(self, '_primary_host', 0)
    every_process_commits = primary_host is None
    primary = processes[0] if every_process_commits else primary_host
    part = self.__dict__.get(_PARTICIPANTS)
    if part is None:
      part = self.__dict__[_PARTICIPANTS] = participants_lib.Participants.of(
          scope.processes, primary_host, scope.prefix)
    # Orbax's process numbering (active_processes, primary_host use it): jax.distributed's
    # process id under experimental_orbax_use_distributed_process_id.
    rnd = make(participants=part, step_dir=getattr(directory, 'name', '-'),
               me=_multihost.process_index(), processes=processes,
               primary=primary, what=str(directory), num_processes=count,
               commits_alone=not every_process_commits)
    if not self.__dict__.get(_SYNC_WRAPPED):
      self._sync_fn = _wrap_sync_fn(self._sync_fn)  # pylint: disable=protected-access
      self.__dict__[_SYNC_WRAPPED] = True
    callback = on_commit_callback
    if rnd.is_primary and not every_process_commits:
      callback = _commit_callback(on_commit_callback, rnd)
    return original(self, directory, [_LivenessFuture(commit_futures, rnd, time.monotonic())],
                    callback)
  return start_async_commit


def _fail_fast(name: str) -> None:
  """Raises at once, instead of entering a barrier, once this process found peers lost."""
  lost_error = _state.lost_error
  error = lost_error(name) if lost_error is not None else None
  if error is not None:
    raise error


def _wrap_sync_global_processes(original):
  @functools.wraps(original)
  def sync_global_processes(name, *args, **kwargs):
    _fail_fast(name)
    return original(name, *args, **kwargs)
  return sync_global_processes


def _wrap_get_barrier_sync_fn(original):
  @functools.wraps(original)
  def get_barrier_sync_fn(*args, **kwargs):
    fn = original(*args, **kwargs)

    def barrier(*, key: str, timeout_ms: int) -> None:
      _fail_fast(key)
      return fn(key=key, timeout_ms=timeout_ms)
    return barrier
  return get_barrier_sync_fn


FEATURE = seam.Feature(
    'the save liveness round (a process that dies mid-save is named, and the others exit)',
    'Orbax\'s async commit and its barriers wait for a dead process until their timeout',
    lambda: [seam.Target(lambda: _ac.AsyncCheckpointer, '__init__', _wrap_init),
             seam.Target(lambda: _ac._AsyncManager, 'start_async_commit', _wrap_start),  # pylint: disable=protected-access
             seam.Target(lambda: _multihost, 'sync_global_processes',
                         _wrap_sync_global_processes),
             seam.Target(lambda: _multihost, 'get_barrier_sync_fn', _wrap_get_barrier_sync_fn)])


def install(make_round: Callable[..., Any],
            lost_error: Callable[[str], BaseException | None]) -> None:
  """Sets the round factory (``liveness.SaveRound``-like, keyword arguments ``participants,
  step_dir, me, processes, primary, what, num_processes, commits_alone``) and
  ``lost_error(barrier)`` (the error to raise instead of entering an Orbax barrier once peers
  were found lost; None while none was), installs the patches (once; none where Orbax lacks
  one: its barriers and jax's heartbeat then) and the exit handler (once per process)."""
  with _lock:
    _state.make_round, _state.lost_error = make_round, lost_error
    if not _state.atexit_registered:
      atexit.register(exit_without_waiting_for_lost)
      _state.atexit_registered = True
    seam.install(FEATURE)


def uninstall() -> None:
  """Puts Orbax's own functions back and clears the factory (idempotent)."""
  with _lock:
    seam.uninstall(FEATURE)
    _state.make_round, _state.lost_error = None, None


def installed() -> bool:
  return seam.installed(FEATURE)


def exit_without_waiting_for_lost() -> None:
  """At exit, when this process found peers lost: jax's distributed client and service are
  dropped without their shutdown barrier (which would wait for the lost peers)."""
  lost_error = _state.lost_error
  if lost_error is None or lost_error('exit') is None:
    return
  try:
    distributed = src.jax('distributed')
    state = distributed.global_state
    for name in ('preemption_sync_manager', 'client', 'service'):
      obj = getattr(state, name, None)
      if obj is not None:
        _kept.append(obj)
        # One reference never released: at interpreter teardown the module's globals are freed,
        # and a freed service cancels its calls (the client then aborts the process), a freed
        # client shuts down (the same barrier).
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
        setattr(state, name, None)
  except Exception:  # pylint: disable=broad-except  (another jax: its own shutdown then)
    pass


def originals() -> dict[str, Callable[..., Any]]:
  """Orbax's own functions (by attribute name) while the patches are installed; empty otherwise
  (tests check they are put back as they were)."""
  return seam.originals(FEATURE)
