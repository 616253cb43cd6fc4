"""Items cut into consecutive batches by size: pure arithmetic, no I/O.

Who calls it: ``transports/share.py`` (a host's writes, at most ``max_inflight_bytes`` handed
to tensorstore at once) and ``fleet/chain.py`` (a region's chunks filled by one thread up to
``GROUP_BYTES``), on the host that reads or writes.
"""

from __future__ import annotations

from typing import Sequence


def in_order(sizes: Sequence[int], limit: int | None) -> list[list[int]]:
  """The indices of ``sizes`` in order, cut so that each batch's sizes sum to at most
  ``limit`` (an item larger than ``limit`` forms a batch alone); one batch when there is no
  limit (None or 0); ``[]`` when there are no items."""
  if not limit:
    return [list(range(len(sizes)))] if sizes else []
  out: list[list[int]] = []
  total = 0
  for i, n in enumerate(sizes):
    if out and total + n <= limit:
      out[-1].append(i)
      total += n
    else:
      out.append([i])
      total = n
  return out
