"""Which source serves each chunk of a restore region: pure planning, no I/O, no jax.

A restore reads chunk-aligned regions (``plan/restore.py``). With a source chain (this host's
node-local tier first, then other hosts' tiers, then a storage read shared by the hosts that need
the same lost chunk; storage always last), each chunk of a region comes from the first source
that holds it, and the chunks no source holds from storage. Called on the reading host by
``fleet/chain.py`` once per region; the I/O that follows it is the chain's.

A chunk no surviving tier holds but several processes need (state replicated across slices
whose writer was lost) is read from storage once: ``owners`` and ``needers`` say which
processes need it (from the target sharding, the same on every process), ``fetcher`` picks the
one that reads it (the same pick on every process), and the others get it from that process
(``fleet/relay.py``).

Sources are numbered by their place in the chain (0 first); ``STORAGE`` (-1) is storage.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Container, Iterable, Sequence

from orbax_pathways.plan import boxes as boxes_lib

Box = boxes_lib.Box
STORAGE = -1


@dataclasses.dataclass(frozen=True)
class RegionSources:
  """One region split by source: ``chunks`` are (source number, chunk box) for chunks a source
  holds, in chunk-grid order; ``storage`` the boxes read from storage (the whole region when no
  source holds any of its chunks, else each chunk no source holds)."""

  region: Box
  chunks: tuple[tuple[int, Box], ...]
  storage: tuple[Box, ...]

  def boxes_of(self, source: int) -> list[Box]:
    return [b for s, b in self.chunks if s == source]


def assign(region: Box, chunk_shape: Sequence[int] | None, global_shape: Sequence[int],
           held: Sequence[Container[tuple[int, ...]]]) -> RegionSources:
  """Splits ``region`` (chunk-aligned, in stored coordinates) among the sources: ``held[i]`` is
  the set of chunk origins source ``i`` holds. A region that is not made of whole chunks (no
  chunk grid, or a zero-size array) goes to storage whole."""
  if not held or chunk_shape is None or region.size == 0 or any(c <= 0 for c in chunk_shape):
    return RegionSources(region, (), (region,))
  chunks: list[tuple[int, Box]] = []
  rest: list[Box] = []
  for cell in boxes_lib.chunk_grid(region, chunk_shape):
    chunk = boxes_lib.clip(cell, global_shape)
    if not region.contains(chunk):  # a partial chunk: cannot be verified whole from a source
      return RegionSources(region, (), (region,))
    source = next((i for i, h in enumerate(held) if chunk.start in h), STORAGE)
    if source == STORAGE:
      rest.append(chunk)
    else:
      chunks.append((source, chunk))
  if not chunks:
    return RegionSources(region, (), (region,))
  return RegionSources(region, tuple(chunks), tuple(rest))


Owners = tuple[tuple[Box, frozenset[int]], ...]


def owners(boxes: Iterable[tuple[Box, int]]) -> Owners:
  """The distinct boxes of a sharding, each with the processes whose devices hold it, from
  (device box, device's process) pairs (every device of the sharding: the same on every
  process). One entry per distinct box: a replicated array has one, whatever the fleet."""
  held: dict[Box, set[int]] = {}
  for box, process in boxes:
    held.setdefault(box, set()).add(int(process))
  return tuple((b, frozenset(p)) for b, p in sorted(held.items(), key=lambda kv: kv[0].start))


def needers(chunk: Box, owned: Owners) -> frozenset[int]:
  """The processes whose devices need any element of ``chunk`` (stored coordinates)."""
  out: set[int] = set()
  for box, processes in owned:
    if box.intersect(chunk) is not None:
      out |= processes
  return frozenset(out)


def fetcher(key: str, candidates: Iterable[int]) -> int:
  """The one of ``candidates`` that reads the chunk named ``key`` from storage for all of them:
  a hash of the key (not Python's ``hash``, which differs per process), so every process picks
  the same one and the reads spread evenly over the candidates."""
  ordered = sorted(set(candidates))
  if not ordered:
    raise ValueError(f'no process to read {key} from storage')
  digest = hashlib.sha256(key.encode()).digest()
  return ordered[int.from_bytes(digest[:8], 'big') % len(ordered)]
