"""A save or restore that fails leaves no task of its event loop behind.

SUPPORTED: orbax-checkpoint ``supported.ORBAX`` (written against 0.12.8). A release without
``asyncio_utils._run_sync_via_new_loop`` (0.12.4) runs its coroutines with ``asyncio.run``, which
cancels what is left but closes the loop at once, so a tensorstore request of a cancelled task
still answers into a closed loop; there ``run_sync`` itself is patched to run as 0.12.8's does
(a fresh loop, ``run_until_complete``), with the same teardown as below.

Orbax 0.12.8 runs a handler's coroutine (``run_sync``: every ``restore``, a save's background
commit) in a fresh loop with ``run_until_complete`` and then closes the loop, without the
teardown ``asyncio.run`` does. Orbax gathers its handlers' coroutines without
``return_exceptions``, so when one handler fails (a damaged chunk, a missing array, a failed
upload), the others are still running when the loop closes: their tasks are destroyed pending
("Task was destroyed but it is pending!"; a task created in that last iteration, never started:
"coroutine ... was never awaited"), and their tensorstore requests go on without anyone waiting
and answer into the closed loop ("Event loop is closed", printed as an ignored exception).

When a loop is already running in the calling thread (Orbax v1 calls ``run_sync`` from inside
its own coroutines), Orbax runs the coroutine in a fresh uvloop on a thread of its own
(``_run_event_loop``), stops that loop once the coroutine's future is done and closes it: a
failed coroutine leaves the same leftover tasks there.

Patches, installed by ``install()`` and restored exactly by ``uninstall()`` (both idempotent):
``asyncio_utils._run_event_loop`` runs the loop as Orbax does; once stopped, tasks still pending
on it are cancelled and ended (as below) before it closes.
``asyncio_utils._run_sync_via_new_loop`` runs the coroutine as Orbax does; if it failed and
tasks of that loop are still pending, they are cancelled and given up to ``SETTLE_S`` seconds to
end (ours cancel their storage requests and wait for them:
``storage/hedge.py``), and the loop is closed ``LINGER_S`` later (a request Orbax or tensorstore
started for a cancelled task may still answer into it). Tasks of this one loop only
(``asyncio.all_tasks(loop)``): other threads' loops are never touched. The result or the error
is Orbax's, unchanged.

Who calls it: ``orbax_pathways.install()`` (``_install.py``), on every process.
"""

from __future__ import annotations

from orbax_pathways._compat import seam
from orbax_pathways._compat import src

import asyncio
import logging
import threading
from typing import Any, Callable

SETTLE_S = 30.0  # how long the cancelled tasks of a failed run may take to end
# A loop whose failed run left tasks behind is closed this much later, not at once: a storage
# request those tasks had started (tensorstore's, Orbax's own) may still answer into it after
# they were cancelled, and an answer into a closed loop is an "Event loop is closed" error in a
# thread nobody can catch it in. Every storage request has a deadline, so none answers later.
LINGER_S = 120.0

_asyncio_utils = src.orbax('asyncio_utils')
_UNSET = object()
log = logging.getLogger('orbax_pathways')


def _settle(loop: asyncio.AbstractEventLoop) -> bool:
  """Cancels the tasks still pending on ``loop`` (not running) and runs it until they end, at
  most ``SETTLE_S``; True when there were any (the loop should then linger: ``_close``)."""
  try:
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
  except RuntimeError:  # the task registry changed under us too often: close as Orbax does
    return False
  if not pending:
    return False
  for t in pending:
    t.cancel()
  done, left = loop.run_until_complete(asyncio.wait(pending, timeout=SETTLE_S))
  for t in done:
    if not t.cancelled():
      t.exception()  # retrieved: a secondary error of a failed run is not logged as unretrieved
  if left:
    log.warning('orbax_pathways: %d task(s) of a failed Orbax call did not end within %.0f s '
                'of being cancelled; closing their event loop anyway.', len(left), SETTLE_S)
  return True


