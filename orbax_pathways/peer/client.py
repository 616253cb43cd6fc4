"""Chunks of another host's node-local tier, on the restoring process: the chain's peer source,
with a deadline on every wait, a cap on bytes in flight, and the job's secret on every
connection. The other ends: each process's server (``peer/server.py``) and, for who holds
what, jax's key-value store (``peer/exchange.py``).

Why a direct channel, not JAX collectives: a collective needs every process to enter it with
the same shapes at the same time, so a restore would need a global plan of who sends which
chunk to whom, and one host that died or stalled would hang (or, in gloo, fail after its own
timeout) the collective for everybody. With one server per process, each reader pulls only the
chunks it lacks, when it needs them, each request with its own deadline; a dead or silent peer
costs its chunks a trip to storage, never the restore.

Who calls what, on which host (multi-controller JAX, every process):

- ``fleet/chain.for_restore`` makes a ``PeerSource`` per restored item (the restore's
  ``Exchange``, its round's key, ``item_parts``, the committed save ids, this node's writers),
  then serves and publishes (``peer/server.serve``, ``Exchange.publish``).
- ``PeerSource`` joins the chain after this node's own tier. When the planner asks it for a
  chunk, it looks up the chunk's writer in the committed index, reads that writer's holder keys
  (``Exchange.holders``: one directory read per writer and restore) and asks the first holder,
  once, which chunks it holds of the item (``list``). A writer without a holder key sends it to
  every process's key once (``Exchange.gather``, one deadline for all): lost, or late? An index
  without the writer column takes that full look at once and lists every peer that holds a
  usable entry. A chunk then comes with one ``get``: the bytes streamed into a buffer of the
  committed record's dtype and size (an answer of another size is refused unread). The chain
  checks each chunk's crc32c and size against storage's index before using it.
- ``fleet/relay.py`` asks a peer of this restore (``PeerSource.live``, ``PeerSource.peer``) over
  the same connections for a chunk read from storage once for several processes, under the same
  ``budget``.

What grows with what: a reader reads one holder key and sends one ``list`` per writer whose
chunks it lacks (the answer lists that peer's chunks of the item, at most
``wire.MAX_LIST_BYTES``); only a writer that no survivor holds (or an index without the column,
or the relay) costs one read of every process's key. Then one ``get`` per chunk, over at most
``CONNECTIONS_PER_PEER`` connections per peer. Memory: at most ``MAX_INFLIGHT_BYTES`` of chunk
buffers being received from peers at once per process (one chunk larger than that goes alone);
the chain copies each into the region's buffer as soon as it checked out. A peer that failed is
not asked again in that restore (``wire.PeerError`` names it). No jax here.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from typing import Any, Container, Iterable, Mapping

import msgpack
import numpy as np

from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.peer import exchange as exchange_lib
from orbax_pathways.tier import manifest as manifest_lib
from orbax_pathways.peer import wire

Box = boxes_lib.Box

MAX_INFLIGHT_BYTES = 64 << 20  # chunk bytes received from peers and not yet copied, per process
_STREAM = 1 << 20
CONNECTIONS_PER_PEER = 4  # a reader's connections to one peer (its reading threads share them)


# ---- the client: the peer source of the chain ----------------------------------------------------


class _Budget:
  """Bytes in flight from peers: ``take`` waits while the cap is used (one chunk larger than
  the cap goes alone)."""

  def __init__(self, cap: int):
    self.cap, self.used = cap, 0
    self._cv = threading.Condition()

  def take(self, n: int) -> None:
    with self._cv:
      self._cv.wait_for(lambda: self.used == 0 or self.used + n <= self.cap)
      self.used += n

  def give(self, n: int) -> None:
    with self._cv:
      self.used -= n
      self._cv.notify_all()


budget = _Budget(MAX_INFLIGHT_BYTES)


class _Conn:
  """One authenticated connection to a peer's server and its request sequence."""

  def __init__(self, sock: socket.socket, session: wire.Session):
    self.sock, self.session = sock, session

  def close(self) -> None:
    try:
      self.sock.close()
    except OSError:
      pass


