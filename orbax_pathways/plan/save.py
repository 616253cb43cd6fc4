"""Who writes which box of an array, and the chunk grid it is stored with. Pure; no jax.

Called on every host (controller or process) with the same global description, so every host
derives the same plan and each then executes only the writes assigned to it. The planning is
numpy over the distinct shards of a ``shards.ShardTable``; the plan keeps its writes as arrays
and builds ``ShardWrite`` objects only for the hosts that ask (``ArrayWritePlan.for_host``).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import itertools
import math
from typing import Any, Iterable, Iterator, Sequence, cast

import numpy as np

from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import shards as shards_lib

Box = boxes_lib.Box


@dataclasses.dataclass(frozen=True)
class Placement:
  """One device's shard of an array: the device, the host that can write it, the box it holds."""

  device_id: int
  host: str
  box: Box


@dataclasses.dataclass(frozen=True)
class Source:
  """Where a write's bytes come from: the shard ``shard_box`` held on device ``device_id``."""

  device_id: int
  shard_box: Box


@dataclasses.dataclass(frozen=True)
class ShardWrite:
  """``host`` writes ``box``, gathered from ``sources`` (all on devices of ``host``).

  One source: a whole shard, or a replica-split piece of it (``box`` inside its shard box).
  Several sources: whole shards that tile ``box`` exactly (a coalesced small array).
  """

  host: str
  box: Box
  sources: tuple[Source, ...]


def _box(start: Sequence[int], stop: Sequence[int]) -> Box:
  return Box(tuple(start), tuple(stop))


