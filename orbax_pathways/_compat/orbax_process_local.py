"""A save of one process alone, beside the job's own saves: Orbax's operation ids and its
signalling client in a namespace of that save while it runs.

SUPPORTED: orbax-checkpoint ``supported.ORBAX`` (written against 0.12.8; the targets are the same
in 0.12.4).

Why: Orbax numbers each save of a process from one process-wide counter
(``OperationIdGenerator``) and names the key-value signals of the save's asynchronous commit
after it (``AwaitableSignalsContract``: the step and item directories' creation, the commit's
barriers). Every process of a job saves the same steps, so their counters agree. A save that
one process makes alone (a ``CheckpointManager`` with ``active_processes={process}``, into a
directory on its node) and that drew from that counter would shift every later save of the job
on that process only: the next storage save's signals would no longer meet the other
processes'. Orbax's emergency manager avoids it by making every process of the job take part in
each local save, with barriers; a local save that needs nothing but its node cannot.

``alone(process)``: a context manager. Inside it, and inside the commit threads Orbax starts from
it (``_SignalingThread``: a plain thread, which would not inherit context variables):

- ``OperationIdGenerator`` counts in a namespace of its own: ids ``alone-<process>-<n>``, never
  one of the job's;
- ``signaling_client.get_signaling_client()`` is a client of that namespace (Orbax's in-process
  ``ThreadSafeKeyValueSignalingClient``: the save has no other process to signal).

Outside it, and for every thread not started from it, all of these are Orbax's own, unchanged.

Patched (``install()`` / ``uninstall()``, idempotent; every target is checked before any is
replaced, and a missing one leaves Orbax untouched and ``alone()`` unavailable):
``OperationIdGenerator.next_operation_id``, ``OperationIdGenerator.get_current_operation_id``,
``signaling_client.get_signaling_client`` and ``_SignalingThread.__init__``.

Who calls it: a save of one process alone, on that process (``tests/multiprocess/
test_process_alone.py`` saves through a per-process manager beside the job's storage manager).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
from typing import Any, Callable, Iterator

from orbax_pathways._compat import seam
from orbax_pathways._compat import src

_sync = src.orbax('futures.synchronization')
_future = src.orbax('futures.future')
_signaling_client = src.orbax('futures.signaling_client')


@dataclasses.dataclass
class _Namespace:
  """The operation ids and signals of the saves made inside one ``alone()``."""

  prefix: str
  counter: Iterator[int]
  current: str
  client: Any


_namespace: contextvars.ContextVar[_Namespace | None] = contextvars.ContextVar(
    'orbax_pathways_alone', default=None)
def missing() -> list[str]:
  """The targets this Orbax lacks (empty: ``alone()`` can be used)."""
  return seam.resolve(FEATURE)[1]


def _next_operation_id(original: Callable[[], Any]) -> Callable[[], Any]:
  def next_operation_id():
    ns = _namespace.get()
    if ns is None:
      return original()
    ns.current = f'{ns.prefix}-{next(ns.counter)}'
    return ns.current
  return next_operation_id


def _get_current_operation_id(original: Callable[[], str]) -> Callable[[], str]:
  def get_current_operation_id():
    ns = _namespace.get()
    return original() if ns is None else ns.current
  return get_current_operation_id


def _get_signaling_client(original: Callable[[], Any]) -> Callable[[], Any]:
  @functools.wraps(original)
  def get_signaling_client():
    ns = _namespace.get()
    return original() if ns is None else ns.client
  return get_signaling_client


def _signaling_thread_init(original: Callable[..., None]) -> Callable[..., None]:
  @functools.wraps(original)
  def __init__(self, *args, **kwargs):
    original(self, *args, **kwargs)
    if _namespace.get() is None:
      return
    # Orbax's run() waits for and sends the signals, and runs the target, in the new thread:
    # all three run in this thread's context (the namespace), as instance attributes that
    # shadow the class's methods for this thread only.
    context = contextvars.copy_context()
    cls = type(self)
    self._wait_for_signals = functools.partial(context.run, cls._wait_for_signals, self)
    self._set_signals = functools.partial(context.run, cls._set_signals, self)
    target = self._target
    self._target = functools.partial(context.run, target)
  return __init__


def _on_class(wrap: Callable[[Callable[[], Any]], Callable[[], Any]]) -> Callable[[Any], Any]:
  """A wrapper of ``OperationIdGenerator``'s method, a classmethod taking no argument but the
  class (or a plain function, as the wrappers take it)."""
  def replace(original: Any) -> Any:
    if not isinstance(original, classmethod):
      return wrap(original)
    wrapped = wrap(functools.partial(original.__func__, _sync.OperationIdGenerator))
    return classmethod(lambda cls: wrapped())
  return replace


FEATURE = seam.Feature(
    'node steps: a save of one process alone, with operation ids and signals of its own',
    'Orbax numbers its saves and signals with process-wide state and no scope',
    lambda: [seam.Target(lambda: _sync.OperationIdGenerator, 'next_operation_id',
                         _on_class(_next_operation_id)),
             seam.Target(lambda: _sync.OperationIdGenerator, 'get_current_operation_id',
                         _on_class(_get_current_operation_id)),
             seam.Target(lambda: _signaling_client, 'get_signaling_client',
                         _get_signaling_client),
             seam.Target(lambda: _future._SignalingThread, '__init__',  # pylint: disable=protected-access
                         _signaling_thread_init)])


def install() -> bool:
  """Replaces the targets (idempotent); False, and nothing replaced, when one is missing (one
  warning: node steps are then off)."""
  return seam.install(FEATURE)


def uninstall() -> None:
  """Puts Orbax's own targets back (idempotent)."""
  seam.uninstall(FEATURE)


def installed() -> bool:
  return seam.installed(FEATURE)


def job_operation_id() -> str:
  """The job's current Orbax operation id (outside any ``alone()``): every process of the job
  must hold the same one at the same save, since Orbax names the save's signals after it."""
  token = _namespace.set(None)
  try:
    return str(_sync.OperationIdGenerator.get_current_operation_id())
  finally:
    _namespace.reset(token)


@contextlib.contextmanager
def alone(process: int) -> Iterator[None]:
  """The saves made inside (on this thread, and in the commit threads Orbax starts from it)
  use operation ids and signals of their own (module docstring). Raises ``RuntimeError`` naming
  the missing targets when this Orbax lacks one."""
  if not install():
    raise RuntimeError(
        'orbax_pathways: a save of one process alone needs Orbax attributes this '
        f'orbax-checkpoint lacks ({", ".join(missing())}); install a supported version.')
  ns = _Namespace(prefix=f'alone-{process}', counter=itertools.count(1),
                  current=f'alone-{process}-0',
                  client=_signaling_client.ThreadSafeKeyValueSignalingClient())
  token = _namespace.set(ns)
  try:
    yield
  finally:
    _namespace.reset(token)