class _Peer:
  """One other process's server: its address, at most ``CONNECTIONS_PER_PEER`` authenticated
  connections that this restore's reading threads share, and whether it failed (then it is not
  asked again in this restore)."""

  def __init__(self, process: int, address: str, timeout_s: float, secret: bytes,
               connections: int = CONNECTIONS_PER_PEER):
    self.process, self.address, self.timeout_s = process, address, timeout_s
    self.failed: str = ''
    self._secret, self._cap = secret, connections
    self._idle: list[_Conn] = []
    self._open = 0
    self._cv = threading.Condition()

  def __str__(self) -> str:
    return f'peer process {self.process} ({self.address})'

  def _take(self, deadline: float) -> tuple[_Conn, bool]:
    """A connection (an idle one, else a new one while fewer than the cap are open, else the
    first one given back before ``deadline``) and whether it was used before."""
    with self._cv:
      while True:
        if self.failed:
          raise wire.PeerError(f'{self} failed earlier in this restore ({self.failed})')
        if self._idle:
          return self._idle.pop(), True
        if self._open < self._cap:
          self._open += 1
          break
        left = deadline - time.monotonic()
        if left <= 0:
          raise socket.timeout(f'all {self._cap} connections to it stayed busy')
        self._cv.wait(left)
    try:
      return self._connect(deadline), False
    except BaseException:
      with self._cv:
        self._open -= 1
        self._cv.notify()
      raise

  def _connect(self, deadline: float) -> _Conn:
    host, _, port = self.address.rpartition(':')
    sock = socket.create_connection((host, int(port)),
                                    timeout=max(0.001, deadline - time.monotonic()))
    try:
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      return _Conn(sock, wire.connect(sock, self._secret, deadline))
    except BaseException:
      sock.close()
      raise

  def _give(self, conn: _Conn) -> None:
    with self._cv:
      self._idle.append(conn)
      self._cv.notify()

  def _drop(self, conn: _Conn) -> None:
    conn.close()
    with self._cv:
      self._open -= 1
      self._cv.notify()

  def close(self) -> None:
    """Closes the idle connections (those in use close when their request ends)."""
    with self._cv:
      idle, self._idle = self._idle, []
      self._open -= len(idle)
      self._cv.notify_all()
    for conn in idle:
      conn.close()

  def _fail(self, why: str) -> None:
    with self._cv:
      self.failed = why
      self._cv.notify_all()

  def request(self, req: Mapping[str, Any], what: str, into: np.ndarray | None = None) -> Any:
    """Sends ``req`` and returns the answer (msgpack decoded, at most ``wire.MAX_LIST_BYTES``;
    or the raw bytes received into ``into``, whose size the answer must have: nothing else is
    allocated); raises ``wire.PeerError`` naming the peer and what was asked, and marks the peer
    failed, past ``timeout_s``, on a broken bound or on any error but an error answer or a full
    server. A pooled connection the server closed meanwhile (its idle deadline) is replaced
    once."""
    if self.failed:
      raise wire.PeerError(f'{self} failed earlier in this restore ({self.failed}); '
                           f'{what} not asked')
    body = msgpack.packb(dict(req), use_bin_type=True)
    if len(body) > wire.LIMITS.max_request_bytes:
      raise wire.PeerError(f'{what}: a request of {len(body)} bytes, more than the '
                           f'{wire.LIMITS.max_request_bytes} a tier server reads; not asked')
    deadline = time.monotonic() + self.timeout_s
    for attempt in (0, 1):
      conn, reused, answered = None, False, False
      try:
        conn, reused = self._take(deadline)
        wire.send_request(conn.sock, conn.session, body, deadline)
        status, n = wire.recv_header(conn.sock, deadline)
        answered = True
        out = self._answer(conn, status, n, what, into, deadline)
        self._give(conn)
        conn = None
        return out
      except wire.BusyError as e:
        raise wire.PeerError(f'{self}: {what}: {e}; read from storage instead') from e
      except wire.PeerError:
        raise
      except ConnectionError as e:
        if reused and not answered and attempt == 0:
          continue  # closed while idle in the pool: once more on a new connection
        self._raise_failed(e, what)
      except (OSError, ValueError, msgpack.UnpackException) as e:
        self._raise_failed(e, what)
      finally:
        if conn is not None:
          self._drop(conn)
    raise AssertionError('unreachable')

  def _answer(self, conn: _Conn, status: int, n: int, what: str, into: np.ndarray | None,
              deadline: float) -> Any:
    """An answer's payload; ``wire.PeerError`` for an error answer (the connection stays usable:
    the caller gives it back only on success, so it is dropped here after reading the text)."""
    if status != 0:
      text = wire.recv_bounded(conn.sock, n, wire.MAX_ERROR_BYTES, deadline)
      raise wire.PeerError(f'{self} answered an error for {what}: '
                           f'{text.decode(errors="replace")}')
    if into is None:
      return msgpack.unpackb(wire.recv_bounded(conn.sock, n, wire.MAX_LIST_BYTES, deadline),
                             raw=False)
    if n != into.nbytes:  # the rest is not read: the connection is dropped
      raise wire.PeerError(f'{self} has {n} bytes for {what}; the committed record says '
                           f'{into.nbytes}')
    view = into.reshape(-1).view(np.uint8).data  # a memoryview of the buffer itself
    for start in range(0, n, _STREAM):
      wire.recv_exact(conn.sock, min(_STREAM, n - start), view[start:start + _STREAM], deadline)
    return into

  def _raise_failed(self, e: BaseException, what: str) -> None:
    kind = 'no answer within the deadline' if isinstance(e, socket.timeout) else 'failed'
    self._fail(f'{kind}: {type(e).__name__}: {e}')
    raise wire.PeerError(f'{self}: {what}: {kind} ({self.timeout_s:g} s per request, '
                         f'ORBAX_PATHWAYS_TIER_PEER_TIMEOUT_S): {type(e).__name__}: {e}') from e