class WriteTable(collections.abc.Sequence):
  """A plan's writes, in plan order, as arrays: a read-only sequence of ``ShardWrite``.

  Each ``ShardWrite`` is built the first time it is read and then kept, so a host that asks for
  its own writes (``for_host``) never pays for the other hosts' thousands. Compares equal to any
  sequence of the same writes; pickles as its arrays (the colocated transport ships plans).
  """

  def __init__(self, hosts: tuple[str, ...], host: np.ndarray, start: np.ndarray,
               stop: np.ndarray, *, device: np.ndarray | None = None,
               shard_start: np.ndarray | None = None, shard_stop: np.ndarray | None = None,
               items: Sequence[ShardWrite] | None = None,
               host_index: dict[str, int] | None = None):
    self.hosts = hosts
    self.host, self.start, self.stop = host, start, stop
    # Single-source writes: the source device and its shard box (``None``: the write's own box).
    self._device, self._shard_start, self._shard_stop = device, shard_start, shard_stop
    self._items: list[ShardWrite | None] = list(items) if items is not None else [None] * len(host)
    self._host_index = host_index
    self._by_host: dict[int, np.ndarray] | None = None
    self._asked: int | None = None

  @classmethod
  def of(cls, writes: Sequence[ShardWrite]) -> 'WriteTable':
    """From ``ShardWrite`` objects (any number of sources each)."""
    writes = list(writes)
    host, hosts = shards_lib.intern_hosts([w.host for w in writes])
    ndim = writes[0].box.ndim if writes else 0
    start = np.asarray([w.box.start for w in writes], dtype=np.int64).reshape(len(writes), ndim)
    stop = np.asarray([w.box.stop for w in writes], dtype=np.int64).reshape(len(writes), ndim)
    return cls(hosts, host, start, stop, items=writes)

  def __len__(self) -> int:
    return len(self.host)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return tuple(self[j] for j in range(*i.indices(len(self))))
    w = self._items[i]
    if w is None:
      if i < 0:
        i += len(self)
      w = self._build(np.asarray([i]))[0]
    return w

  def __iter__(self) -> Iterator[ShardWrite]:
    missing = np.asarray([i for i, w in enumerate(self._items) if w is None], dtype=np.int64)
    if len(missing):
      self._build(missing)
    return iter(cast('list[ShardWrite]', self._items))  # every item is built now

  def _build(self, idx: np.ndarray) -> list[ShardWrite]:
    """Builds (and keeps) the writes at ``idx``."""
    # Only a table of arrays (``device`` given, ``items`` not) has writes still to build.
    assert self._device is not None, 'WriteTable without device arrays has every write built'
    out = []
    start, stop = self.start[idx].tolist(), self.stop[idx].tolist()
    device = self._device[idx].tolist()
    shard_start, shard_stop = self._shard_start, self._shard_stop  # both given, or neither
    shards: Iterable[tuple[Any, Any] | None] = (
        zip(shard_start[idx].tolist(), shard_stop[idx].tolist())
        if shard_start is not None and shard_stop is not None else itertools.repeat(None))
    for i, h, a, b, d, s in zip(idx.tolist(), self.host[idx].tolist(), start, stop, device, shards):
      box = _box(a, b)
      w = ShardWrite(self.hosts[h], box, (Source(d, box if s is None else _box(*s)),))
      self._items[i] = w
      out.append(w)
    return out

  def indices_for(self, host: str) -> np.ndarray:
    """Positions of ``host``'s writes, in plan order. One host asking costs one pass over the
    plan; once a second host asks (a controller serving many hosts), an index is built."""
    if self._host_index is None:
      self._host_index = {h: i for i, h in enumerate(self.hosts)}
    h = self._host_index.get(host)
    if h is None:
      return np.zeros(0, dtype=np.int64)
    if self._by_host is None:
      if self._asked is None or self._asked == h:
        self._asked = h
        return np.flatnonzero(self.host == h)
      order = np.argsort(self.host, kind='stable')
      bounds = np.searchsorted(self.host[order], np.arange(len(self.hosts) + 1))
      self._by_host = {k: order[bounds[k]:bounds[k + 1]] for k in range(len(self.hosts))}
    return self._by_host[h]

  def for_host(self, host: str) -> tuple[ShardWrite, ...]:
    idx = self.indices_for(host)
    missing = np.asarray([i for i in idx.tolist() if self._items[i] is None], dtype=np.int64)
    if len(missing):
      self._build(missing)
    return tuple(self._items[i] for i in idx.tolist())

  def bytes_by_host(self, itemsize: int) -> dict[str, int]:
    """Bytes each host writes, hosts in order of their first write."""
    if not len(self):
      return {}
    size = np.prod(self.stop - self.start, axis=1, dtype=np.int64)
    total = np.zeros(len(self.hosts), dtype=np.int64)
    np.add.at(total, self.host, size)
    _, first = np.unique(self.host, return_index=True)
    order = self.host[np.sort(first)]
    return {self.hosts[h]: int(total[h]) * itemsize for h in order.tolist()}

  def __eq__(self, other) -> bool:
    if not isinstance(other, collections.abc.Sequence) or isinstance(other, str):
      return NotImplemented
    return len(self) == len(other) and all(a == b for a, b in zip(self, other))

  def __hash__(self) -> int:
    return hash(tuple(self))

  def __repr__(self) -> str:
    if len(self) <= 8:
      return repr(tuple(self))
    return f'WriteTable({len(self)} writes by {len(set(self.host.tolist()))} hosts)'

  def __getstate__(self):
    state = dict(self.__dict__, _by_host=None, _asked=None, _host_index=None)
    if self._device is not None:  # rebuilt on demand from the arrays
      state['_items'] = [None] * len(self)
    return state


@dataclasses.dataclass(frozen=True)
class ArrayWritePlan:
  """One array's writes (plan order: by shard box, then replica piece) and its chunk grid.

  Hosts read their share with ``for_host``; ``writes`` is the whole sequence (a ``WriteTable``).
  """

  global_shape: tuple[int, ...]
  chunk_shape: tuple[int, ...]
  writes: WriteTable  # any sequence of ShardWrite is accepted and wrapped

  def __post_init__(self):
    if not isinstance(self.writes, WriteTable):
      object.__setattr__(self, 'writes', WriteTable.of(self.writes))

  def for_host(self, host: str) -> tuple[ShardWrite, ...]:
    """``host``'s writes in plan order, without building the other hosts' writes."""
    return self.writes.for_host(host)

  def chunks(self, write: ShardWrite) -> list[Box]:
    """The chunks ``write`` covers (the plan guarantees they tile it exactly), clipped."""
    return [boxes_lib.clip(c, self.global_shape)
            for c in boxes_lib.chunk_grid(write.box, self.chunk_shape)]

  def bytes_by_host(self, itemsize: int) -> dict[str, int]:
    return self.writes.bytes_by_host(itemsize)