def _close(loop: asyncio.AbstractEventLoop, linger: bool) -> None:
  """Closes ``loop`` now, or, when a failed run left work behind (``linger``), ``LINGER_S``
  later on a timer thread (the loop is no longer running: a late answer only queues a callback
  that the close then drops)."""
  if not linger:
    loop.close()
    return
  timer = threading.Timer(LINGER_S, _close_quietly, args=(loop,))
  timer.daemon = True
  timer.name = 'orbax_pathways_loop_linger'
  timer.start()


def _close_quietly(loop: asyncio.AbstractEventLoop) -> None:
  try:
    loop.close()
  except Exception:  # pylint: disable=broad-except  (closing a dead loop: nothing to report)
    pass


def _run_sync_via_new_loop(coro):
  """Orbax's ``_run_sync_via_new_loop``; when the coroutine failed, the loop's leftover tasks
  are cancelled and ended before it closes (a call that succeeded closes as Orbax closes it)."""
  loop = asyncio.new_event_loop()
  failed, linger = True, False
  try:
    asyncio.set_event_loop(loop)
    result = loop.run_until_complete(coro)
    failed = False
    return result
  finally:
    try:
      if failed:
        linger = _settle(loop)
    finally:
      asyncio.set_event_loop(None)
      _close(loop, linger)


def _run_event_loop(loop):
  """Orbax's ``_run_event_loop`` (a loop of its own on a thread, until stopped); tasks still
  pending once it stopped (a failed coroutine's others) are cancelled and ended before it
  closes."""
  try:
    loop.run_forever()
  except BaseException as e:  # pylint: disable=broad-except  (as Orbax: the loop just ends)
    log.info('orbax_pathways: background event loop ended: %r', e)
  finally:
    linger = False
    try:
      if not loop.is_closed():
        linger = _settle(loop)
    except Exception:  # pylint: disable=broad-except  (close it as Orbax does)
      pass
    finally:
      try:
        _close(loop, linger)
      except Exception:  # pylint: disable=broad-except
        pass


def _run_sync(coro):
  """``run_sync`` of an Orbax that runs coroutines with ``asyncio.run`` (0.12.4): with no loop
  running in this thread, as 0.12.8's ``run_sync`` does (the thread's ``loop`` and ``main_task``
  set while it runs, then put back; a fresh loop, ``_run_sync_via_new_loop`` above); with one
  running, Orbax's own."""
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    pass
  else:
    original = seam.originals(FEATURE).get('run_sync')
    assert original is not None, 'installed as the patch only while the original is kept'
    return original(coro)

  async def registered():
    thread = threading.current_thread()
    previous = {name: getattr(thread, name, _UNSET) for name in ('loop', 'main_task')}
    thread.loop = asyncio.get_running_loop()  # type: ignore[attr-defined]
    thread.main_task = asyncio.current_task()  # type: ignore[attr-defined]
    try:
      return await coro
    finally:
      for name, value in previous.items():
        if value is _UNSET:
          try:
            delattr(thread, name)
          except AttributeError:
            pass
        else:
          setattr(thread, name, value)

  return _run_sync_via_new_loop(registered())


def _targets() -> list[seam.Target]:
  """0.12.8's ``_run_sync_via_new_loop``, else (0.12.4) ``run_sync``; and the loop runner where
  there is one. None required: an Orbax with neither keeps its own loops."""
  owner = lambda: _asyncio_utils  # pylint: disable=unnecessary-lambda-assignment
  if '_run_sync_via_new_loop' in vars(_asyncio_utils):
    runner = seam.Target(owner, '_run_sync_via_new_loop', lambda _: _run_sync_via_new_loop,
                         optional=True)
  else:
    runner = seam.Target(owner, 'run_sync', lambda _: _run_sync, optional=True)
  return [runner, seam.Target(owner, '_run_event_loop', lambda _: _run_event_loop,
                              optional=True)]


FEATURE = seam.Feature(
    'a failed Orbax call leaving no task behind in its closed event loop',
    'Orbax runs its coroutines on loops it makes and closes itself',
    _targets)


def install() -> None:
  seam.install(FEATURE)


def uninstall() -> None:
  seam.uninstall(FEATURE)


def installed() -> bool:
  return bool({'_run_sync_via_new_loop', 'run_sync'} & set(seam.originals(FEATURE)))
