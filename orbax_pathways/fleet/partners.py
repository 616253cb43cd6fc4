"""Who keeps a second copy of whose local-only share (``Options.local_copies=2``): pure
arithmetic over the processes' slices, no I/O.

Called on every process of a multi-controller save by ``fleet/partner_copy.py`` (the slices come
from ``sharding/layout.slice_of_devices``: TPU's ``slice_index``, else ``num_slices``, else one
slice per process). The rule: a process sends its share to the process of the same rank in the
next slice (slices in index order, wrapping; the rank modulo that slice's size), so a share and
its copy are never in one slice, and losing any one slice never loses both copies of a chunk.
Each process sends to one partner and, with slices of equal size, receives from one.
"""

from __future__ import annotations

from typing import Mapping


def partner_of(process: int, slice_of: Mapping[int, int]) -> int | None:
  """The process that keeps ``process``'s second copy, or None when there is no other slice
  (the copy would share the slice's fate). ``slice_of``: process index -> its slice."""
  if process not in slice_of:
    raise ValueError(f'process {process} is not among the processes {sorted(slice_of)[:8]}...')
  members: dict[int, list[int]] = {}
  for p, s in slice_of.items():
    members.setdefault(s, []).append(p)
  order = sorted(members)
  if len(order) < 2:
    return None
  mine = slice_of[process]
  rank = sorted(members[mine]).index(process)
  nxt = sorted(members[order[(order.index(mine) + 1) % len(order)]])
  return nxt[rank % len(nxt)]