def _split_axis(shape: Sequence[int], parts: int) -> int | None:
  for axis, d in enumerate(shape):
    if d % parts == 0 and d >= parts:
      return axis
  return None


def plan_array_writes(
    global_shape: Sequence[int],
    itemsize: int,
    placements: Sequence[Placement],
    *,
    max_chunk_bytes: int,
    replica_parallel: bool = True,
    min_split_bytes: int = 1 << 20,
    coalesce_bytes: int = 0,
) -> ArrayWritePlan:
  """The plan for explicit placements (first holders in the order given); see ``plan_shards``."""
  global_shape = tuple(int(d) for d in global_shape)
  table = shards_lib.from_boxes(
      global_shape, [p.device_id for p in placements], [p.host for p in placements],
      [p.box.start for p in placements], [p.box.stop for p in placements])
  return plan_shards(table, itemsize, max_chunk_bytes=max_chunk_bytes,
                     replica_parallel=replica_parallel, min_split_bytes=min_split_bytes,
                     coalesce_bytes=coalesce_bytes)


def plan_shards(
    table: shards_lib.ShardTable,
    itemsize: int,
    *,
    max_chunk_bytes: int,
    replica_parallel: bool = True,
    min_split_bytes: int = 1 << 20,
    max_replicas: int | None = None,
    coalesce_bytes: int = 0,
    split_axes: Sequence[int] | None = None,
) -> ArrayWritePlan:
  """Each distinct shard is written exactly once.

  Without replica splitting, the first holder of a box writes it, which matches Orbax's
  replica 0 (``sharding/layout.py`` orders holders by device id). With ``replica_parallel`` and a shard
  held on R >= 2 distinct hosts (the minimum over shards), the shard is cut into R equal pieces
  along its first axis divisible by R, each written by a different host (its first R hosts),
  when a piece is at least ``min_split_bytes``.
  An array of at most ``coalesce_bytes`` (and ``max_chunk_bytes``) whose shards tile it evenly
  is instead written in as few writes (and chunks) as possible: each write gathers the adjacent
  shards that one host holds (see ``coalesced_writes``), so a small array sharded over 8 devices
  of one host is one chunk, not 8.
  The chunk shape divides every piece and every piece start, so no chunk has two writers.
  """
  global_shape = table.global_shape
  h = table.holders
  num = h.num_shards
  sizes = table.stop - table.start
  parts = int(h.count.min()) if num else 1
  if max_replicas is not None:
    parts = max(1, min(parts, int(max_replicas)))
  axis = None
  if replica_parallel and parts > 1 and num and bool((sizes == sizes[0]).all()):
    shard_shape = tuple(sizes[0].tolist())
    axis = _split_axis(shard_shape, parts)
    if axis is not None and math.prod(shard_shape) * itemsize // parts < min_split_bytes:
      axis = None

  writes = None
  if axis is None and math.prod(global_shape) * itemsize <= min(coalesce_bytes, max_chunk_bytes):
    coalesced = coalesced_writes(table)
    writes = WriteTable.of(coalesced) if coalesced is not None else None
  if writes is None:
    if axis is None:  # the first holder writes the whole shard
      pick = h.rank == 0
      writes = WriteTable(h.hosts, h.host[pick], table.start, table.stop, device=h.device[pick],
                          host_index=h.host_index)
    else:  # pieces 0..parts-1 of each shard, by its first ``parts`` hosts
      pick = np.flatnonzero(h.rank < parts)
      shard, rank = h.shard[pick], h.rank[pick]
      step = int(sizes[0, axis]) // parts
      start, stop = table.start[shard], table.stop[shard]
      start[:, axis] += rank * step
      stop[:, axis] = start[:, axis] + step
      writes = WriteTable(h.hosts, h.host[pick], start, stop, device=h.device[pick],
                          shard_start=table.start[shard], shard_stop=table.stop[shard],
                          host_index=h.host_index)
  return ArrayWritePlan(
      global_shape, _chunk_shape(global_shape, writes, itemsize, max_chunk_bytes, split_axes),
      writes)


