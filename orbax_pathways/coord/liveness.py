"""Liveness of a multi-process save: who finished writing, who did not.

Called on every process of a multi-controller job, in Orbax's background commit thread of each
async save, by ``_compat/orbax_liveness.py``, before Orbax's own barriers (which wait for a dead
process until jax's heartbeat timeout aborts everyone with no Python error):

1. ``SaveRound.writes_done(error, own_s)`` once this process's commit futures finished (or
   failed): it publishes ``ok`` or ``failed: <error>`` in the save's round (``coord/rounds.py``:
   ``<key>/<process index>`` in jax's key-value store). The primary host gathers the others
   (one deadline that measures silence: ``peer_timeout_s`` plus how long this process's own
   writes took) and publishes the verdict (``<key>/verdict``: ``ok``, or who is missing or
   failed). Every other process waits for the
   verdict only (twice its own deadline); if none comes it claims "the primary is missing" as
   the verdict. The verdict is set at most once (``allow_overwrite=False``), so every live
   process follows the same one: all go on to Orbax's barrier, or all raise. A process whose
   own writes failed publishes its error and raises it (a failed primary also sets the verdict,
   so the others raise at once, naming it).
2. On the primary, ``commit_started`` / ``commit_done(error)`` around Orbax's commit callback
   (the OCDBT merge, our index, the rename): a daemon thread bumps ``<key>/alive`` every quarter
   of ``peer_timeout_s`` while it runs, and the outcome goes to ``<key>/commit``. The others,
   before Orbax's ``async_commit_complete`` barrier, ``await_commit()``: they wait as long as the
   primary shows progress, and raise naming it once a whole ``peer_timeout_s`` passes without.
3. ``cleanup()`` on the primary after Orbax's last barrier: one delete of ``<key>`` and
   everything under it.

Cost of a healthy save: every process sets one key and (but the primary) reads two; the primary
reads the round's directory once (then blocks only on processes not yet there), sets three keys
and deletes one: O(1) requests per process, the primary included, no polling. The round's key is
``orbax_pathways/save/<participants' digest>/<n>/<step dir>`` (``save_round``: the n-th async
save this process started among those participants). Each process also publishes its host
name once per lifetime (``rounds.host_key``), read only to name a missing process.

A process found missing is remembered (``lost_processes``, ``lost_error``):
``_compat/orbax_liveness`` then makes Orbax's later barriers raise at once, and keeps jax's
shutdown at exit from waiting for it (``jax.distributed.shutdown`` waits in a barrier
for every process, until its 300 s timeout or the heartbeat abort).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Sequence

from orbax_pathways import errors
from orbax_pathways.coord import participants as participants_lib
from orbax_pathways.coord import rounds

OK = 'ok'
FAILED = 'failed: '
DEFAULT_TIMEOUT_S = 60.0
MAX_MESSAGE = 1500


class _State:
  """What this process found in its saves' rounds (per process by nature: its own peers lost,
  for its own later barriers and its exit), and whether it published its host name."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.lost: set[int] = set()
    self.lost_text = ''  # the message of the first PeerLostError this process raised
    self.host_published = False


_state = _State()


def lost_processes() -> set[int]:
  """Processes this process found missing in a save (and raised ``PeerLostError`` for)."""
  with _state.lock:
    return set(_state.lost)


def _remember_lost(missing: Sequence[int], text: str) -> None:
  with _state.lock:
    _state.lost.update(missing)
    _state.lost_text = _state.lost_text or text


def lost_error(barrier: str) -> errors.PeerLostError | None:
  """Once this process found peers lost: the error that an Orbax barrier (``barrier``) raises
  instead of waiting for them (``_compat/orbax_liveness``); None while none was lost."""
  with _state.lock:
    if not _state.lost:
      return None
    return errors.PeerLostError(
        f'{_state.lost_text} (Orbax barrier {barrier!r} not entered: it would wait for the lost '
        'process(es) until jax\'s heartbeat timeout aborts this process. The job must be '
        'restarted.)', sorted(_state.lost))


def _failure(e: BaseException) -> str:
  return (FAILED + f'{type(e).__name__}: {e}')[:MAX_MESSAGE]


def save_round(client: Any, participants: participants_lib.Participants, *, step_dir: str,
               me: int, processes: Sequence[int], primary: int, what: str, num_processes: int,
               commits_alone: bool, timeout_s: float) -> SaveRound:
  """The round of the next async save this process starts among ``participants`` (the
  processes of its checkpointer) into ``step_dir`` (the step directory's name):
  ``orbax_pathways/save/<digest>/<n>/<step_dir>``, numbered alike on every member. Called
  by ``_compat/orbax_liveness`` (through ``_install``) in the controller's thread at the end
  of ``save()``. ``timeout_s``: the peer deadline beyond this process's own work
  (``Options.peer_timeout_s`` of the installed handler)."""
  key = rounds.sequence(participants.name('save')).next(suffix=step_dir)
  return SaveRound(client, key, me, processes, primary, what, num_processes,
                   commits_alone=commits_alone, timeout_s=timeout_s)


