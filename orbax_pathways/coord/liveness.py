"""Liveness of a multi-process save: who finished writing, who did not (issue 21, item 1).

Called on every process of a multi-controller job, in Orbax's background commit thread of each
async save, by ``_compat/orbax_liveness.py``, before Orbax's own barriers (which wait for a dead
process until jax's heartbeat timeout aborts everyone with no Python error):

1. ``SaveRound.writes_done(error, own_s)`` once this process's commit futures finished (or
   failed): it publishes ``ok`` or ``failed: <error>`` under ``<key>/<process index>`` in jax's
   key-value store. The primary host waits for the others (``waits.gather``, one deadline:
   ``peer_timeout_s`` plus how long this process's own writes took) and publishes the verdict
   (``<key>/verdict``: ``ok``, or who is missing or failed). Every other process waits for the
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
reads one key per process, sets three and deletes one: O(1) per process, O(processes) on the
primary only, no polling. Each process also publishes its host name once per lifetime
(``<PREFIX>/hosts/<i>``), read only to name a missing process.

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
from orbax_pathways.coord import waits

PREFIX = 'orbax_pathways/liveness'
OK = 'ok'
FAILED = 'failed: '
DEFAULT_TIMEOUT_S = 60.0
MAX_MESSAGE = 1500

_lock = threading.Lock()
_timeout_s = DEFAULT_TIMEOUT_S
_lost: set[int] = set()
_lost_text = ''  # the message of the first PeerLostError this process raised
_host_published = False


def configure(peer_timeout_s: float) -> None:
  """Sets the process's deadline beyond observed work (``engine.Engine`` from its options)."""
  global _timeout_s
  if not peer_timeout_s > 0:
    raise ValueError(f'peer_timeout_s={peer_timeout_s!r}: need seconds > 0.')
  with _lock:
    _timeout_s = float(peer_timeout_s)


def peer_timeout_s() -> float:
  return _timeout_s


def lost_processes() -> set[int]:
  """Processes this process found missing in a save (and raised ``PeerLostError`` for)."""
  with _lock:
    return set(_lost)


def _remember_lost(missing: Sequence[int], text: str) -> None:
  global _lost_text
  with _lock:
    _lost.update(missing)
    _lost_text = _lost_text or text


def lost_error(barrier: str) -> errors.PeerLostError | None:
  """Once this process found peers lost: the error that an Orbax barrier (``barrier``) raises
  instead of waiting for them (``_compat/orbax_liveness``); None while none was lost."""
  with _lock:
    if not _lost:
      return None
    return errors.PeerLostError(
        f'{_lost_text} (Orbax barrier {barrier!r} not entered: it would wait for the lost '
        'process(es) until jax\'s heartbeat timeout aborts this process. The job must be '
        'restarted.)', sorted(_lost))


def _failure(e: BaseException) -> str:
  return (FAILED + f'{type(e).__name__}: {e}')[:MAX_MESSAGE]


def _try_get(client: Any, key: str) -> str | None:
  try:
    return client.key_value_try_get(key)
  except Exception:  # pylint: disable=broad-except  (NOT_FOUND)
    return None


def _set_once(client: Any, key: str, value: str) -> str:
  """Sets ``key`` unless some process set it first; returns the value that stands."""
  try:
    client.key_value_set(key, value, allow_overwrite=False)
    return value
  except Exception:  # pylint: disable=broad-except  (ALREADY_EXISTS: another verdict won)
    found = _try_get(client, key)
    return value if found is None else found


