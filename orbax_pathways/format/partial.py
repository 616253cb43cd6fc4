"""The parts of an Orbax v1 partial save joined into one item's records and index.

Who calls it: ``storage/index.merge_pending`` (the primary host, in ``ocp.v1.partial.finalize``).
Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from orbax_pathways.format.item import ItemMetadata, summary
from orbax_pathways.format.records import ArrayRecord, WriterRecord

#
# An Orbax v1 partial save (``ocp.v1.partial.save`` called several times, then ``finalize``)
# writes each call's arrays into a pending directory of its own, each with the same writer's
# record (``p0.msgpack``) or, under the colocated transport, its own index. Finalize joins them
# (``storage/index.merge_pending``): later parts win for an array saved twice (as Orbax's own
# metadata merge does), and joining a part that is already in is a no-op, so a retried finalize
# gives the same files.


def _adds(have: Mapping[str, ArrayRecord], new: Iterable[ArrayRecord]) -> bool:
  return any(have.get(a.name) != a for a in new)


def _sum_stats(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, int]:
  return {k: int(a.get(k) or 0) + int(b.get(k) or 0) for k in sorted({*a, *b})}


def join_records(have: WriterRecord, new: WriterRecord) -> WriterRecord:
  """One writer's record of two parts of a partial save: ``have``'s arrays, then ``new``'s
  (``new`` wins for a name in both), stats added up. Returns ``have`` itself if ``new`` adds
  nothing (joined before: a retried finalize)."""
  if have.writer != new.writer:
    raise ValueError(f'cannot join the records of writers {have.writer!r} and {new.writer!r}')
  if not _adds({a.name: a for a in have.arrays}, new.arrays):
    return have
  names = {a.name for a in new.arrays}
  return dataclasses.replace(
      new, arrays=tuple(a for a in have.arrays if a.name not in names) + tuple(new.arrays),
      stats=_sum_stats(have.stats, new.stats))


def join_indexes(have: ItemMetadata, new: ItemMetadata) -> ItemMetadata:
  """The index of two parts of a partial save (each an index, or records to index): every
  array of both (``new`` wins for a name in both), one summary per writer with its stats added
  up. Returns ``have`` itself if ``new`` adds nothing (no array or writer it lacks)."""
  arrays = have.arrays()
  known = {w.writer for w in have.writers}
  if not _adds(arrays, new.arrays().values()) and all(w.writer in known for w in new.writers):
    return have
  arrays.update(new.arrays())
  writers = {w.writer: summary(w) for w in have.writers}
  for w in new.writers:
    old = writers.get(w.writer)
    writers[w.writer] = summary(w) if old is None else dataclasses.replace(
        summary(w), stats=_sum_stats(old.stats, w.stats))
  return ItemMetadata(tuple(writers[k] for k in sorted(writers)),
                      tuple(arrays[k] for k in sorted(arrays)), source='index')
