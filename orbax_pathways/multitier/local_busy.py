"""Whether a local-only save due while the previous one still commits goes ahead, with
``Options.local_save_when_busy='skip'``: the manager's primary host decides for every process.

Who calls what, on which host: ``LocalStepHooks.save_declined`` (``multitier/local_steps.py``, in
the training loop's thread of every process that calls the manager) calls ``go(mngr, step,
busy)`` for each local-only step it would save in the background; ``busy`` says whether this
process's previous local-only save of ``mngr`` still runs.

- One process (or no key-value client): ``not busy``.
- Several (multi-controller JAX): one key-value round (``coord/rounds``). The manager's primary
  host publishes ``go`` or ``skip`` (``skip`` when its own previous save still runs: it makes
  the commit, so it is the last to be done), and every other process reads that one key. So
  every process skips the same steps and the hidden manager's barriers always meet; a process
  told ``go`` whose own previous save still runs waits for that save's writes and commits after
  it, as with ``'wait'``.
- A process that gets no verdict within ``VERDICT_WAIT_S`` (the primary host stopped calling
  ``save()``) skips the step with one warning.

Cost: one set on the primary host, one blocking read on every other process; nothing grows
with the fleet. The leader deletes the round of ``_KEEP`` local steps ago.
"""

from __future__ import annotations

import logging
from typing import Any

from orbax_pathways._compat import jax_distributed
from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways.coord import rounds

log = logging.getLogger('orbax_pathways')

VERDICT_WAIT_S = 300.0
_KEEP = 64  # rounds kept per manager's processes (a member reads its verdict long before)
GO, SKIP = 'go', 'skip'


def go(mngr: Any, step: int, busy: bool) -> bool:
  """Whether every process saves local-only step ``step`` now (see the module docstring)."""
  part = _oms.manager_participants(mngr)
  me, count = _oms.process_index(), jax_distributed.process_count()
  client = jax_distributed.distributed_client()
  if count <= 1 or client is None or part.size(count) <= 1 or not part.includes(me, count):
    return not busy
  leader = part.leader(count)
  seq = rounds.sequence(part.name('local_busy'), keep=_KEEP)
  rnd = rounds.Round(client, seq.next(), me=me, members=part.members(count), count=count,
                     what='orbax_pathways: the local-only save round', leader=leader)
  if me == leader:
    rnd.publish_verdict(SKIP if busy else GO)
    seq.retire(client, me, whole=True)
    return not busy
  try:
    return rnd.await_verdict(VERDICT_WAIT_S) == GO
  except rounds.PeerTimeoutError as e:
    log.warning('orbax_pathways: local-only step %d skipped: %s', step, e)
    return False