class _Holding:
  """One array's chunks as peers hold them: origin -> (peer, entry name, file)."""

  def __init__(self, dtype: str, shape: tuple[int, ...], chunk_shape: tuple[int, ...]):
    self.dtype, self.shape, self.chunk_shape = dtype, shape, chunk_shape
    # origin -> (peer, entry, file, whether the file is a band: a get then names the chunk)
    self.files: dict[tuple[int, ...], tuple[_Peer, str, str, bool]] = {}


class _Lazy(Container):
  """The origins a source holds of one array, found out the first time the planner asks."""

  def __init__(self, source: 'PeerSource', read: Any):
    self._source, self._read = source, read

  def __contains__(self, origin: object) -> bool:
    return self._source.holds(self._read, origin)


class PeerSource:
  """Chunks of the other processes' tiers for one item of one restore (after this node's own
  tier in the chain, before storage). Only entries whose save id the committed index records
  for their writer, and not of a writer this node itself holds, are asked for."""

  name = 'peer'

  def __init__(self, exchange: exchange_lib.Exchange, prefix: str,
               item_parts: tuple[str, str, str], save_ids: Mapping[str, str],
               local_writers: Iterable[str], problems: list[str]):
    self.exchange, self.prefix, self.item_parts = exchange, prefix, item_parts
    self.save_ids, self.local_writers = dict(save_ids), set(local_writers)
    # Entries of writers this node holds itself, as peers listed them: used once this node's
    # copy of one of their chunks failed (``distrust``).
    self._deferred: dict[str, list[tuple[str, _Holding]]] = {}
    self.problems = problems  # the chain's: one log line per restore says what fell back
    self._arrays: dict[str, list[_Holding]] = {}  # what the peers listed so far, by array
    self._found: dict[int, dict[str, Any]] = {}  # every process's key (``_gather_everyone``)
    self._everyone = False
    self._all_listed = False
    self._holders: dict[str, dict[int, dict[str, Any]]] = {}  # writer -> its holder keys
    self._listed: dict[int, bool] = {}  # peers asked for their list: did they answer
    self._claimed: set[str] = set()
    self._peers: dict[int, _Peer] = {}
    self._joined: dict[tuple[str, tuple[int, ...], tuple[int, ...]], _Holding | None] = {}
    self._lock = threading.RLock()

  def _gather_everyone(self) -> None:
    """Every process's key of this restore (once: the old, O(fleet) look), so that a writer
    without a holder key is known lost rather than not yet published."""
    if self._everyone:
      return
    found, missing = self.exchange.gather(self.prefix)
    self._found, self._everyone = found, True
    if missing:
      self.problems.append(
          f'peer process(es) {", ".join(map(str, missing[:16]))} did not say what they hold '
          f'within {self.exchange.timeout_s:g} s (key prefix {self.prefix})')

  def _list(self, process: int, address: Any) -> bool:
    """Asks ``process`` (once per restore) which chunks it holds of the item and adds the
    usable ones; True if it answered."""
    if process in self._listed:
      return self._listed[process]
    self._peers.setdefault(process, self._new_peer(process, address))
    self._listed[process] = False
    try:
      answer = self._request_list(process)
    except wire.PeerError as e:
      self.problems.append(str(e))
      return False
    self._listed_answer(process, answer)
    return self._listed[process]

  def _learn_everything(self) -> None:
    """The look without a writer column: every process's key, then a list from each peer that
    holds a usable entry (in parallel)."""
    if self._all_listed:
      return
    self._all_listed = True
    self._gather_everyone()
    wanted = {p: v['addr'] for p, v in sorted(self._found.items())
              if p not in self._listed and any(
                  self.save_ids.get(w) == s and w not in self.local_writers
                  for w, s in v['entries'])}
    for p, addr in wanted.items():
      self._peers.setdefault(p, self._new_peer(p, addr))
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(wanted) or 1)) as pool:
      answers = list(zip(wanted, pool.map(_quietly(self._request_list), wanted)))
    for p, answer in answers:
      self._listed[p] = False
      if isinstance(answer, Exception):
        self.problems.append(str(answer))
        continue
      self._listed_answer(p, answer)

  def _request_list(self, process: int) -> Any:
    exchange_lib.counts['lists'] += 1
    return self._peers[process].request({'op': 'list', 'item': list(self.item_parts)},
                                        f'the list of {"/".join(self.item_parts)}')

  def _listed_answer(self, process: int, answer: Any) -> None:
    try:
      listed = _parse_listing(self._peers[process], answer)
    except wire.PeerError as e:
      self.problems.append(str(e))
      return
    for writer, save_id, held in listed:
      if self.save_ids.get(writer) != save_id or writer in self._claimed:
        continue
      if writer in self.local_writers:
        self._deferred.setdefault(writer, []).extend(held.items())
        continue
      self._claim(writer, held.items())
    self._joined.clear()
    self._listed[process] = True

  def _claim(self, writer: str, held: Any) -> None:
    self._claimed.add(writer)  # a writer's entry is taken from the first peer that lists it
    for name, h in held:
      self._arrays.setdefault(name, []).append(h)

  def distrust(self, read: Any, origin: Any) -> None:
    """This node's copy of chunk ``origin`` of ``read``'s array failed (damaged, missing):
    its writer's chunks are from now on also looked for in peers' tiers (a replica, a partner
    copy: ``Options.local_copies``), from the lists already received first."""
    chunks = getattr(read, 'chunks', None)
    record = chunks.get(origin) if chunks is not None else None
    writer = getattr(record, 'writer', '') if record is not None else ''
    with self._lock:
      if writer and writer in self.local_writers:
        self.local_writers.discard(writer)
        deferred = self._deferred.pop(writer, [])
        if deferred and writer not in self._claimed:
          self._claim(writer, deferred)
          self._joined.clear()

  def _holders_of(self, writer: str) -> dict[int, dict[str, Any]]:
    """``writer``'s holder keys (one directory read, once per restore); a writer with none is
    looked for once more after every process's key is in: then it is lost."""
    if writer not in self._holders:
      found = self.exchange.holders(self.prefix, writer)
      if not exchange_lib.to_ask(found, self.save_ids, self.exchange.me) and not self._everyone:
        self._gather_everyone()
        found = self.exchange.holders(self.prefix, writer)
      self._holders[writer] = found
    return self._holders[writer]

  def _find(self, read: Any, origin: Any, writer: str) -> None:
    """Lists ``writer``'s holders, in order, until one holds ``origin`` of ``read``'s array (in
    the usual case the first: the writer's own node), or none is left."""
    holders = self._holders_of(writer)
    for p in exchange_lib.to_ask(holders, self.save_ids, self.exchange.me):
      if p in self._listed:
        continue
      self._list(p, holders[p]['addr'])
      h = self._holding(read)
      if h is not None and origin in h.files:
        return

  def holds(self, read: Any, origin: Any) -> bool:
    """Whether a peer holds chunk ``origin`` of ``read``'s array (the planner's question). With
    the index's writer column, only the holders of the chunk's writer are looked up; without
    it, every process (once per restore)."""
    with self._lock:
      h = self._holding(read)
      if h is not None and origin in h.files:
        return True
      chunks = getattr(read, 'chunks', None)
      record = chunks.get(origin) if chunks is not None and read.chunk_shape is not None else None
      writer = getattr(record, 'writer', '') if record is not None else ''
      if writer in self.local_writers:
        return False  # this node's copy of that writer's entry is the one to use
      if writer:
        self._find(read, origin, writer)
      else:
        self._learn_everything()
      h = self._holding(read)
      return h is not None and origin in h.files

  def _new_peer(self, process: int, address: Any) -> _Peer:
    return _Peer(process, str(address), self.exchange.timeout_s, self.exchange.secret())

  def live(self) -> frozenset[int]:
    """This process and the others that published in time and have not failed a request in
    this restore (the relay's view of who can share a storage read: every process's key)."""
    with self._lock:
      self._gather_everyone()
      return frozenset([self.exchange.me] + [
          p for p in self._found if p not in self._peers or not self._peers[p].failed])

  def peer(self, process: int) -> _Peer | None:
    """The server of another process that published in time (one per process and restore)."""
    with self._lock:
      self._gather_everyone()
      if process not in self._peers and process in self._found:
        self._peers[process] = self._new_peer(process, self._found[process]['addr'])
      return self._peers.get(process)

  def holding(self, read: Any) -> _Holding | None:
    """What the peers listed so far hold of ``read``'s array in its stored layout (every
    writer's chunks joined; joined again after each new list)."""
    with self._lock:
      return self._holding(read)

  def _holding(self, read: Any) -> _Holding | None:
    if read.chunk_shape is None:
      return None
    key = (read.name, tuple(read.chunk_shape), tuple(read.plan.global_shape))
    with self._lock:
      if key not in self._joined:
        matching = [h for h in self._arrays.get(read.name, ())
                    if h.chunk_shape == key[1] and h.shape == key[2]]
        joined = None
        if matching:
          joined = _Holding(matching[0].dtype, key[2], key[1])
          for h in matching:
            joined.files.update(h.files)
        self._joined[key] = joined
      return self._joined[key]

  def held(self, read: Any) -> Container[tuple[int, ...]]:
    return _Lazy(self, read)

  def read_chunk(self, read: Any, chunk: Box, dtype: np.dtype) -> np.ndarray:
    """The chunk's bytes from the peer that holds it, received into a buffer of the committed
    record's dtype (``dtype``, the stored one) and size; ``wire.PeerError`` (naming the peer) if the
    peer's copy is of another dtype or size, or it cannot deliver the bytes in time."""
    h = self.holding(read)
    where = h.files.get(chunk.start) if h is not None else None
    if h is None or where is None:
      raise wire.PeerError(f'no peer holds chunk {list(chunk.start)} of {read.name!r}')
    peer, entry, file, band = where
    stored = np.dtype(dtype)
    if h.dtype != stored.name:
      raise wire.PeerError(f'{peer} holds {read.name!r} as {h.dtype}; the committed record says '
                           f'{stored.name}: not used')
    record = read.chunks.get(chunk.start) if getattr(read, 'chunks', None) else None
    nbytes = chunk.size * stored.itemsize
    if record is not None and int(record.nbytes) != nbytes:
      raise wire.PeerError(f'chunk {list(chunk.start)} of {read.name!r}: {nbytes} bytes of '
                           f'{list(chunk.shape)} {stored.name}, the committed record says '
                           f'{record.nbytes}: not asked')
    out = np.empty(chunk.shape, stored)
    budget.take(out.nbytes)
    try:
      req: dict[str, Any] = {'op': 'get', 'item': list(self.item_parts), 'entry': entry,
                             'file': file}
      if band:  # one chunk of a band file: the server sends only its rows
        req['chunk'] = [list(chunk.start), list(chunk.shape)]
      peer.request(req, f'chunk {list(chunk.start)} of {read.name!r}', into=out)
    finally:
      budget.give(out.nbytes)
    return out

  def close(self) -> None:
    """Closes the idle connections to every peer of this restore."""
    with self._lock:
      peers = list(self._peers.values())
    for p in peers:
      p.close()


