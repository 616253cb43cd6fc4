"""jax's real coordination service, with a job of many processes simulated around the one
process under test: what the package's key-value rounds ask of the service, counted.

Used by ``tests/coord/test_rounds.py`` and ``benchmarks/agreement_scale.py``, in the process
that runs them (the service is this process's own; jax's global state is left alone, so a test
process can run it beside other tests).

- ``Service``: the service and one client connected to it (``jax._src.distributed.State``,
  the class ``jax.distributed.initialize`` fills in, here a private instance: one process, bound
  to loopback, jax's preemption service off so no signal handler is installed).
- ``Fleet``: that client as process ``me`` of a job of ``n`` sees it. The other ``n - 1``
  processes cannot run here: the first time the process under test touches a round
  (``<round>/<process>``, ``<round>/verdict``, a directory read of ``<round>/``), their values
  are written into the service, uncounted (``value(round, process)``): at once, or ``late_s``
  later from a thread for the ``late`` ones, never for the ``silent`` ones; and the leader's
  verdict where one is given (``value(round, None)``). Every call of the process under test is
  counted by kind, with the values and bytes the service sent back.
- ``Counted``: the client counting calls (while ``counting``) with no simulated members: where
  one interpreter plays every process itself.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Callable, Iterable

from support import procs

LATE_S = 0.4


class Service(contextlib.AbstractContextManager):
  """jax's coordination service for one process on 127.0.0.1 and its connected ``client``."""

  def __init__(self) -> None:
    import jax  # pylint: disable=g-import-not-at-top
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
    port = procs.free_port()
    self._state = distributed.State()
    before = jax.config.jax_enable_preemption_service
    jax.config.update('jax_enable_preemption_service', False)
    try:
      self._state.initialize(f'127.0.0.1:{port}', num_processes=1, process_id=0,
                             cluster_detection_method='deactivate', initialization_timeout=60,
                             coordinator_bind_address=f'127.0.0.1:{port}')
    finally:
      jax.config.update('jax_enable_preemption_service', before)
    self.client = self._state.client

  def __exit__(self, *exc) -> None:
    self._state.shutdown()


class Counted:
  """A key-value client counting the calls made through it, by kind, while ``counting``; the
  values (and their bytes) the service sent back; ``requests()`` in all."""

  def __init__(self, client: Any) -> None:
    self.client = client
    self.calls: collections.Counter[str] = collections.Counter()
    self.values_read = 0  # the values this process was sent
    self.bytes_read = 0
    self.counting = True

  def _count(self, kind: str, found: Iterable[str] = ()) -> None:
    if self.counting:
      self.calls[kind] += 1
      for v in found:
        self.values_read += 1
        self.bytes_read += len(v)

  def _touch(self, key: str) -> None:
    """Called before each call with the key or prefix it names (``Fleet`` fills rounds)."""

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
    self._touch(key)
    self._count('set')
    self.client.key_value_set(key, value, allow_overwrite=allow_overwrite)

  def key_value_try_get(self, key: str) -> str:
    self._touch(key)
    try:
      found = self.client.key_value_try_get(key)
    except Exception:
      self._count('try_get')
      raise
    self._count('try_get', [found])
    return found

  def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
    self._touch(key)
    try:
      found = self.client.blocking_key_value_get(key, timeout_ms)
    except Exception:
      self._count('blocking_get')
      raise
    self._count('blocking_get', [found])
    return found

  def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
    self._touch(prefix)
    found = self.client.key_value_dir_get(prefix)
    self._count('dir_get', [v for _, v in found])
    return found

  def key_value_delete(self, key: str) -> None:
    self._count('delete')
    self.client.key_value_delete(key)

  def requests(self) -> int:
    return sum(self.calls.values())

  def keys(self, prefix: str) -> list[str]:
    """The keys under ``prefix`` now (uncounted: the test's look, not the process's)."""
    return sorted(k for k, _ in self.client.key_value_dir_get(prefix))


class Fleet(Counted):
  """The client as process ``me`` of ``n`` sees it (module docstring). ``verdict``: the
  leader's verdict as a value (``None``: the process under test is the leader, or no verdict);
  ``value(round, process)`` the value a process publishes in a round; ``fill_s`` the seconds
  spent writing the simulated processes' keys (not the process under test's)."""

  def __init__(self, client: Any, me: int, n: int, value: Callable[[str, int], str], *,
               late: Iterable[int] = (), silent: Iterable[int] = (),
               verdict: str | Callable[[str], str] | None = None, late_s: float = LATE_S):
    super().__init__(client)
    self.me, self.n, self.value = me, n, value
    self.late, self.silent = set(late), set(silent)
    self.verdict = verdict
    self.late_s = late_s
    self.fill_s = 0.0
    self._filled: set[str] = set()
    self._timers: list[threading.Timer] = []

  @staticmethod
  def round_of(key: str) -> str | None:
    """The round a key or directory prefix names (``<round>/<process>``, ``<round>/verdict``,
    ``<round>/progress``, ``<round>/``), else None (a key beside the rounds)."""
    if key.endswith('/'):
      return key.rstrip('/')
    head, _, last = key.rpartition('/')
    return head if last.isdigit() or last in ('verdict', 'progress') else None

  def _touch(self, key: str) -> None:
    rnd = self.round_of(key)
    if rnd is None or rnd in self._filled or '.parts/' in rnd:
      return
    began = time.perf_counter()
    self._filled.add(rnd)
    on_time = [p for p in range(self.n)
               if p != self.me and p not in self.silent and p not in self.late]
    for p in on_time:
      self.client.key_value_set(f'{rnd}/{p}', self.value(rnd, p), allow_overwrite=True)
    if self.verdict is not None:
      verdict = self.verdict if isinstance(self.verdict, str) else self.verdict(rnd)
      self.client.key_value_set(f'{rnd}/verdict', verdict, allow_overwrite=True)
    late = sorted(self.late - self.silent - {self.me})
    if late:
      def publish() -> None:
        for p in late:
          self.client.key_value_set(f'{rnd}/{p}', self.value(rnd, p), allow_overwrite=True)
      timer = threading.Timer(self.late_s, publish)
      timer.daemon = True
      timer.start()
      self._timers.append(timer)
    self.fill_s += time.perf_counter() - began

  def settle(self) -> None:
    """Waits for the late processes' values to be written (before the service goes)."""
    for t in self._timers:
      t.join()


def as_process(fleet: Any, monkeypatch: Any = None) -> None:
  """Makes this interpreter process ``fleet.me`` of ``fleet.n`` with ``fleet`` as its
  key-value client, where the package reads them (``_compat``); through ``monkeypatch`` where
  given (undone after the test)."""
  from orbax_pathways._compat import jax_distributed  # pylint: disable=g-import-not-at-top
  from orbax_pathways._compat import orbax_manager_state as _oms  # pylint: disable=g-import-not-at-top
  for target, name, value in ((jax_distributed, 'distributed_client', lambda: fleet),
                              (jax_distributed, 'process_count', lambda: fleet.n),
                              (_oms, 'process_index', lambda: fleet.me)):
    if monkeypatch is not None:
      monkeypatch.setattr(target, name, value)
    else:
      setattr(target, name, value)
