"""A failed step of an async save releases the threads waiting for it.

SUPPORTED: orbax-checkpoint ``supported.ORBAX`` (written against 0.12.8).

Orbax runs each commit future of an async save in a ``_SignalingThread`` (non-daemon) that waits
for signals from other futures before it starts: the writers wait for
``step_directory_creation``, sent by the thread that creates the step directory. When that
thread *fails* (a read-only or full directory, a permission error), Orbax records the error and
never sends the signal, so every waiting thread sits in ``blocking_key_value_get`` for the
coordination timeout (300 s). The save's error is reported at once, but the interpreter cannot
exit until those non-daemon threads give up: a job whose save failed hangs ~300 s at exit.

Patch, installed by ``install()`` and restored exactly by ``uninstall()`` (both idempotent):

- ``_SignalingThread.run``: after Orbax's own ``run``, a thread that failed (not cancelled)
  still sends its signals, with the value ``FAILED`` instead of Orbax's success value, so
  the threads waiting for it (in this process or, through the coordination service, in the
  others) wake up at once.
- ``_SignalingThread._wait_for_signals``: after Orbax's own wait, a thread whose signal came
  with ``FAILED`` raises instead of running its work (nothing is written into a directory that
  was never created); Orbax logs that error and the thread ends.

Who calls it: ``orbax_pathways.install()`` (``_install.py``), on every process.
"""

from __future__ import annotations

from orbax_pathways._compat import seam
from orbax_pathways._compat import src

import concurrent.futures
import functools
import threading
from typing import Any, Callable

_future = src.orbax('futures.future')
_signaling_client = src.orbax('futures.signaling_client')

FAILED = 'orbax_pathways:failed'



class SignalFailedError(RuntimeError):
  """A step this commit future waited for failed; its own work was not started."""


def _key(signal: Any, operation_id: str) -> str:
  return _future.AwaitableSignalsContract.get_unique_awaitable_singal_key(signal, operation_id)


def _wrap_run(original):
  @functools.wraps(original)
  def run(self):
    original(self)
    error = getattr(self, '_exception', None)
    if error is None or isinstance(error, concurrent.futures.CancelledError):
      return
    signals = list(getattr(self, '_send_signals', None) or ())
    if not signals:
      return
    try:
      client = _signaling_client.get_signaling_client()
      for signal in signals:
        client.key_value_set(_key(signal, self._operation_id), FAILED, allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except  (best effort: the save already failed)
      pass
  return run


def _wrap_wait(original):
  @functools.wraps(original)
  def _wait_for_signals(self):
    original(self)
    signals = list(getattr(self, '_receive_signals', None) or ())
    if not signals:
      return
    client = _signaling_client.get_signaling_client()
    for signal in signals:
      if client.key_value_try_get(_key(signal, self._operation_id)) == FAILED:
        raise SignalFailedError(
            f'{self.name}: not started, because the step it waited for '
            f'({signal.value}, operation {self._operation_id}) failed; that failure is the '
            "save's error.")
  return _wait_for_signals


def _signaling_thread():
  return _future._SignalingThread  # pylint: disable=protected-access


FEATURE = seam.Feature(
    'a failed step releasing the saves that wait for its signals (no hang at exit)',
    'Orbax\'s signalling threads have no failure path to their waiters',
    lambda: [seam.Target(_signaling_thread, 'run', _wrap_run),
             seam.Target(_signaling_thread, '_wait_for_signals', _wrap_wait)])


def install() -> None:
  """Installs both wrappers (once; neither where Orbax lacks one: its own behaviour then)."""
  seam.install(FEATURE)


def uninstall() -> None:
  """Puts Orbax's own methods back (idempotent)."""
  seam.uninstall(FEATURE)