def _parse_listing(peer: _Peer, answer: Any) -> list[tuple[str, str, dict[str, _Holding]]]:
  """A peer's ``list`` answer as (writer, save id, array name -> chunks held); ``wire.PeerError``
  naming the peer if it is not the shape a tier server sends."""
  out = []
  try:
    for entry, e in sorted(answer.items()):
      if not isinstance(entry, str) or not isinstance(e['writer'], str):
        raise TypeError(f'entry {str(entry)[:64]!r}')
      held = {}
      for name, a in e['arrays'].items():
        h = _Holding(str(a['dtype']), tuple(int(x) for x in a['shape']),
                     tuple(int(x) for x in a['chunk_shape']))
        origins, files = list(a['origins']), list(a['files'])
        if len(origins) != len(files) or not all(isinstance(f, str) and wire.FILE_RE.match(f)
                                                 for f in files):
          raise ValueError(f'array {str(name)[:64]!r}: origins and files do not match')
        bands = {str(b[0]) for b in a.get('bands', ())}
        h.files = {tuple(int(x) for x in o): (peer, entry, f, f in bands)
                   for o, f in zip(origins, files)}
        held[str(name)] = h
      out.append((e['writer'], str(e['save_id']), held))
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    raise wire.PeerError(f'{peer} sent a list that is not a tier listing ({type(e).__name__}: '
                         f'{str(e)[:200]}); its chunks are read from storage') from e
  return out


def _quietly(fn):
  def call(arg):
    try:
      return fn(arg)
    except wire.PeerError as e:
      return e
  return call


def item_parts(item_dir: str) -> tuple[str, str, str]:
  """(root key, step name, item name): where ``item_dir``'s entries sit under a tier."""
  root, step_name, item = manifest_lib.split_item_dir(item_dir)
  return manifest_lib.root_key(root), step_name, item
