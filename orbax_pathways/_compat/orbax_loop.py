"""A save or restore that fails leaves no task of its event loop behind (issue 26, item 13).

SUPPORTED: orbax-checkpoint ``>=0.12.4,<0.13`` (written against 0.12.8; a release without
``asyncio_utils._run_sync_via_new_loop`` runs its coroutines with ``asyncio.run``, which already
cancels what is left, and is left alone).

Orbax 0.12.8 runs a handler's coroutine (``run_sync``: every ``restore``, a save's background
commit) in a fresh loop with ``run_until_complete`` and then closes the loop, without the
teardown ``asyncio.run`` does. Orbax gathers its handlers' coroutines without
``return_exceptions``, so when one handler fails (a damaged chunk, a missing array, a failed
upload), the others are still running when the loop closes: their tasks are destroyed pending
("Task was destroyed but it is pending!"; a task created in that last iteration, never started:
"coroutine ... was never awaited"), and their tensorstore requests go on without anyone waiting
and answer into the closed loop ("Event loop is closed", printed as an ignored exception).

Patch, installed by ``install()`` and restored exactly by ``uninstall()`` (both idempotent):
``asyncio_utils._run_sync_via_new_loop`` runs the coroutine as Orbax does; if it failed and
tasks of that loop are still pending, they are cancelled and given up to ``SETTLE_S`` seconds to
end (ours cancel their storage requests and wait for them:
``storage/hedge.py``) before the loop closes. Tasks of this one loop only
(``asyncio.all_tasks(loop)``): other threads' loops are never touched. The result or the error
is Orbax's, unchanged.

Who calls it: ``orbax_pathways.install()`` (``_registration.py``), on every process.
"""

from __future__ import annotations

from orbax_pathways._compat import src

import asyncio
import logging
import threading
from typing import Any, Callable

SUPPORTED = '>=0.12.4,<0.13'
SETTLE_S = 30.0  # how long the cancelled tasks of a failed run may take to end

_asyncio_utils = src.orbax('asyncio_utils')
_lock = threading.Lock()
_original: Callable[..., Any] | None = None
log = logging.getLogger('orbax_pathways')


def _settle(loop: asyncio.AbstractEventLoop) -> None:
  """Cancels the tasks still pending on ``loop`` (not running) and runs it until they end, at
  most ``SETTLE_S``."""
  try:
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
  except RuntimeError:  # the task registry changed under us too often: close as Orbax does
    return
  if not pending:
    return
  for t in pending:
    t.cancel()
  done, left = loop.run_until_complete(asyncio.wait(pending, timeout=SETTLE_S))
  for t in done:
    if not t.cancelled():
      t.exception()  # retrieved: a secondary error of a failed run is not logged as unretrieved
  if left:
    log.warning('orbax_pathways: %d task(s) of a failed Orbax call did not end within %.0f s '
                'of being cancelled; closing their event loop anyway.', len(left), SETTLE_S)


def _run_sync_via_new_loop(coro):
  """Orbax's ``_run_sync_via_new_loop``; when the coroutine failed, the loop's leftover tasks
  are cancelled and ended before it closes (a call that succeeded closes as Orbax closes it)."""
  loop = asyncio.new_event_loop()
  failed = True
  try:
    asyncio.set_event_loop(loop)
    result = loop.run_until_complete(coro)
    failed = False
    return result
  finally:
    try:
      if failed:
        _settle(loop)
    finally:
      asyncio.set_event_loop(None)
      loop.close()


def install() -> None:
  global _original
  with _lock:
    if _original is not None or not hasattr(_asyncio_utils, '_run_sync_via_new_loop'):
      return
    _original = _asyncio_utils._run_sync_via_new_loop  # pylint: disable=protected-access
    _asyncio_utils._run_sync_via_new_loop = _run_sync_via_new_loop  # pylint: disable=protected-access


def uninstall() -> None:
  global _original
  with _lock:
    if _original is None:
      return
    _asyncio_utils._run_sync_via_new_loop = _original  # pylint: disable=protected-access
    _original = None


def installed() -> bool:
  return _original is not None
