"""Chunks of another host's node-local tier: a small TCP server per process and the restore's
peer source, with a deadline on every wait and a cap on bytes in flight.

Why a direct channel, not JAX collectives: a collective needs every process to enter it with
the same shapes at the same time, so a restore would need a global plan of who sends which
chunk to whom, and one host that died or stalled would hang (or, in gloo, fail after its own
timeout) the collective for everybody. With one server per process, each reader pulls only the
chunks it lacks, when it needs them, each request with its own deadline; a dead or silent peer
costs its chunks a trip to storage, never the restore.

Who calls what, on which host (multi-controller JAX, every process):

- ``transports/local.read`` makes an ``Exchange`` per restore (jax's key-value client, this
  process's index, the process count, ``Options.tier_peer_timeout_s``) and hands it to
  ``tier/chain.for_restore``, which calls ``serve`` (starts this process's server once: it
  serves only this node's tier directory, only complete manifests, only chunk files named in
  them) and ``Exchange.publish`` (one key: this server's address and the (writer, save id) of
  the entries this node holds of the item that the committed index records).
- ``PeerSource`` joins the chain after this node's own tier. The first time the planner asks
  it for a chunk, it reads the other processes' keys (one deadline for all) and asks each peer
  holding a usable entry, once, which chunks it holds of the item (``list``). A chunk then comes
  with one ``get``: the bytes streamed into a buffer of the committed size. The chain checks
  each chunk's crc32c and size against storage's index before using it.

What grows with what: each process publishes one key per restored item, of constant size in
the fleet (its address and the save ids of the entries its node holds, one per writer on the
node). A reader that needs any chunk from a peer reads one key per process and sends one
``list`` per peer that holds a usable entry (the answer lists that peer's own chunks of the
item); then one ``get`` per chunk. The per-chunk lists are never in the key-value store.
Memory: at most ``MAX_INFLIGHT_BYTES`` of chunk buffers being received from peers at once per
process (one chunk larger than that goes alone); the chain copies each into the region's buffer
as soon as it checked out, and the server streams files (``sendfile``) without reading them whole. Keys of the restore before last are deleted by their publisher.

No jax here: the key-value client arrives as an object with ``key_value_set``,
``blocking_key_value_get``, ``key_value_try_get``, ``key_value_delete`` and, where it has one,
``key_value_dir_get`` (every key already published, in one request).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import re
import socket
import socketserver
import struct
import threading
import time
from typing import Any, Callable, Container, Iterable, Mapping

import msgpack
import numpy as np

from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.tier import layout
from orbax_pathways.tier import store

Box = boxes_lib.Box
log = logging.getLogger('orbax_pathways')

MAX_INFLIGHT_BYTES = 64 << 20  # chunk bytes received from peers and not yet copied, per process
ADDRESS_ENV = 'ORBAX_PATHWAYS_PEER_ADDRESS'  # the address this host's peers reach it at
_HEADER = struct.Struct('!BQ')  # status (0 ok, 1 error), payload bytes
_REQUEST = struct.Struct('!I')  # request bytes (a msgpack map follows)
_PART = re.compile(r'^[A-Za-z0-9_.=+-]+$')
_FILE = re.compile(r'^\d+\.\d+\.bin$')
_STREAM = 1 << 20


class PeerError(Exception):
  """A peer did not deliver: refused, closed, answered an error, or missed its deadline."""


# ---- the server: this node's tier, to the other processes -------------------------------------


def _safe(part: str) -> str:
  if not isinstance(part, str) or not _PART.match(part) or part in ('.', '..'):
    raise ValueError(f'not a tier path component: {part!r}')
  return part


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None,
                deadline: float | None = None) -> memoryview:
  buf = into if into is not None else memoryview(bytearray(n))
  got = 0
  while got < n:
    if deadline is not None:
      left = deadline - time.monotonic()
      if left <= 0:
        raise socket.timeout(f'{got} of {n} bytes arrived before the deadline')
      sock.settimeout(left)
    k = sock.recv_into(buf[got:], n - got)
    if k == 0:
      raise ConnectionError(f'connection closed after {got} of {n} bytes')
    got += k
  return buf


_ops: dict[str, Callable[[Mapping[str, Any]], np.ndarray]] = {}


def register_op(name: str, fn: Callable[[Mapping[str, Any]], np.ndarray]) -> None:
  """Adds a request kind the server answers with ``fn(request)``'s bytes (``tier/relay.py``:
  ``relay``, a chunk read from storage for several processes)."""
  _ops[name] = fn


class _Handler(socketserver.BaseRequestHandler):
  """One connection: requests answered in order until the reader closes it."""

  server: '_Server'

  def handle(self) -> None:
    sock = self.request
    while True:
      try:
        (n,) = _REQUEST.unpack(_recv_exact(sock, _REQUEST.size))
        req = msgpack.unpackb(bytes(_recv_exact(sock, n)), raw=False)
      except (OSError, ValueError, ConnectionError, msgpack.UnpackException):
        return
      try:
        self.answer(sock, req)
      except OSError:
        return

  def answer(self, sock: socket.socket, req: Mapping[str, Any]) -> None:
    """Prepares the answer (an error answers with its text), then sends it: a failure while
    sending closes the connection, never a second header in the middle of a payload."""
    try:
      found = self.prepare(req)
    except Exception as e:  # pylint: disable=broad-except  (answered as an error, never raised)
      text = f'{type(e).__name__}: {e}'.encode()
      sock.sendall(_HEADER.pack(1, len(text)) + text)
      return
    if isinstance(found, bytes):
      sock.sendall(_HEADER.pack(0, len(found)) + found)
    elif isinstance(found, np.ndarray):
      sock.sendall(_HEADER.pack(0, found.nbytes))
      sock.sendall(found.reshape(-1).view(np.uint8).data)
    else:
      with found:
        sock.sendall(_HEADER.pack(0, os.fstat(found.fileno()).st_size))
        sock.sendfile(found)  # streamed: the file is never read whole into memory here

  def prepare(self, req: Mapping[str, Any]) -> Any:
    """A ``list``'s payload (bytes), a registered op's array (``register_op``: answered from
    memory), or a ``get``'s open chunk file (only files a complete entry's manifest names)."""
    op = req.get('op')
    if op in _ops:
      return np.ascontiguousarray(_ops[op](req))
    item_dir = os.path.join(self.server.local_dir, *(_safe(p) for p in req['item']))
    if op == 'list':
      return msgpack.packb(_listing(item_dir), use_bin_type=True)
    if op != 'get' or not _FILE.match(str(req.get('file'))):
      raise ValueError(f'unknown request {req!r}')
    entry = os.path.join(item_dir, _safe(req['entry']))
    if not os.path.exists(os.path.join(entry, layout.MANIFEST)):
      raise FileNotFoundError(f'{entry}: no complete entry')
    return open(os.path.join(entry, req['file']), 'rb')  # pylint: disable=consider-using-with


def _listing(item_dir: str) -> dict[str, Any]:
  """Every complete entry of one item in this node's tier: its writer, save id and, per
  array, the stored layout and the chunk origins with their files."""
  out = {}
  for name in sorted(os.listdir(item_dir)) if os.path.isdir(item_dir) else ():
    e = store.read_entry(os.path.join(item_dir, name))
    if e.manifest is None:
      continue
    out[name] = {'writer': e.writer, 'save_id': e.save_id, 'arrays': {
        a.name: {'dtype': a.dtype, 'shape': list(a.shape), 'chunk_shape': list(a.chunk_shape),
                 'origins': [list(o) for o in a.origins], 'files': list(a.files)}
        for a in e.manifest.arrays}}
  return out


class _Server(socketserver.ThreadingTCPServer):
  daemon_threads = True
  allow_reuse_address = True

  def __init__(self, address: tuple[str, int], local_dir: str):
    self.local_dir = local_dir
    super().__init__(address, _Handler)


_servers: dict[str, tuple[_Server, str]] = {}
_servers_lock = threading.Lock()


def _advertised_host() -> str:
  host = os.environ.get(ADDRESS_ENV, '').strip()
  if host:
    return host
  try:
    return socket.gethostbyname(socket.gethostname())
  except OSError:
    return '127.0.0.1'


def serve(local_dir: str) -> str:
  """Starts (once per process and directory) the server of this node's tier in a daemon
  thread; returns the ``host:port`` peers reach it at (``ORBAX_PATHWAYS_PEER_ADDRESS`` names
  the host, else this host name's address)."""
  with _servers_lock:
    if local_dir in _servers:
      return _servers[local_dir][1]
    host = _advertised_host()
    server = _Server((host, 0), local_dir)
    address = f'{host}:{server.server_address[1]}'
    threading.Thread(target=server.serve_forever, name='orbax-pathways-tier-peer',
                     daemon=True).start()
    _servers[local_dir] = (server, address)
    return address


def stop_serving() -> None:
  """Closes this process's servers (tests: a peer whose process is gone refuses connections)."""
  with _servers_lock:
    for server, _ in _servers.values():
      server.shutdown()
      server.server_close()
    _servers.clear()


# ---- the key-value exchange: who serves what, per restored item ---------------------------------

_seq: dict[str, int] = {}
_seq_lock = threading.Lock()


def _base(item_dir: str) -> str:
  return f'orbax_pathways/tier_peers/{hashlib.sha256(item_dir.encode()).hexdigest()[:16]}'


class Exchange:
  """One restore's view of the other processes, through jax's key-value store. Made by the
  local transport (every process, every restore); ``publish`` once per item."""

  def __init__(self, client: Any, process_index: int, process_count: int, timeout_s: float):
    self.client = client
    self.me = process_index
    self.count = process_count
    self.timeout_s = timeout_s

  def prefix(self, item_dir: str) -> str:
    """The key prefix of this restore of ``item_dir`` (one per call). Every process numbers its
    restores of one item alike (multi-controller JAX restores the same items everywhere)."""
    base = _base(item_dir)
    with _seq_lock:
      seq = _seq[base] = _seq.get(base, 0) + 1
    return f'{base}/{seq}'

  def publish(self, prefix: str, address: str, held: Iterable[tuple[str, str]]) -> None:
    """Publishes, under ``prefix``, this process's server and the (writer, save id) of the
    entries its node holds of the item."""
    value = json.dumps({'addr': address, 'entries': sorted(set(map(tuple, held)))})
    self.client.key_value_set(f'{prefix}/{self.me}', value)
    base, _, seq = prefix.rpartition('/')
    if int(seq) > 2:  # every process is past the restore before last: nobody reads its keys now
      try:
        self.client.key_value_delete(f'{base}/{int(seq) - 2}/{self.me}')
      except Exception:  # pylint: disable=broad-except
        pass

  def gather(self, prefix: str) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """The other processes' published values (one deadline for all), and the processes whose
    key did not appear in time. One request for every key already there (a directory read of
    the prefix), then one blocking read per process still missing."""
    deadline = time.monotonic() + self.timeout_s
    found: dict[int, dict[str, Any]] = {}
    dir_get = getattr(self.client, 'key_value_dir_get', None)
    if dir_get is not None:
      try:
        for key, raw in dir_get(f'{prefix}/'):
          p = key.rstrip('/').rpartition('/')[2]
          if p.isdigit() and int(p) != self.me and int(p) < self.count:
            found[int(p)] = json.loads(raw)
      except Exception:  # pylint: disable=broad-except  (then one key at a time, as below)
        found = {}
    missing = []
    for p in range(self.count):
      if p == self.me or p in found:
        continue
      left = deadline - time.monotonic()
      try:
        if left > 0:
          raw = self.client.blocking_key_value_get(f'{prefix}/{p}', max(1, int(left * 1000)))
        else:
          raw = self.client.key_value_try_get(f'{prefix}/{p}')
        found[p] = json.loads(raw)
      except Exception:  # pylint: disable=broad-except  (not published in time)
        missing.append(p)
    return found, missing


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


class _Peer:
  """One other process's server: its address, a connection per reading thread, and whether
  it failed (then it is not asked again in this restore)."""

  def __init__(self, process: int, address: str, timeout_s: float):
    self.process, self.address, self.timeout_s = process, address, timeout_s
    self.failed: str = ''
    self._local = threading.local()

  def __str__(self) -> str:
    return f'peer process {self.process} ({self.address})'

  def _sock(self) -> socket.socket:
    sock = getattr(self._local, 'sock', None)
    if sock is None:
      host, _, port = self.address.rpartition(':')
      sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
      self._local.sock = sock
    return sock

  def _drop(self) -> None:
    sock = getattr(self._local, 'sock', None)
    self._local.sock = None
    if sock is not None:
      try:
        sock.close()
      except OSError:
        pass

  def request(self, req: Mapping[str, Any], what: str, into: np.ndarray | None = None) -> Any:
    """Sends ``req`` and returns the answer (msgpack decoded, or the raw bytes received into
    ``into``, whose size must be the answer's); raises ``PeerError`` naming the peer and what
    was asked, and marks the peer failed, past ``timeout_s`` or on any error."""
    if self.failed:
      raise PeerError(f'{self} failed earlier in this restore ({self.failed}); {what} not asked')
    deadline = time.monotonic() + self.timeout_s
    try:
      sock = self._sock()
      body = msgpack.packb(dict(req), use_bin_type=True)
      sock.settimeout(self.timeout_s)
      sock.sendall(_REQUEST.pack(len(body)) + body)
      status, n = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline=deadline))
      if status != 0:
        text = bytes(_recv_exact(sock, n, deadline=deadline)).decode(errors='replace')
        raise PeerError(f'{self} answered an error for {what}: {text}')
      if into is None:
        return msgpack.unpackb(bytes(_recv_exact(sock, n, deadline=deadline)), raw=False)
      if n != into.nbytes:
        self._drop()  # the rest of the answer is not read: the connection cannot be reused
        raise PeerError(f'{self} has {n} bytes for {what}; the committed record says '
                        f'{into.nbytes}')
      view = into.reshape(-1).view(np.uint8).data  # a memoryview of the buffer itself
      for start in range(0, n, _STREAM):
        _recv_exact(sock, min(_STREAM, n - start), view[start:start + _STREAM], deadline)
      return into
    except PeerError:
      raise
    except (OSError, ValueError, ConnectionError, struct.error, msgpack.UnpackException) as e:
      self._drop()
      kind = 'no answer within the deadline' if isinstance(e, socket.timeout) else 'failed'
      self.failed = f'{kind}: {type(e).__name__}: {e}'
      raise PeerError(f'{self}: {what}: {kind} ({self.timeout_s:g} s per request, '
                      f'ORBAX_PATHWAYS_TIER_PEER_TIMEOUT_S): {type(e).__name__}: {e}') from e