class SaveRound:
  """One async save's liveness round on this process (see the module docstring). ``key`` is
  the round's key (``save_round`` builds it)."""

  def __init__(self, client: Any, key: str, me: int, processes: Sequence[int], primary: int,
               what: str, num_processes: int, commits_alone: bool = True,
               timeout_s: float = DEFAULT_TIMEOUT_S):
    self.client = client
    self.key = key
    self.commits_alone = commits_alone  # False: every process commits (Orbax primary_host=None)
    self.me = me
    self.processes = tuple(processes)
    self.primary = primary
    self.what = what  # the step directory, for messages
    self.num_processes = num_processes
    if not timeout_s > 0:
      raise ValueError(f'peer_timeout_s={timeout_s!r}: need seconds > 0.')
    self.timeout_s = float(timeout_s)
    self.round = rounds.Round(client, key, me=me, members=self.processes, count=num_processes,
                              what=f'save of {what}', leader=primary)
    self._alive: threading.Event | None = None
    # Set by _compat/orbax_liveness when Orbax's own timeout cut the round short: raised at
    # Orbax's next barrier of this save.
    self.timed_out: errors.SaveTimeoutError | None = None

  @property
  def is_primary(self) -> bool:
    return self.me == self.primary

  # ---- writes ----------------------------------------------------------------------------------
  def writes_done(self, error: BaseException | None, own_s: float,
                  limit_s: float | None = None) -> None:
    """Publishes this process's outcome and, unless it failed, waits for the verdict; raises
    ``PeerLostError`` / ``SaveError`` naming the processes that are missing or failed.
    ``limit_s``: what is left of Orbax's own timeout of the save (``timeout_secs``); a wait it
    cuts short raises ``SaveTimeoutError``, as stock's barrier raises ``TimeoutError``."""
    self._publish_host()
    try:
      self.round.publish(OK if error is None else _failure(error))
    except Exception:  # pylint: disable=broad-except
      if error is None:
        raise
    if error is not None:  # the caller raises its own error; the others read ours
      if self.is_primary:  # and follow it at once, instead of waiting for a verdict
        try:
          self.round.publish_verdict(json.dumps(
              {'missing': [], 'failed': {str(self.me): _failure(error)[len(FAILED):]},
               'by': self.me}), once=True)
        except Exception:  # pylint: disable=broad-except
          pass
      return
    deadline = self.timeout_s + max(own_s, 0.0)
    if self.is_primary:
      cut = limit_s is not None and limit_s < deadline
      wait = max(limit_s, 0.001) if cut and limit_s is not None else deadline
      verdict = self.round.publish_verdict(self._gather(wait, cut), once=True)
    else:
      wait = 2 * deadline
      cut = limit_s is not None and limit_s < wait
      if cut and limit_s is not None:
        wait = max(limit_s, 0.001)
      try:
        verdict = self.round.await_verdict(wait)
      except rounds.PeerTimeoutError:
        verdict = self.round.publish_verdict(
            json.dumps({'missing': [self.primary], 'waited_s': wait, 'orbax_timeout': cut,
                        'by': self.me}), once=True)
    if verdict != OK:
      self._raise(json.loads(verdict), 'report that its writes finished')

  def _gather(self, deadline: float, orbax_timeout: bool = False) -> str:
    others = [p for p in self.processes if p != self.me]
    missing: list[int] = []
    try:
      found = self.round.gather(deadline, processes=others)
    except rounds.PeerTimeoutError as e:
      missing, found = list(e.missing), e.found
    failed = {str(p): v[len(FAILED):] for p, v in found.items() if v.startswith(FAILED)}
    if not missing and not failed:
      return OK
    return json.dumps({'missing': missing, 'failed': failed, 'waited_s': deadline,
                       'orbax_timeout': orbax_timeout and bool(missing), 'by': self.me})

  # ---- commit ----------------------------------------------------------------------------------
  def commit_started(self) -> None:
    """Primary, before Orbax's commit callback: progress marks until ``commit_done``."""
    if self._alive is not None:
      return
    stop = self._alive = threading.Event()
    interval = max(self.timeout_s / 4, 0.05)

    def beat():
      n = 0
      while True:
        n += 1
        try:
          self.round.put('alive', str(n))
        except Exception:  # pylint: disable=broad-except  (best effort)
          pass
        if stop.wait(interval):
          return

    threading.Thread(target=beat, name='orbax_pathways-commit-alive', daemon=True).start()

  def commit_done(self, error: BaseException | None) -> None:
    """Primary, after Orbax's commit callback: its outcome for the others."""
    if self._alive is not None:
      self._alive.set()
    self.round.put('commit', OK if error is None else _failure(error))

  def await_commit(self, limit_s: float | None = None) -> None:
    """The other processes, before Orbax's ``async_commit_complete`` barrier: the primary's
    commit outcome, as long as it shows progress and (``limit_s``: what is left of Orbax's own
    timeout of the save) no longer than Orbax would wait in that barrier."""
    last = None
    window_ms = max(1, int(self.timeout_s * 1000))
    end = None if limit_s is None else time.monotonic() + max(limit_s, 0.0)
    while True:
      wait_ms = window_ms
      if end is not None:
        wait_ms = max(1, min(window_ms, int((end - time.monotonic()) * 1000)))
      try:
        outcome = self.round.wait_for('commit', wait_ms / 1000)
        break
      except Exception:  # pylint: disable=broad-except  (DEADLINE_EXCEEDED)
        if end is not None and time.monotonic() >= end:
          raise errors.SaveTimeoutError(
              'Timed out while waiting for async_commit_complete barrier: the primary host '
              f'(process {self.primary}) was still committing {self.what} when Orbax\'s timeout '
              f'of the save ran out (AsyncCheckpointer timeout_secs / AsyncOptions.timeout_secs, '
              f'{limit_s:.0f}s left when this process finished writing). This process does not '
              'wait longer; the step is committed only if the primary finishes. Raise '
              'timeout_secs if commits take this long.') from None
        alive = self.round.read('alive')
        if alive is None or alive == last:
          self._raise({'missing': [self.primary], 'waited_s': self.timeout_s},
                      'show progress in its commit (the primary host commits the step)')
        last = alive
    if outcome != OK:
      raise errors.SaveError(
          f'The save of {self.what} failed on the primary host (process {self.primary}) while it '
          f'committed the step: {outcome[len(FAILED):]}. The step is not committed; see that '
          "process's log.")

  def cleanup(self) -> None:
    """Primary, after Orbax's last barrier: the round's keys go (one request)."""
    self.round.delete()

  # ---- errors ----------------------------------------------------------------------------------
  def _publish_host(self) -> None:
    if _state.host_published:
      return
    try:
      rounds.put(self.client, rounds.host_key(self.me), socket.gethostname())
      _state.host_published = True
    except Exception:  # pylint: disable=broad-except  (names only)
      pass

  def _host(self, process: int) -> str | None:
    return rounds.try_read(self.client, rounds.host_key(process)) or None

  def _raise(self, verdict: dict, did_not: str) -> None:
    missing = [int(p) for p in verdict.get('missing', ())]
    failed = {int(p): m for p, m in verdict.get('failed', {}).items()}
    hosts = {p: h for p in missing[:16] for h in [self._host(p)] if h}
    parts = []
    if missing:
      named = ', '.join(f'process {p}' + (f' (host {hosts[p]})' if p in hosts else '')
                        for p in missing[:16]) + (' ...' if len(missing) > 16 else '')
      waited = verdict.get('waited_s')
      parts.append(f'{named} of {self.num_processes} did not {did_not} within '
                   f'{waited:.0f}s' if isinstance(waited, (int, float)) else
                   f'{named} of {self.num_processes} did not {did_not}')
    if failed:
      parts.append('; '.join(f'process {p} failed its writes: {m}' for p, m in
                             sorted(failed.items())[:8]))
    if self.me in missing:
      parts.append('(this process answered too late: the others gave up on it)')
    text = (f'The save of {self.what} cannot complete: ' + '; '.join(parts).rstrip('.') + '. The '
            'step is not committed; earlier steps are untouched. A missing process died, hangs '
            'or is far slower than this one: check its log (and the host). The peer deadline is '
            f'ORBAX_PATHWAYS_PEER_TIMEOUT_S={self.timeout_s:g}s (Options.peer_timeout_s) plus what '
            "this process's own writes took.")
    # Orbax's own timeout ran out (here, or in another process's writes): a TimeoutError with
    # stock's phrase, as stock's barrier raises; the processes waited for are slow, not lost.
    if verdict.get('orbax_timeout') or any(
        m.split(':', 1)[0].endswith('TimeoutError') for m in failed.values()):
      raise errors.SaveTimeoutError(
          'Timed out while waiting for async_write_complete barrier: ' + text
          + " Orbax's timeout of the save is AsyncCheckpointer timeout_secs / "
          'AsyncOptions.timeout_secs.')
    if missing:
      _remember_lost([p for p in missing if p != self.me], text)
      raise errors.PeerLostError(text, missing, hosts)
    raise errors.SaveError(text)
