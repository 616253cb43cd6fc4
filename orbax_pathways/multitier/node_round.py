"""The resume's key-value round over node steps: which of them every process of a manager can
restore, and where the parts of those restored onto the current layout are.

Called by ``multitier/node_steps.resume`` on every process of the manager, once per resume
(``agreed``); ``node_gather.restore`` then asks ``Parts`` where each part it lacks is. The
values and the verdict are ``plan/node_verdict.py``'s (pure); this module is their I/O: jax's
key-value store (``coord/rounds.py``) and this node's peer server (``fleet/partner_copy.py``),
started where the node holds what another process may fetch.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping, Sequence

from orbax_pathways._compat import jax_distributed
from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways.coord import rounds
from orbax_pathways.fleet import partner_copy
from orbax_pathways.multitier import node_layout
from orbax_pathways.plan import node_verdict

log = logging.getLogger('orbax_pathways')


class Parts:
  """Where the parts of one node step restored onto the current layout are (``agreed``): per
  saving process, the process whose node holds its part and that server's address, read from
  the keys its holders published beside the round (one read per key looked up, remembered);
  ``first``: a saving process whose part some live node holds. A part may be held twice, as
  saved and as a partner's copy: ``__call__`` names the first, ``other`` the holder besides
  the one that served a part that failed."""

  def __init__(self, client: Any, round_key: str, step: int, first: int, me: int):
    self._client, self._key, self._step, self.first = client, round_key, step, first
    self._me = me
    self._found: dict[tuple[int, bool], tuple[int, str] | None] = {}

  def _holder(self, writer: int, copy: bool) -> tuple[int, str] | None:
    if (writer, copy) not in self._found:
      got = rounds.try_read(self._client,
                            rounds.node_part_key(self._key, self._step, writer, copy))
      who, _, address = (got or '').partition(' ')
      self._found[(writer, copy)] = (int(who), address) if who.isdigit() and address else None
    return self._found[(writer, copy)]

  def __call__(self, writer: int) -> tuple[int, str] | None:
    return self._holder(writer, False) or self._holder(writer, True)

  def other(self, writer: int, than: int | None) -> tuple[int, str] | None:
    """A holder of ``writer``'s part other than process ``than`` (None: this process, whose
    node's part failed), or None."""
    than = self._me if than is None else than
    return next((h for h in (self._holder(writer, True), self._holder(writer, False))
                 if h is not None and h[0] != than), None)


def agreed(mngr: Any, options: Any, held: list[int], copies: dict[int, list[int]],
            timeout_s: float, other: Sequence[int] = (),
            parts: Mapping[int, Sequence[int]] | None = None,
            counts: Mapping[int, int] | None = None, published: list[str] | None = None,
            copied: frozenset[tuple[int, int]] = frozenset(),
            ) -> tuple[list[int], dict[int, tuple[int, str]], dict[int, Parts]]:
  """The steps every process of ``mngr`` can restore, newest first; for this process the
  steps it must first fetch (step -> the process keeping its copy and that server's address);
  and the steps restored onto the current layout (step -> where their parts are, ``Parts``):
  one round (each member publishes its holdings, the leader the verdict, ``plan/node_verdict.decide``). A
  process whose node keeps copies, or holds parts that may be restored onto another layout
  (steps saved by another process count, or by another process), starts its server first
  (``partner_copy.ready``); for the latter it also publishes, before its holdings, a key per
  part its node holds (``rounds.node_part_key``: a few per process, whatever the fleet; those
  of ``copied``, (step, saving process) pairs, as partner copies), whose names it adds to
  ``published`` (the caller deletes them once every process is past the resume)."""
  client = jax_distributed.distributed_client()
  part = _oms.manager_participants(mngr)
  n, me = jax_distributed.process_count(), _oms.process_index()
  if client is None or n <= 1 or part.size(n) <= 1 or not part.includes(me, n):
    return sorted(set(held) | set(other), reverse=True), {}, {}
  address = ''
  # Steps saved by another process count or by another process, and steps whose layout this
  # node does not know (``parts`` without a count): their parts may be fetched by others.
  moved = ({s for s, c in (counts or {}).items() if c != n} | set(other)
           | {s for s in (parts or {}) if s not in (counts or {})})
  cfg = node_layout.tier(options, mngr) if copies or moved else None
  if cfg is not None:
    try:
      address = partner_copy.ready(cfg, client, me, options.tier_peer_timeout_s) or ''
    except Exception as e:  # pylint: disable=broad-except  (its copies are not offered)
      log.warning('orbax_pathways.preemption.resume: this node holds node steps of other '
                  'processes but cannot serve them (%s: %s).', type(e).__name__, e)
  seq = rounds.sequence(part.name('node_steps'), keep=1)
  key = seq.next()
  if address:
    for s in sorted(moved):
      for w in (parts or {}).get(s, ()):
        name = rounds.node_part_key(key, s, w, (s, w) in copied)
        rounds.put(client, name, f'{me} {address}')
        if published is not None:
          published.append(name)
  value = node_verdict.holdings(me, held, copies, address, other, parts, counts)
  verdict = json.loads(rounds.agree(
      client, seq, key, me=me, members=part.members(n), count=n, leader=part.leader(n),
      value=value, decide=node_verdict.decide, timeout_s=timeout_s,
      what=f'orbax_pathways: node steps every process can restore, {part.describe(n)}'))
  mine = {int(s): (int(who[str(me)][0]), str(who[str(me)][1]))
          for s, who in verdict['fetch'].items() if str(me) in who}
  elastic = {int(s): Parts(client, key, int(s), int(first), me)
             for s, first in verdict.get('elastic', {}).items()}
  return [int(s) for s in verdict['steps']], mine, elastic
