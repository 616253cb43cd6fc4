"""A lost chunk that several processes need is read from storage once and passed host to host.

When a node is lost, the chunks only its tier held must come from storage. For state sharded
across slices one survivor needs each such chunk, and reads it itself. For state replicated
across slices every survivor needs it: without this module each would read the same bytes from
storage (3 survivors of 4 slices: 3x the lost host's share). Here the processes that need a
chunk (``plan/sources.needers``, from the target sharding) are split into groups of at most
``GROUP`` in process order; in each group one process (``plan/sources.fetcher``, the same pick on
every process) reads the chunk from storage, checks it against the committed crc32c, and keeps it
in memory; the others of its group ask it for the chunk over the tier's peer channel
(``peer/client.py`` to ``peer/server.py``, op ``relay``). Groups bound what one process sends
(at most ``GROUP - 1`` copies of a chunk), however many processes need it.

Who calls what, on which host (multi-controller JAX, every process, one restore):

- ``transports/in_process.read`` registers the restore's arrays (``Target``: name, tensorstore spec,
  context, committed chunk records, and who needs which box) with ``fleet/chain.for_restore``,
  which builds a ``RelaySource`` after the peer source and registers it (``register``) under the
  restore's key prefix *before* publishing that prefix: a process that sees another's key can
  ask it for a chunk at once.
- ``RelaySource.read_chunk`` (the chain's reading threads): this process is the chunk's fetcher
  -> ``CACHE.get`` (one storage read, however many ask at once); else a ``relay`` request to
  the fetcher, whose server thread calls ``answer``, which does the same ``CACHE.get``. A fetcher
  that cannot answer in time costs the asker its own storage read (the chain falls back), never
  the restore.

Which arrays a server reads: only those its own process registered for a restore, one whole
recorded chunk per request (the request names the restore's key prefix, an array and a chunk's
origin and shape; never a path or a spec), so the channel cannot be used to read anything else
from storage; and only for a connection that proved the job's secret (``peer/wire.py``), so a
process outside the job cannot make a server read storage with the job's credentials.

Memory: a chunk read for others stays in ``CACHE`` until every process of its group that needs
it took it, at most ``TTL_S`` after its last use, and at most ``MAX_CACHE_BYTES`` in all (the
least recently used goes first: a later ask then reads storage again). Bytes received from a
fetcher count against the peer channel's in-flight cap.

No jax here: the target sharding arrives as ``plan/sources.Owners`` through a callable.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable, Container, Mapping

import numpy as np
import tensorstore as ts

from orbax_pathways.format import checksum
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import sources as plan_sources
from orbax_pathways.storage import hedge
from orbax_pathways.peer import client as tier_peer
from orbax_pathways.peer import wire as tier_wire

Box = boxes_lib.Box
log = logging.getLogger('orbax_pathways')

GROUP = 8  # processes served by one storage read of a chunk (one fetcher sends GROUP - 1 copies)
MAX_CACHE_BYTES = 256 << 20  # chunks read for others, kept until taken, per process
TTL_S = 60.0  # a chunk not asked for this long is dropped
MAX_RESTORES = 4  # restored items whose arrays a server still reads for its peers (this one, the last)


class RelayError(Exception):
  """A chunk could not be read for the relay (storage failed, or its bytes are damaged)."""


@dataclasses.dataclass(frozen=True)
class Target:
  """One array of a restore, as registered for the relay: what to open and check it against,
  and ``owners()``: the distinct boxes of its target sharding with the processes holding each
  (computed the first time a lost chunk of it is looked at)."""

  name: str
  tspec: Mapping[str, Any]
  context: Any
  chunks: Mapping[tuple[int, ...], Any]  # origin -> committed record (crc32c, nbytes)
  owners: Callable[[], plan_sources.Owners]
  shape: tuple[int, ...] = ()  # stored shape and chunk shape: a request names one whole chunk
  chunk_shape: tuple[int, ...] | None = None

  def chunk_at(self, origin: tuple[int, ...], shape: tuple[int, ...]) -> Box:
    """The chunk a request names; ``RelayError`` unless it is exactly one recorded chunk of the
    stored grid (a server never reads more than one chunk per request)."""
    if self.chunk_shape is None or origin not in self.chunks:
      raise RelayError(f'array {self.name!r} has no recorded chunk at {list(origin)}')
    chunk = boxes_lib.clip(Box(origin, tuple(o + c for o, c in zip(origin, self.chunk_shape))),
                           self.shape)
    if chunk.shape != shape:
      raise RelayError(f'array {self.name!r}: the chunk at {list(origin)} has shape '
                       f'{list(chunk.shape)}, not {list(shape)}')
    return chunk


# ---- the cache: one storage read per chunk, however many ask ------------------------------------


class _Flight:
  def __init__(self, uses: int):
    self.done = threading.Event()
    self.data: np.ndarray | None = None
    self.error = ''
    self.left = uses  # gets still expected (this process's own, and its group's asks)
    self.last = time.monotonic()


class Cache:
  """Chunks read from storage for a group of processes, by (restore prefix, array, origin)."""

  def __init__(self, cap: int = MAX_CACHE_BYTES, ttl_s: float = TTL_S):
    self.cap, self.ttl_s = cap, ttl_s
    self.bytes = 0
    self.storage_bytes = 0  # read from storage through the cache (this process, all restores)
    self._flights: collections.OrderedDict[tuple, _Flight] = collections.OrderedDict()
    self._lock = threading.Lock()
    self._janitor: threading.Timer | None = None

  def get(self, key: tuple, read: Callable[[], np.ndarray], *, uses: int,
          timeout_s: float) -> np.ndarray:
    """The chunk under ``key``: read with ``read()`` by the first caller, waited for by the
    others (up to ``timeout_s``). ``uses``: how many gets to expect in all (the first caller
    says); the entry goes after the last of them. Raises ``RelayError``."""
    with self._lock:
      self._expire(time.monotonic())
      flight = self._flights.get(key)
      first = flight is None
      if first:
        flight = self._flights[key] = _Flight(max(uses, 1))
      else:
        self._flights.move_to_end(key)
    assert flight is not None
    if first:
      try:
        data = read()
      except Exception as e:  # pylint: disable=broad-except  (reported to every asker)
        flight.error = f'{type(e).__name__}: {e}'
        with self._lock:
          self._flights.pop(key, None)
        flight.done.set()
        raise RelayError(flight.error) from e
      with self._lock:
        flight.data = data
        self.bytes += data.nbytes
        self.storage_bytes += data.nbytes
        self._evict(keep=key)
      flight.done.set()
      self._arm()
    elif not flight.done.wait(timeout_s):
      raise RelayError(f'the storage read of this chunk did not finish within {timeout_s:g} s')
    if flight.error:
      raise RelayError(flight.error)
    got = flight.data
    assert got is not None
    with self._lock:
      flight.last = time.monotonic()
      flight.left -= 1
      if flight.left <= 0 and self._flights.get(key) is flight:
        del self._flights[key]
        self.bytes -= got.nbytes
    return got

  def _evict(self, keep: tuple) -> None:
    for key in list(self._flights):
      if self.bytes <= self.cap:
        return
      f = self._flights[key]
      if key != keep and f.data is not None:
        del self._flights[key]
        self.bytes -= f.data.nbytes

  def _expire(self, now: float) -> None:
    for key in [k for k, f in self._flights.items()
                if f.data is not None and now - f.last > self.ttl_s]:
      self.bytes -= self._flights.pop(key).data.nbytes  # type: ignore[union-attr]

  def _arm(self) -> None:
    """A timer that drops expired chunks when nobody asks any more (held memory)."""
    with self._lock:
      if self._janitor is not None or not self._flights:
        return
      self._janitor = threading.Timer(self.ttl_s / 2, self._sweep)
      self._janitor.daemon = True
      self._janitor.start()

  def _sweep(self) -> None:
    with self._lock:
      self._janitor = None
      self._expire(time.monotonic())
    self._arm()

  def clear(self) -> None:
    with self._lock:
      self._flights.clear()
      self.bytes = 0


CACHE = Cache()


# ---- restores this process serves relays for -----------------------------------------------------

_sources: collections.OrderedDict[str, 'RelaySource'] = collections.OrderedDict()
_sources_lock = threading.Lock()


def register(source: 'RelaySource') -> None:
  """Makes this process's server answer relays of ``source``'s restore (the newest
  ``MAX_RESTORES`` restores; older ones answer an error, and the asker reads storage)."""
  with _sources_lock:
    _sources[source.prefix] = source
    while len(_sources) > MAX_RESTORES:
      _sources.popitem(last=False)


def answer(req: Mapping[str, Any]) -> np.ndarray:
  """A peer's ``relay`` request (this process's tier server thread): the chunk's bytes."""
  with _sources_lock:
    source = _sources.get(str(req.get('prefix')))
  if source is None:
    raise RelayError(f'no restore {req.get("prefix")!r} registered on this process')
  name = str(req['array'])
  target = source.targets.get(name)
  if target is None:
    raise RelayError(f'array {name!r} is not part of restore {source.prefix}')
  chunk = target.chunk_at(tuple(int(x) for x in req['origin']),
                          tuple(int(x) for x in req['shape']))
  return source.fetch(name, chunk)