def _chunk_shape(global_shape: tuple[int, ...], writes: WriteTable, itemsize: int,
                 max_chunk_bytes: int, split_axes: Sequence[int] | None = None) -> tuple[int, ...]:
  """One regular chunk grid for the whole array: it divides every piece and start offset."""
  grid = []
  for dim in range(len(global_shape)):
    g = int(np.gcd.reduce(np.concatenate([writes.start[:, dim], writes.stop[:, dim]]))) \
        if len(writes) else 0  # gcd(start, stop) == gcd(start, stop - start)
    grid.append(g or max(1, global_shape[dim]))
  return boxes_lib.choose_chunk_shape(tuple(grid), itemsize, max_chunk_bytes,
                                     split_axes=split_axes)


MAX_COALESCE_SHARDS = 256  # beyond this many shards the search is not worth it for a small array


def coalesced_writes(table: shards_lib.ShardTable) -> list[ShardWrite] | None:
  """The fewest equal blocks of whole shards such that one host holds every shard of a block.

  Applies when the distinct shards have one shape and tile the array (even sharding); returns
  None otherwise, or when there is nothing to gather. Blocks are tried from the whole array
  down (fewest blocks first), so with every shard on one host (one process, or one Pathways
  worker) the array becomes a single write; across hosts, each host's contiguous share does.
  A block's writer is the first host, in holder order of its first shard, that holds them all.
  """
  global_shape, num = table.global_shape, table.holders.num_shards
  if num < 2 or num > MAX_COALESCE_SHARDS or not global_shape:
    return None
  sizes = table.stop - table.start
  shard = tuple(sizes[0].tolist())
  if (0 in shard or not bool((sizes == sizes[0]).all())
      or any(d % s for d, s in zip(global_shape, shard))
      or num * math.prod(shard) != math.prod(global_shape)):
    return None
  counts = tuple(d // s for d, s in zip(global_shape, shard))
  at = {tuple(p): i for i, p in enumerate((table.start // np.asarray(shard)).tolist())}
  if len(at) != num:
    return None
  h = table.holders
  held = np.zeros((num, len(h.hosts)), dtype=bool)  # shard x host
  held[h.shard, h.host] = True
  first = np.cumsum(h.count) - h.count  # each shard's first pair (pairs are in holder order)

  def pairs(m: int) -> slice:
    return slice(first[m], first[m] + h.count[m])

  candidates = sorted(itertools.product(*(boxes_lib.divisors(c) for c in counts)),
                      key=lambda k: (math.prod(c // f for c, f in zip(counts, k)), k[::-1]))
  for block in candidates:
    if math.prod(block) == 1:
      return None  # every block a single shard: the plain plan is the same
    found = _blocks(block, counts, shard, at, held, lambda m: h.host[pairs(m)])
    if found is None:
      continue
    boxes = [_box(a, b) for a, b in zip(table.start.tolist(), table.stop.tolist())]
    out = []
    for host, start, stop, members in found:
      sources = tuple(Source(int(h.device[pairs(m)][h.host[pairs(m)] == host][0]), boxes[m])
                      for m in members)
      out.append(ShardWrite(h.hosts[host], Box(start, stop), sources))
    return out
  return None


def _blocks(block, counts, shard, at, held, hosts_of):
  """(host, start, stop, member shards) per block, or None if some block has no common host.
  ``held``: shard x host membership; ``hosts_of(m)``: shard m's hosts in holder order."""
  out = []
  offsets = list(itertools.product(*(range(f) for f in block)))
  for origin in itertools.product(*(range(0, c, f) for c, f in zip(counts, block))):
    members = [at[tuple(o + i for o, i in zip(origin, idx))] for idx in offsets]
    common = held[members].all(axis=0)
    if not common.any():
      return None
    hosts = hosts_of(members[0])
    host = int(hosts[np.argmax(common[hosts])])  # the first of them holding the whole block
    start = tuple(o * s for o, s in zip(origin, shard))
    stop = tuple(a + f * s for a, f, s in zip(start, block, shard))
    out.append((host, start, stop, members))
  return out