class _Holding:
  """One array's chunks as peers hold them: origin -> (peer, entry name, file)."""

  def __init__(self, dtype: str, shape: tuple[int, ...], chunk_shape: tuple[int, ...]):
    self.dtype, self.shape, self.chunk_shape = dtype, shape, chunk_shape
    self.files: dict[tuple[int, ...], tuple[_Peer, str, str]] = {}


class _Lazy(Container):
  """The origins a source holds of one array, found out the first time the planner asks."""

  def __init__(self, source: 'PeerSource', read: Any):
    self._source, self._read = source, read

  def __contains__(self, origin: object) -> bool:
    h = self._source.holding(self._read)
    return h is not None and origin in h.files


class PeerSource:
  """Chunks of the other processes' tiers for one item of one restore (after this node's own
  tier in the chain, before storage). Only entries whose save id the committed index records
  for their writer, and not of a writer this node itself holds, are asked for."""

  name = 'peer'

  def __init__(self, exchange: Exchange, prefix: str, item_parts: tuple[str, str, str],
               save_ids: Mapping[str, str], local_writers: Container[str],
               problems: list[str]):
    self.exchange, self.prefix, self.item_parts = exchange, prefix, item_parts
    self.save_ids, self.local_writers = dict(save_ids), local_writers
    self.problems = problems  # the chain's: one log line per restore says what fell back
    self._arrays: dict[str, list[_Holding]] | None = None
    self._found: dict[int, dict[str, Any]] = {}
    self._peers: dict[int, _Peer] = {}
    self._joined: dict[tuple[str, tuple[int, ...], tuple[int, ...]], _Holding | None] = {}
    self._lock = threading.Lock()

  def _discover(self) -> dict[str, list[_Holding]]:
    found, missing = self.exchange.gather(self.prefix)
    self._found = found
    if missing:
      self.problems.append(
          f'peer process(es) {", ".join(map(str, missing[:16]))} did not say what they hold '
          f'within {self.exchange.timeout_s:g} s (key prefix {self.prefix})')
    wanted: dict[int, _Peer] = {}
    for p, v in sorted(found.items()):
      if any(self.save_ids.get(w) == s and w not in self.local_writers for w, s in v['entries']):
        wanted[p] = self._peers[p] = _Peer(p, v['addr'], self.exchange.timeout_s)
    arrays: dict[str, list[_Holding]] = {}
    claimed: set[str] = set()  # a writer's entry is taken from the first peer that lists it

    def listing(peer: _Peer):
      return peer.request({'op': 'list', 'item': list(self.item_parts)},
                          f'the list of {"/".join(self.item_parts)}')

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(wanted) or 1)) as pool:
      answers = list(zip(wanted.values(), pool.map(_quietly(listing), wanted.values())))
    for peer, answer in answers:
      if isinstance(answer, Exception):
        self.problems.append(str(answer))
        continue
      for entry, e in sorted(answer.items()):
        writer = e['writer']
        if (self.save_ids.get(writer) != e['save_id'] or writer in self.local_writers
            or writer in claimed):
          continue
        claimed.add(writer)
        for name, a in e['arrays'].items():
          h = _Holding(a['dtype'], tuple(a['shape']), tuple(a['chunk_shape']))
          h.files = {tuple(o): (peer, entry, f) for o, f in zip(a['origins'], a['files'])}
          arrays.setdefault(name, []).append(h)
    return arrays

  def _discovered(self) -> None:
    with self._lock:
      if self._arrays is None:
        self._arrays = self._discover()

  def live(self) -> frozenset[int]:
    """This process and the others that published in time and have not failed a request in
    this restore (the relay's view of who can share a storage read)."""
    self._discovered()
    with self._lock:
      return frozenset([self.exchange.me] + [
          p for p in self._found if p not in self._peers or not self._peers[p].failed])

  def peer(self, process: int) -> _Peer | None:
    """The server of another process that published in time (one per process and restore)."""
    self._discovered()
    with self._lock:
      if process not in self._peers and process in self._found:
        self._peers[process] = _Peer(process, self._found[process]['addr'],
                                     self.exchange.timeout_s)
      return self._peers.get(process)

  def holding(self, read: Any) -> _Holding | None:
    """What peers hold of ``read``'s array in its stored layout (every writer's chunks joined;
    found out once per restore, joined once per array)."""
    if read.chunk_shape is None:
      return None
    key = (read.name, tuple(read.chunk_shape), tuple(read.plan.global_shape))
    with self._lock:
      if self._arrays is None:
        self._arrays = self._discover()
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
    """The chunk's bytes from the peer that holds it; ``PeerError`` (naming the peer) if it
    cannot deliver them in time. (``dtype``, the stored one, is the peer's manifest's.)"""
    del dtype
    import ml_dtypes  # pylint: disable=g-import-not-at-top,unused-import  (registers bfloat16 & co.)
    h = self.holding(read)
    where = h.files.get(chunk.start) if h is not None else None
    if h is None or where is None:
      raise PeerError(f'no peer holds chunk {list(chunk.start)} of {read.name!r}')
    peer, entry, file = where
    out = np.empty(chunk.shape, np.dtype(h.dtype))
    budget.take(out.nbytes)
    try:
      peer.request({'op': 'get', 'item': list(self.item_parts), 'entry': entry, 'file': file},
                   f'chunk {list(chunk.start)} of {read.name!r}', into=out)
    finally:
      budget.give(out.nbytes)
    return out


def _quietly(fn):
  def call(arg):
    try:
      return fn(arg)
    except PeerError as e:
      return e
  return call


def item_parts(item_dir: str) -> tuple[str, str, str]:
  """(root key, step name, item name): where ``item_dir``'s entries sit under a tier."""
  root, step_name, item = layout.split_item_dir(item_dir)
  return layout.root_key(root), step_name, item
