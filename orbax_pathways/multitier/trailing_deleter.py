"""The hidden manager's retention of local-only steps, after each commit instead of inside it
(``Options.local_save_interval_steps`` with ``local_steps_in='storage'``).

Who calls what, on which host: ``_compat/orbax_manager_state.local_manager`` builds the hidden
manager with ``TrailingDeleter`` as its step deleter (``multitier/local_steps.py`` passes it, on
every process); Orbax's ``_finalize`` hands it ``delete_steps``; ``wait(inner)`` is
``local_steps``' wait (the user's ``wait_until_finished``, a resume's listing, an explicit
delete, ``close()``).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
from typing import Any

from etils import epath

from orbax_pathways._compat import jax_distributed
from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways.coord import rounds

log = logging.getLogger('orbax_pathways')


_built: collections.Counter[str] = collections.Counter()  # hidden managers built, by directory
_built_lock = threading.Lock()


class TrailingDeleter:
  """The hidden manager's deleter, around the one Orbax built for it (its primary host, step
  names and ``PathDeleter``; the package's retention hooks inside, markers first).

  Retention's deletions (Orbax's ``_finalize`` hands ``delete_steps`` the steps past
  ``max_to_keep`` once a local-only step committed, on every process) run one after another on
  a thread of this deleter's, after the commit instead of inside it: on gs:// at 30 ms a
  request, deleting the previous step took 0.8 s of a 2.6 s local-only commit, and the next
  local-only save waits for the commit. An explicit ``delete(step)``
  (``CheckpointManager.delete``: ``local_steps.drop_newer``) first waits for those and then
  deletes at once, on the caller's thread, so a step number deleted there can be saved again
  right away. A deletion that fails is logged and the others go on (the step stays until a
  later listing's retention).

  ``wait()`` (``local_steps``: the user's ``wait_until_finished``, a resume's listing, an
  explicit delete, ``close()``) returns once the deletions handed over so far have run *on the
  primary host*, on every process: in Orbax's own ``_finalize`` the deletion comes before the
  save's closing barrier, so after ``wait_until_finished`` no process lists a step the primary
  host is still deleting. Only the primary host deletes (Orbax's deleter skips the others);
  it publishes how many deletions it has run under one key of jax's key-value store (one key
  per hidden manager, overwritten), and the other processes' ``wait()`` reads that key until it
  reaches the number they were handed (the same on every process: Orbax's retention is computed
  alike everywhere). The primary host never waits for another process. Outside
  ``jax.distributed``, or with ``primary_host=None`` (every process deletes), nothing is
  published or read."""

  def __init__(self, inner: Any, directory: epath.Path, deletes_here: bool, timeout_s: float):
    self._inner = inner
    self._directory = directory
    self._pending: collections.deque[int] = collections.deque()
    self._thread: threading.Thread | None = None
    self._lock = threading.Lock()
    self._deletes_here = deletes_here  # the primary host, or every process (primary_host=None)
    self._client = (None if jax_distributed.process_count() == 1
                    else jax_distributed.distributed_client())
    # Every process builds a directory's hidden managers in the same order (the first local
    # save, or a resume's listing, on every process): the same key everywhere.
    with _built_lock:
      _built[str(directory)] += 1
      instance = _built[str(directory)]
    self._key = rounds.retention_key(hashlib.sha256(str(directory).encode()).hexdigest()[:16],
                                     instance)
    self._timeout_s = timeout_s
    self._handed = 0  # deletions handed to delete_steps so far
    self._ran = 0  # deletions run so far (this process deletes)

  def delete_steps(self, steps: Any) -> None:
    steps = list(steps)
    with self._lock:
      self._handed += len(steps)
      if not self._deletes_here:
        return  # the primary host deletes them; wait() waits for it
      self._pending.extend(steps)
      if self._pending and (self._thread is None or not self._thread.is_alive()):
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name='orbax_pathways-local-retention')
        self._thread.start()

  def _run(self) -> None:
    while True:
      with self._lock:
        if not self._pending:
          self._thread = None  # the next delete_steps starts another
          return
        step = self._pending.popleft()
      try:
        self._inner.delete(step)
      except Exception as e:  # pylint: disable=broad-except
        log.warning(
            'orbax_pathways: deleting local-only step %d of %s (retention) failed (%s: %s); it '
            'stays until a later retention deletes it.', step, self._directory,
            type(e).__name__, e)
      self._ran += 1  # only this thread (one at a time) counts
      self._publish(self._ran)

  def _publish(self, ran: int) -> None:
    if self._client is None:
      return
    try:
      rounds.put(self._client, self._key, str(ran))
    except Exception as e:  # pylint: disable=broad-except
      log.warning(
          'orbax_pathways: could not tell the other processes that %d retention deletion(s) of '
          '%s ran (%s: %s); their wait_until_finished waits for a later one.', ran,
          self._directory, type(e).__name__, e)

  @staticmethod
  def _ran_count(value: str | None) -> int:
    try:
      return int(value or 0)
    except ValueError:  # not what the primary host publishes: nothing known to have run
      return 0

  def wait(self) -> None:
    """Returns once every deletion handed to ``delete_steps`` so far has run on the host that
    deletes (this one, or the primary host: see the class docstring)."""
    with self._lock:
      thread = self._thread
      handed = self._handed
    if thread is not None and thread is not threading.current_thread():
      thread.join()
    client = self._client
    if self._deletes_here or client is None or handed == 0:
      return
    ran = self._ran_count(rounds.poll(client, self._key,
                                      lambda v: self._ran_count(v) >= handed, self._timeout_s))
    if ran < handed:
      raise TimeoutError(
          f'orbax_pathways: the primary host has run {ran} of the {handed} retention '
          f'deletion(s) of local-only steps in {self._directory} after {self._timeout_s:.0f} s '
          f'(key-value key {self._key}). Is the primary host alive? Its log says why a '
          'deletion is stuck; AsyncOptions.timeout_secs sets this wait.')

  def delete(self, step: int) -> None:
    self.wait()
    self._inner.delete(step)

  def close(self) -> None:
    self.wait()
    self._inner.close()


def wait(inner: Any) -> None:
  """Waits for the retention deletions of ``inner`` (a hidden manager) still running after
  its commits; a no-op for any other manager."""
  deleter = _oms.deleter_of(inner)
  if isinstance(deleter, TrailingDeleter):
    deleter.wait()