class SaveRound:
  """One async save's liveness round on this process (see the module docstring)."""

  def __init__(self, client: Any, key: str, me: int, processes: Sequence[int], primary: int,
               what: str, num_processes: int, commits_alone: bool = True,
               timeout_s: float | None = None):
    self.client = client
    self.key = f'{PREFIX}/saves/{key}'
    self.commits_alone = commits_alone  # False: every process commits (Orbax primary_host=None)
    self.me = me
    self.processes = tuple(processes)
    self.primary = primary
    self.what = what  # the step directory, for messages
    self.num_processes = num_processes
    self.timeout_s = _timeout_s if timeout_s is None else timeout_s
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
      self.client.key_value_set(f'{self.key}/{self.me}', OK if error is None else _failure(error),
                                allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      if error is None:
        raise
    if error is not None:  # the caller raises its own error; the others read ours
      if self.is_primary:  # and follow it at once, instead of waiting for a verdict
        try:
          _set_once(self.client, f'{self.key}/verdict', json.dumps(
              {'missing': [], 'failed': {str(self.me): _failure(error)[len(FAILED):]},
               'by': self.me}))
        except Exception:  # pylint: disable=broad-except
          pass
      return
    deadline = self.timeout_s + max(own_s, 0.0)
    if self.is_primary:
      cut = limit_s is not None and limit_s < deadline
      wait = max(limit_s, 0.001) if cut and limit_s is not None else deadline
      verdict = _set_once(self.client, f'{self.key}/verdict', self._gather(wait, cut))
    else:
      wait = 2 * deadline
      cut = limit_s is not None and limit_s < wait
      if cut and limit_s is not None:
        wait = max(limit_s, 0.001)
      try:
        verdict = self.client.blocking_key_value_get(f'{self.key}/verdict',
                                                     max(1, int(wait * 1000)))
      except Exception:  # pylint: disable=broad-except  (DEADLINE_EXCEEDED)
        verdict = _set_once(self.client, f'{self.key}/verdict',
                            json.dumps({'missing': [self.primary], 'waited_s': wait,
                                        'orbax_timeout': cut, 'by': self.me}))
    if verdict != OK:
      self._raise(json.loads(verdict), 'report that its writes finished')

  def _gather(self, deadline: float, orbax_timeout: bool = False) -> str:
    others = [p for p in self.processes if p != self.me]
    missing: list[int] = []
    try:
      found = dict(zip(others, waits.gather(self.client, self.key, self.num_processes, deadline,
                                            what=f'save of {self.what}', processes=others)))
    except waits.PeerTimeoutError as e:
      missing = list(e.missing)
      found = {p: v for p in others if p not in missing
               for v in [_try_get(self.client, f'{self.key}/{p}')] if v is not None}
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
          self.client.key_value_set(f'{self.key}/alive', str(n), allow_overwrite=True)
        except Exception:  # pylint: disable=broad-except  (best effort)
          pass
        if stop.wait(interval):
          return

    threading.Thread(target=beat, name='orbax_pathways-commit-alive', daemon=True).start()

  def commit_done(self, error: BaseException | None) -> None:
    """Primary, after Orbax's commit callback: its outcome for the others."""
    if self._alive is not None:
      self._alive.set()
    self.client.key_value_set(f'{self.key}/commit', OK if error is None else _failure(error),
                              allow_overwrite=True)

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
        outcome = self.client.blocking_key_value_get(f'{self.key}/commit', wait_ms)
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
        alive = _try_get(self.client, f'{self.key}/alive')
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
    try:
      self.client.key_value_delete(self.key)
    except Exception:  # pylint: disable=broad-except  (a leftover key costs nothing but memory)
      pass

  # ---- errors ----------------------------------------------------------------------------------
  def _publish_host(self) -> None:
    global _host_published
    if _host_published:
      return
    try:
      self.client.key_value_set(f'{PREFIX}/hosts/{self.me}', socket.gethostname(),
                                allow_overwrite=True)
      _host_published = True
    except Exception:  # pylint: disable=broad-except  (names only)
      pass

  def _raise(self, verdict: dict, did_not: str) -> None:
    missing = [int(p) for p in verdict.get('missing', ())]
    failed = {int(p): m for p, m in verdict.get('failed', {}).items()}
    hosts = {p: h for p in missing for h in [_try_get(self.client, f'{PREFIX}/hosts/{p}')] if h}
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
