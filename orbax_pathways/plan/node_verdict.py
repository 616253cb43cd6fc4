"""The node steps round's arithmetic (pure): what each member of a resume says its node holds,
and the leader's verdict on which node steps every member can restore, and how.

Called on every process of a resume by ``multitier/node_round.agreed`` (``holdings``: the
value it publishes) and on the round's leader through ``coord/rounds.agree`` (``decide``). No
I/O: a member's value and the verdict are compact JSON strings that grow with the steps and
parts a node holds, not with the fleet (the leader reads one value per member).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence


def holdings(me: int, own: list[int], copies: dict[int, list[int]], address: str,
             other: Sequence[int] = (), parts: Mapping[int, Sequence[int]] | None = None,
             counts: Mapping[int, int] | None = None) -> str:
  """A member's value in the node steps round: its process, the steps its node holds of its
  own, the copies it keeps (process -> steps), its server's address, the steps its node
  holds that another process saved (``multitier/node_steps._others``: restorable by this
  process where they hold what it needs now), and per step the parts its node holds
  (``parts``: the saving processes, own, others' and copies) and how many processes saved it
  (``counts``) (JSON)."""
  value: dict[str, Any] = {'p': me, 'own': sorted(own), 'addr': address,
                           'copies': {str(q): v for q, v in copies.items()},
                           'other': sorted(other)}
  if parts:  # the common case (the same processes on the same nodes) leaves them out
    value['parts'] = {str(s): sorted(w) for s, w in parts.items()}
  if counts:
    value['n'] = {str(s): c for s, c in counts.items()}
  return json.dumps(value, separators=(',', ':'))


def decide(values: list[str]) -> str:
  """The leader's verdict on the members' holdings (JSON, one per member: ``p``, its ``own``
  steps, the ``copies`` it keeps by process, its server's ``addr``, the ``other`` steps its
  node holds, the ``parts`` of each step its node holds and the step's saving process count
  ``n``): the steps every member can restore, newest first, and how.

  A step saved by as many processes as the job has now is restored as it was saved, each
  member its own part from its node, or from the node keeping its copy (``fetch``: fetched
  first). A step saved by another process count, or one some member would take from a step
  another process saved on its node (``other``), is restored onto the current layout
  (``elastic``: the lowest saving process whose part a live node holds, where a process whose
  node holds none reads the step's metadata; ``node_gather.py``). Who holds each part the
  members say beside the round (``multitier/node_round.agreed``), so the verdict stays the same size at any fleet.
  A process that needs a part no live node holds fails its restore before it fetches
  anything, and every process passes the step over (a state whole in every slice needs one
  slice's parts only). A step whose layout no member knows (saved before the parts recorded
  it) is tried as it was saved, or from the step another process saved on a member's node
  (``other``)."""
  held = [json.loads(v) for v in values]
  own = {int(v['p']): set(v['own']) for v in held}
  other = {int(v['p']): set(v.get('other', ())) for v in held}
  keepers: dict[tuple[int, int], tuple[int, str]] = {}
  holders: dict[int, dict[int, tuple[int, str]]] = {}
  counts: dict[int, int] = {}
  for v in held:
    p, addr = int(v['p']), v.get('addr') or ''
    for q, steps in v.get('copies', {}).items():
      for s in steps:
        if addr and int(q) != p:
          keepers.setdefault((int(q), s), (p, addr))
    for s, writers in v.get('parts', {}).items():
      for w in writers:
        got = holders.setdefault(int(s), {}).get(int(w))
        if got is None or (addr and not got[1]):
          holders[int(s)][int(w)] = (p, addr)
    for s, c in v.get('n', {}).items():
      counts.setdefault(int(s), int(c))
  steps, fetch, elastic = [], {}, {}
  for s in sorted(set().union(*own.values(), *other.values(), (s for _, s in keepers),
                              holders), reverse=True):
    lacking = [q for q in sorted(own) if s not in own[q]]
    plain = all((q, s) in keepers or s in other[q] for q in lacking)
    as_saved = counts.get(s, len(own)) == len(own) and all((q, s) in keepers for q in lacking)
    if s in counts and not as_saved and holders.get(s):
      steps.append(s)
      served = sorted(w for w, h in holders[s].items() if w < counts[s] and h[1])
      elastic[str(s)] = served[0] if served else min(holders[s])
    elif plain:
      steps.append(s)
      fetched = {str(q): list(keepers[(q, s)]) for q in lacking if (q, s) in keepers}
      if fetched:
        fetch[str(s)] = fetched
  return json.dumps({'steps': steps, 'fetch': fetch, 'elastic': elastic},
                    separators=(',', ':'))
