"""Waits on other processes with one deadline, and an error that names who did not answer.

Called on every process of a multi-controller job by our key-value agreements
(``preemption/decision.py``: the preemption-step agreement; ``preemption/recovery.py``: the
resume agreement). ``client`` is jax's distributed client (``blocking_key_value_get``, ``key_value_try_get``); each process
publishes ``<prefix>/<process index>`` and every process reads all of them.

A plain loop of ``blocking_key_value_get(key, timeout)`` waits up to ``timeout`` per process
(n times the deadline when several are gone) and its error says only "timed out". ``gather``
waits for all of them against one deadline and, past it, raises ``PeerTimeoutError`` listing the
process indices whose key never appeared, so the operator knows which host to look at.
"""

from __future__ import annotations

import time
from typing import Any, Sequence


class PeerTimeoutError(TimeoutError):
  """Some processes did not answer before the deadline; ``missing`` lists their indices."""

  def __init__(self, message: str, missing: Sequence[int]):
    super().__init__(message)
    self.missing = tuple(missing)


def _try_get(client: Any, key: str) -> str | None:
  try:
    return client.key_value_try_get(key)
  except Exception:  # pylint: disable=broad-except  (NOT_FOUND: not published yet)
    return None


def gather(client: Any, prefix: str, num_processes: int, timeout_s: float, *,
           what: str, processes: Sequence[int] | None = None) -> list[str]:
  """The values every process published under ``<prefix>/<i>``, in process order, waiting at
  most ``timeout_s`` in all. ``processes``: the indices to wait for (default
  ``range(num_processes)``; ``num_processes`` is then only what the error says).
  Raises ``PeerTimeoutError`` naming the processes still missing."""
  ids = list(range(num_processes)) if processes is None else list(processes)
  deadline = time.monotonic() + timeout_s
  values: dict[int, str] = {}
  for i, p in enumerate(ids):
    remaining = deadline - time.monotonic()
    try:
      values[p] = client.blocking_key_value_get(f'{prefix}/{p}', max(1, int(remaining * 1000)))
    except Exception as e:  # pylint: disable=broad-except  (DEADLINE_EXCEEDED, or a dead service)
      for q in ids[i:]:
        v = _try_get(client, f'{prefix}/{q}')
        if v is not None:
          values[q] = v
      missing = [q for q in ids if q not in values]
      if not missing:  # all there after all (the error raced the last key)
        break
      shown = ', '.join(map(str, missing[:16])) + (' ...' if len(missing) > 16 else '')
      raise PeerTimeoutError(
          f'{what}: process(es) {shown} of {num_processes} did not answer within '
          f'{timeout_s:g}s (key prefix {prefix}; {type(e).__name__}: {e}). Those processes are '
          'gone, stuck, or not running the same code path: check their logs; every process must '
          'call CheckpointManager.should_save/save at every step.', missing) from e
  return [values[p] for p in ids]