# ---- the chain's source --------------------------------------------------------------------------


class _Shared(Container):
  """The origins of one array's chunks that the relay can serve (lost chunks several live
  processes need); asked by the planner only for chunks no tier holds."""

  def __init__(self, source: 'RelaySource', read: Any):
    self._source, self._read = source, read

  def __contains__(self, origin: object) -> bool:
    return self._source.group_of(self._read, origin) is not None


class RelaySource:
  """The chain's last source before storage (multi-controller JAX): chunks no tier holds that
  other processes of this one's group also need, read from storage by one of them."""

  name = 'relay'

  def __init__(self, peers: tier_peer.PeerSource, targets: Mapping[str, Target],
               timeout_s: float):
    self.peers, self.targets, self.timeout_s = peers, dict(targets), timeout_s
    self.prefix = peers.prefix
    self.me = peers.exchange.me
    self._groups: dict[tuple[str, frozenset[int], frozenset[int]], tuple[int, ...]] = {}
    self._owners: dict[str, plan_sources.Owners] = {}
    self._lock = threading.Lock()

  def _owned(self, name: str) -> plan_sources.Owners | None:
    target = self.targets.get(name)
    if target is None:
      return None
    with self._lock:
      if name not in self._owners:
        self._owners[name] = target.owners()
      return self._owners[name]

  def group_of(self, read: Any, origin: Any) -> tuple[int, ...] | None:
    """The processes (this one among them) that share one storage read of the chunk at
    ``origin``, or None when nobody else needs it (or the relay cannot serve it)."""
    target = self.targets.get(read.name)
    if target is None or read.chunk_shape is None or origin not in target.chunks:
      return None
    owned = self._owned(read.name)
    if owned is None:
      return None
    origin = tuple(origin)
    chunk = boxes_lib.clip(Box(origin, tuple(o + c for o, c in zip(origin, read.chunk_shape))),
                           read.plan.global_shape)
    need = plan_sources.needers(chunk, owned)
    if self.me not in need or len(need) < 2:
      return None
    live = self.peers.live()
    key = (read.name, need, live)
    with self._lock:
      if key not in self._groups:
        self._groups[key] = _group(sorted(need & live), self.me)
      group = self._groups[key]
    return group if len(group) > 1 else None

  def held(self, read: Any) -> Container[tuple[int, ...]]:
    return _Shared(self, read)

  def fetcher_of(self, read: Any, chunk: Box) -> int | None:
    group = self.group_of(read, chunk.start)
    if group is None:
      return None
    return plan_sources.fetcher(f'{self.prefix}/{read.name}/{list(chunk.start)}', group)

  def counted_as(self, read: Any, chunk: Box) -> str:
    """'storage' where this process read the chunk from storage itself, else 'relay'."""
    return 'storage' if self.fetcher_of(read, chunk) == self.me else 'relay'

  def read_chunk(self, read: Any, chunk: Box, dtype: np.dtype) -> np.ndarray:
    fetcher = self.fetcher_of(read, chunk)
    if fetcher is None:
      raise tier_wire.PeerError(f'no relay for chunk {list(chunk.start)} of {read.name!r}')
    if fetcher == self.me:
      try:
        return self.fetch(read.name, chunk)
      except RelayError as e:
        raise tier_wire.PeerError(f'relay read of chunk {list(chunk.start)} of {read.name!r} '
                                  f'for its group: {e}') from e
    peer = self.peers.peer(fetcher)
    if peer is None:
      raise tier_wire.PeerError(f'peer process {fetcher} (the fetcher of chunk '
                                f'{list(chunk.start)} of {read.name!r}) is not reachable')
    out = np.empty(chunk.shape, dtype)
    tier_peer.budget.take(out.nbytes)
    try:
      peer.request({'op': 'relay', 'prefix': self.prefix, 'array': read.name,
                    'origin': list(chunk.start), 'shape': list(chunk.shape)},
                   f'chunk {list(chunk.start)} of {read.name!r} (read from storage for its '
                   'group)', into=out)
    finally:
      tier_peer.budget.give(out.nbytes)
    return out

  def uses(self, name: str, chunk: Box) -> int:
    """How many processes of this one's view of the chunk's group will take it."""
    target = self.targets.get(name)
    owned = self._owned(name) if target is not None else None
    if owned is None:
      return 1
    need = plan_sources.needers(chunk, owned)
    live = self.peers.live()
    group = _group(sorted(need & live), self.me) if self.me in need else ()
    return max(len(group), 1)

  def fetch(self, name: str, chunk: Box) -> np.ndarray:
    """The chunk from storage, checked against its committed record, through ``CACHE`` (this
    process's own read and its group's asks share one storage read)."""
    target = self.targets.get(name)
    if target is None:
      raise RelayError(f'array {name!r} is not part of restore {self.prefix}')
    return CACHE.get((self.prefix, name, chunk.start),
                     functools.partial(_read_checked, target, chunk),
                     uses=self.uses(name, chunk), timeout_s=self.timeout_s)


def _group(need_live: list[int], me: int) -> tuple[int, ...]:
  """This process's group among the live processes that need a chunk (in process order,
  consecutive groups of ``GROUP``)."""
  if me not in need_live:
    return ()
  i = need_live.index(me) // GROUP * GROUP
  return tuple(need_live[i:i + GROUP])


def _read_checked(target: Target, chunk: Box) -> np.ndarray:
  """One chunk from storage (hedged past its deadline), checked against its record."""
  record = target.chunks.get(chunk.start)
  if record is None:
    raise RelayError(f'chunk {list(chunk.start)} of {target.name!r} has no committed record')
  spec = ts.Spec(dict(target.tspec))
  handles: dict[int, ts.TensorStore] = {}

  def attempt(n: int) -> ts.Future:
    if n not in handles:  # later attempts: a fresh context (a stuck connection pool)
      ctx = target.context if n == 0 else hedge.fresh_context(target.context, n)
      handles[n] = ts.open(spec, open=True, context=ctx).result()
    return handles[n][chunk.to_slices()].read()

  data = np.ascontiguousarray(hedge.run_sync(
      attempt, nbytes=record.nbytes, kind='read',
      what=f'chunk {list(chunk.start)} of array {target.name!r} (read for the relay)'))
  found = checksum.of_array(data)
  if data.nbytes != record.nbytes or found != record.crc32c:
    raise RelayError(f'chunk {list(chunk.start)} of {target.name!r} read from storage does '
                     f'not match its record (crc32c {found:#010x}, {data.nbytes} bytes; '
                     f'committed {record.crc32c:#010x}, {record.nbytes})')
  return data
