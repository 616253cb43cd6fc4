"""Chunks of another host's node-local tier: a small TCP server per process and the restore's
peer source, with a deadline on every wait, a cap on bytes in flight, and the job's secret on
every connection.

Why a direct channel, not JAX collectives: a collective needs every process to enter it with
the same shapes at the same time, so a restore would need a global plan of who sends which
chunk to whom, and one host that died or stalled would hang (or, in gloo, fail after its own
timeout) the collective for everybody. With one server per process, each reader pulls only the
chunks it lacks, when it needs them, each request with its own deadline; a dead or silent peer
costs its chunks a trip to storage, never the restore.

Who calls what, on which host (multi-controller JAX, every process):

- ``transports/local.read`` makes an ``Exchange`` per restore (jax's key-value client, this
  process's index, the process count, ``Options.tier_peer_timeout_s``) and reads the job's
  secret through it (``Exchange.secret`` -> ``job_secret``: once per process, then cached), then
  hands it to ``tier/chain.for_restore``, which calls ``serve`` (starts this process's server
  once, with that secret) and ``Exchange.publish`` (one holder key per writer whose chunks this
  node's usable entries hold, by the index's writer column, then one key: this server's
  address and the (writer, save id) of the entries this node holds of the item that the
  committed index records).
- The server (``_Server``, a thread per connection, at most ``wire.Limits.max_connections``)
  serves only this node's tier directory, only to a client that proved the job's secret
  (``tier/wire.py``: the handshake, a MAC on every request, the size caps, the idle deadline),
  only complete manifests, only the regular files they name, of the size they record, never
  through a symlink (``tier/fsafe.py``). Error answers name paths relative to the tier.
- ``PeerSource`` joins the chain after this node's own tier. When the planner asks it for a
  chunk, it looks up the chunk's writer in the committed index, reads that writer's holder keys
  (``Exchange.holders``: one directory read per writer and restore) and asks the first holder,
  once, which chunks it holds of the item (``list``). A writer without a holder key sends it to
  every process's key once (``Exchange.gather``, one deadline for all): lost, or late? An index
  without the writer column takes that full look at once and lists every peer that holds a
  usable entry. A chunk then comes with one ``get``: the bytes streamed into a buffer of the
  committed record's dtype and size (an answer of another size is refused unread). The chain
  checks each chunk's crc32c and size against storage's index before using it.

What grows with what: each process publishes one key per restored item, of constant size in
the fleet (its address and the save ids of the entries its node holds, one per writer on the
node), one holder key per writer whose chunks it holds, and reads the job's secret once in its
life. A reader reads one holder key and sends one ``list`` per writer whose chunks it lacks
(the answer lists that peer's chunks of the item, at most ``wire.MAX_LIST_BYTES``); only a
writer that no survivor holds (or an index without the column, or the relay) costs one read of
every process's key. Then one ``get`` per chunk, over at most ``CONNECTIONS_PER_PEER``
connections per peer. A server holds at most ``max_connections`` connections and threads,
however many readers ask. The per-chunk lists are never in the key-value store. Memory: at
most ``MAX_INFLIGHT_BYTES`` of chunk buffers being received from peers at once per process (one
chunk larger than that goes alone); the chain copies each into the region's buffer as soon as
it checked out, and the server streams files (``sendfile``) without reading them whole. Keys of
the restore before last are deleted by their publisher (holder keys: the directory, by every
process).

No jax here: the key-value client arrives as an object with ``key_value_set`` (which refuses
to overwrite a key), ``blocking_key_value_get``, ``key_value_try_get``, ``key_value_delete``
and, where it has one, ``key_value_dir_get`` (every key already published, in one request).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import secrets
import socket
import socketserver
import stat
import threading
import time
from typing import Any, Callable, Container, Iterable, Mapping

import msgpack
import numpy as np

from orbax_pathways import stats
from orbax_pathways.coord import rounds
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.tier import fsafe
from orbax_pathways.tier import manifest as manifest_lib
from orbax_pathways.tier import wire

Box = boxes_lib.Box
log = logging.getLogger('orbax_pathways')

MAX_INFLIGHT_BYTES = 64 << 20  # chunk bytes received from peers and not yet copied, per process
ADDRESS_ENV = 'ORBAX_PATHWAYS_PEER_ADDRESS'  # the address this host's peers reach it at
_PART = re.compile(r'^[A-Za-z0-9_.=+-]+$')
_FILE = re.compile(r'^\d+\.\d+\.bin$')
_STREAM = 1 << 20
CONNECTIONS_PER_PEER = 4  # a reader's connections to one peer (its reading threads share them)


class PeerError(Exception):
  """A peer did not deliver: refused, closed, answered an error, or missed its deadline."""


# ---- the server: this node's tier, to the other processes -------------------------------------


def _safe(part: Any) -> str:
  if not isinstance(part, str) or not _PART.match(part) or part in ('.', '..'):
    raise ValueError(f'not a tier path component: {str(part)[:64]!r}')
  return part


_ops: dict[str, Callable[[Mapping[str, Any]], np.ndarray]] = {}


def register_op(name: str, fn: Callable[[Mapping[str, Any]], np.ndarray]) -> None:
  """Adds a request kind the server answers with ``fn(request)``'s bytes (``tier/relay.py``:
  ``relay``, a chunk read from storage for several processes)."""
  _ops[name] = fn


class _Counts:
  """What this process's servers refused, by ``wire.REASONS`` (``server_counts``), and one
  warning per ``LOG_EVERY_S`` for connections that did not prove the job's secret."""

  def __init__(self) -> None:
    self._n = dict.fromkeys(wire.REASONS, 0)
    self._lock = threading.Lock()
    self._logged_at = -math.inf
    self._unlogged = 0

  def refused(self, reason: str, address: str, detail: str) -> None:
    stats.count_peer_refused(reason)  # the public count (``stats.peer_server()``)
    with self._lock:
      self._n[reason] = self._n.get(reason, 0) + 1
      if reason != 'unauthenticated':
        return
      self._unlogged += 1
      now = time.monotonic()
      if now - self._logged_at < LOG_EVERY_S:
        return
      self._logged_at, n, self._unlogged = now, self._unlogged, 0
    log.warning('orbax_pathways: the node-local tier\'s peer server closed %d connection(s) '
                'unread that did not prove this job\'s secret (the latest from %s: %s). '
                'Something outside the job reaches this port; it got no data (see the trust '
                'model in docs/architecture.md). At most one such line per %d s.', n, address,
                detail, LOG_EVERY_S)

  def snapshot(self) -> dict[str, int]:
    with self._lock:
      return dict(self._n)


COUNTS = _Counts()
LOG_EVERY_S = 60


def server_counts() -> dict[str, int]:
  """Connections this process's tier servers closed unread, by reason: 'unauthenticated' (no
  or a wrong proof of the job's secret, or a request with a wrong MAC), 'oversized' (a request
  above ``wire.Limits.max_request_bytes``), 'idle' (silent past ``idle_s``), 'busy' (beyond
  ``max_connections``)."""
  return COUNTS.snapshot()


@dataclasses.dataclass(frozen=True)
class _Listed:
  """One complete entry as the server read its manifest: what ``list`` says of it and the
  recorded size of every file it names (the only files ``get`` opens)."""

  writer: str
  save_id: str
  arrays: dict[str, Any]
  sizes: dict[str, int]


class _Manifests:
  """Complete entries' manifests by entry directory, re-read when the manifest changed (its
  inode, size or mtime), at most ``cap`` kept. Never through a symlink: every directory from
  the tier root down is checked with ``lstat``, the manifest is read with ``fsafe.read_small``
  (a regular file only, ``O_NOFOLLOW``)."""

  def __init__(self, local_dir: str, cap: int = 32):
    self.local_dir, self.cap = local_dir, cap
    self._cache: collections.OrderedDict[str, tuple[tuple[int, int, int], _Listed]] = (
        collections.OrderedDict())
    self._lock = threading.Lock()

  def get(self, parts: tuple[str, str, str], entry: str) -> _Listed | None:
    """The entry ``entry`` of item ``parts`` (root key, step, item), or None: not a real
    directory, no (or a damaged) manifest, or one that does not describe this entry."""
    path = self.local_dir
    for p in (*parts, entry):
      path = os.path.join(path, p)
      if not fsafe.is_dir(path):
        return None
    manifest = os.path.join(path, manifest_lib.MANIFEST)
    try:
      st = os.lstat(manifest)
    except OSError:
      return None
    if not stat.S_ISREG(st.st_mode):
      return None
    key = (st.st_ino, st.st_size, st.st_mtime_ns)
    with self._lock:
      hit = self._cache.get(path)
      if hit is not None and hit[0] == key:
        self._cache.move_to_end(path)
        return hit[1]
    try:
      m = manifest_lib.decode(fsafe.read_small(manifest))
    except (OSError, ValueError):
      return None
    listed = _described(m, parts, entry)
    if listed is not None:
      with self._lock:
        self._cache[path] = (key, listed)
        while len(self._cache) > self.cap:
          self._cache.popitem(last=False)
    return listed


def _described(m: manifest_lib.Manifest, parts: tuple[str, str, str], entry: str) -> _Listed | None:
  """``m`` as listed, if it is the manifest of ``entry`` of item ``parts`` (its writer, save
  id, checkpoint directory, step and item) and names only chunk files, each once, with a size."""
  try:
    if (manifest_lib.entry_name(m.writer, m.save_id) != entry or m.step_name != parts[1]
        or m.item != parts[2] or manifest_lib.root_key(m.root) != parts[0]):
      return None
    sizes: dict[str, int] = {}
    arrays = {}
    for a in m.arrays:
      if not len(a.files) == len(a.origins) == len(a.nbytes):
        return None
      for f, n in zip(a.files, a.nbytes):
        if not isinstance(f, str) or not _FILE.match(f) or f in sizes or int(n) < 0:
          return None
        sizes[f] = int(n)
      arrays[a.name] = {'dtype': a.dtype, 'shape': list(a.shape),
                        'chunk_shape': list(a.chunk_shape),
                        'origins': [list(o) for o in a.origins], 'files': list(a.files)}
  except (TypeError, ValueError):
    return None
  return _Listed(m.writer, m.save_id, arrays, sizes)


def _item(req: Mapping[str, Any]) -> tuple[str, str, str]:
  item = req.get('item')
  if not isinstance(item, (list, tuple)) or len(item) != 3:
    raise ValueError('a request names an item as [root key, step, item]')
  return _safe(item[0]), _safe(item[1]), _safe(item[2])


class _Handler(socketserver.BaseRequestHandler):
  """One connection (its own thread, one of the server's ``max_connections``): the handshake,
  then requests answered in order until the reader closes it or falls silent."""

  server: '_Server'

  def handle(self) -> None:
    sock, srv = self.request, self.server
    address = '%s:%s' % tuple(self.client_address[:2])
    try:
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      session = wire.accept(sock, srv.secret, srv.limits)
      while True:
        body = wire.recv_request(sock, session, srv.limits)
        if body is None:
          return
        req = msgpack.unpackb(body, raw=False)
        if not isinstance(req, dict):
          return
        sock.settimeout(srv.limits.idle_s)  # an answer the reader stops taking ends here
        self.answer(sock, req)
    except wire.Refused as e:
      COUNTS.refused(e.reason, address, str(e))
    except (OSError, ValueError, msgpack.UnpackException):
      return

  def answer(self, sock: socket.socket, req: Mapping[str, Any]) -> None:
    """Prepares the answer (an error answers with its text: names relative to the tier, never
    its absolute path), then sends it: a failure while sending closes the connection, never a
    second header in the middle of a payload."""
    try:
      found = self.prepare(req)
    except Exception as e:  # pylint: disable=broad-except  (answered as an error, never raised)
      text = self.server.scrub(f'{type(e).__name__}: {e}').encode()[:wire.MAX_ERROR_BYTES]
      sock.sendall(wire.ANSWER.pack(1, len(text)) + text)
      return
    if isinstance(found, bytes):
      sock.sendall(wire.ANSWER.pack(0, len(found)) + found)
    elif isinstance(found, np.ndarray):
      sock.sendall(wire.ANSWER.pack(0, found.nbytes))
      sock.sendall(found.reshape(-1).view(np.uint8).data)
    else:
      f, size = found
      with f:
        sock.sendall(wire.ANSWER.pack(0, size))
        sent = sock.sendfile(f, 0, size)  # streamed: the file is never read whole into memory
        if sent != size:  # shrank since it was opened: the reader must not wait for the rest
          raise OSError(f'sent {sent} of {size} bytes')

  def prepare(self, req: Mapping[str, Any]) -> Any:
    """A ``list``'s payload (bytes), a registered op's array (``register_op``: answered from
    memory), or a ``get``'s (open chunk file, size): only a regular file that a complete
    entry's manifest names, of the size it records, opened without following a symlink."""
    op = req.get('op')
    if isinstance(op, str) and op in _ops:
      return np.ascontiguousarray(_ops[op](req))
    parts = _item(req)
    if op == 'list':
      return self.server.listing(parts)
    if op != 'get':
      raise ValueError(f'unknown request {str(op)[:32]!r}')
    entry, file = _safe(req.get('entry')), req.get('file')
    if not isinstance(file, str) or not _FILE.match(file):
      raise ValueError(f'not a chunk file name: {str(file)[:64]!r}')
    where = f'{"/".join(parts)}/{entry}'
    listed = self.server.manifests.get(parts, entry)
    if listed is None:
      raise FileNotFoundError(f'{where}: no complete entry')
    size = listed.sizes.get(file)
    if size is None:
      raise FileNotFoundError(f'{where}: its manifest names no {file}')
    try:
      return fsafe.open_regular(os.path.join(self.server.local_dir, *parts, entry, file), size), size
    except fsafe.UnsafeError as e:
      raise fsafe.UnsafeError(e.errno, f'{where}/{file} refused: {self.server.scrub(str(e))}'
                              ) from None
    except OSError as e:
      raise OSError(e.errno, f'{where}/{file}: {e.strerror}') from None


class _Server(socketserver.ThreadingTCPServer):
  """One process's server of its node's tier: at most ``limits.max_connections`` connections
  (threads) at once; one more is answered 'busy' and closed by the accepting thread at once."""

  daemon_threads = True
  allow_reuse_address = True
  request_queue_size = 128

  def __init__(self, address: tuple[str, int], local_dir: str, secret: bytes,
               limits: wire.Limits = wire.LIMITS):
    self.local_dir, self.secret, self.limits = local_dir, secret, limits
    self.manifests = _Manifests(local_dir)
    self._slots = threading.BoundedSemaphore(limits.max_connections)
    super().__init__(address, _Handler)

  def process_request(self, request: Any, client_address: Any) -> None:
    if not self._slots.acquire(blocking=False):
      COUNTS.refused('busy', '%s:%s' % tuple(client_address[:2]),
                     f'{self.limits.max_connections} connections served already')
      wire.refuse_busy(request)
      self.shutdown_request(request)
      return
    try:
      super().process_request(request, client_address)
    except BaseException:
      self._slots.release()
      raise

  def process_request_thread(self, request: Any, client_address: Any) -> None:
    try:
      super().process_request_thread(request, client_address)
    finally:
      self._slots.release()

  def handle_error(self, request: Any, client_address: Any) -> None:
    log.debug('orbax_pathways: tier peer server: a connection from %s failed', client_address,
              exc_info=True)

  def scrub(self, text: str) -> str:
    """``text`` without this node's tier path (error answers name paths relative to it)."""
    return text.replace(self.local_dir.rstrip('/') + '/', '').replace(self.local_dir,
                                                                       '<tier dir>')

  def listing(self, parts: tuple[str, str, str]) -> bytes:
    """Every complete entry of one item in this node's tier (real directories only): its
    writer, save id and, per array, the stored layout and the chunk origins with their files."""
    item_dir = os.path.join(self.local_dir, *parts)
    out = {}
    for name in fsafe.subdirs(item_dir):
      listed = self.manifests.get(parts, name)
      if listed is not None:
        out[name] = {'writer': listed.writer, 'save_id': listed.save_id, 'arrays': listed.arrays}
    data = msgpack.packb(out, use_bin_type=True)
    if len(data) > wire.MAX_LIST_BYTES:
      raise ValueError(f'the list of {"/".join(parts)} is {len(data)} bytes, more than the '
                       f'{wire.MAX_LIST_BYTES} a reader accepts')
    return data


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


def serve(local_dir: str, secret: bytes | None = None, limits: wire.Limits | None = None) -> str:
  """Starts (once per process and directory) the server of this node's tier in a daemon
  thread; returns the ``host:port`` peers reach it at (``ORBAX_PATHWAYS_PEER_ADDRESS`` names
  the host, else this host name's address). ``secret``: the job's (``job_secret``); None takes
  the one this process last read (``Exchange.secret``, which the local transport calls before
  the chain serves). ``limits``: the server's bounds (``wire.LIMITS``), at its start."""
  if secret is None:
    secret = _cached_secret()
  if secret is None or len(secret) != wire.SECRET_BYTES:
    raise PeerError('the tier\'s peer server needs this job\'s secret (Exchange.secret()); it '
                    'never serves without one')
  with _servers_lock:
    if local_dir in _servers:
      server, address = _servers[local_dir]
      server.secret = secret  # a later job in this process (jax.distributed restarted)
      return address
    host = _advertised_host()
    server = _Server((host, 0), local_dir, secret, limits or wire.LIMITS)
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


# ---- the job's secret: one per job, through jax's key-value store ------------------------------

SECRET_KEY = 'orbax_pathways/tier_peer_secret'
_secret: tuple[Any, bytes] | None = None  # (the key-value client it was read through, secret)
_secret_lock = threading.Lock()


def _cached_secret() -> bytes | None:
  with _secret_lock:
    return _secret[1] if _secret is not None else None


def job_secret(client: Any, timeout_s: float) -> bytes:
  """The job's 32-byte peer secret: read once per process (and key-value client) and kept for
  the process's life. The first process to get here creates it (``secrets.token_bytes``) and
  publishes it with set-if-absent semantics (jax's ``key_value_set`` refuses to overwrite a
  key); one that loses the race reads the winner's. So: one read (or one write, or a write and
  a read) per process for the whole job, whatever the fleet, and no process waits for another
  to restore. ``PeerError`` if the store cannot give one within ``timeout_s``."""
  global _secret
  with _secret_lock:
    if _secret is not None and _secret[0] is client:
      return _secret[1]
    try:
      raw = client.key_value_try_get(SECRET_KEY)
    except Exception:  # pylint: disable=broad-except  (not there yet: NOT_FOUND)
      raw = None
    if not raw:
      mine = secrets.token_bytes(wire.SECRET_BYTES).hex()
      try:
        client.key_value_set(SECRET_KEY, mine)
        raw = mine
      except Exception:  # pylint: disable=broad-except  (ALREADY_EXISTS: another process won)
        try:
          raw = client.blocking_key_value_get(SECRET_KEY, max(1, int(timeout_s * 1000)))
        except Exception as e:  # pylint: disable=broad-except
          raise PeerError(f'the job\'s peer secret ({SECRET_KEY!r} in jax\'s key-value store) '
                          f'could not be published or read within {timeout_s:g} s: '
                          f'{type(e).__name__}: {e}') from e
    try:
      value = bytes.fromhex(raw)
    except (TypeError, ValueError):
      value = b''
    if len(value) != wire.SECRET_BYTES:
      raise PeerError(f'the job\'s peer secret ({SECRET_KEY!r} in jax\'s key-value store) is '
                      f'not {wire.SECRET_BYTES} hex-encoded bytes; something else wrote that key')
    _secret = (client, value)
    return value


# ---- the key-value exchange: who serves what, per restored item ---------------------------------

HOLDERS = 'h'  # beside a round, its holder keys: <round>.h/<writer>/<process>

# What this process's restores asked of the exchange since it started (``lookup_counts``).
counts: collections.Counter[str] = collections.Counter()


def lookup_counts() -> dict[str, int]:
  """The peer lookups of this process's restores since it started: ``gathers`` (reads of every
  process's key of a restore: once per restored item that needed a writer with no holder, or
  whose index has no writer column), ``holder_reads`` (directory reads of one writer's
  holders), ``keys_read`` (the keys those returned) and ``lists`` (chunk lists asked of
  peers)."""
  return dict(counts)


def to_ask(holders: Mapping[int, Mapping[str, Any]], save_ids: Mapping[str, str],
           me: int) -> list[int]:
  """The processes to ask for one writer's chunks, in order: those whose holder key names an
  entry (its writer, its save id) that the committed index records (``save_ids``: writer ->
  committed save id), never this process. Pure."""
  return sorted(p for p, v in holders.items()
                if p != me and any(len(e) == 2 and save_ids.get(e[0]) == e[1]
                                   for e in v['entries']))


def _name(item_dir: str) -> str:
  """The rounds' name of one restored item: every process restores the same items."""
  return f'tier_peers/{hashlib.sha256(item_dir.encode()).hexdigest()[:16]}'


class Exchange:
  """One restore's view of the other processes, through jax's key-value store (one round per
  restored item: ``coord/rounds.py``). Made by the local transport (every process, every
  restore); ``publish`` once per item."""

  def __init__(self, client: Any, process_index: int, process_count: int, timeout_s: float):
    self.client = client
    self.me = process_index
    self.count = process_count
    self.timeout_s = timeout_s
    self._sequences: dict[str, rounds.Sequence] = {}  # a round's key -> its item's sequence

  def secret(self) -> bytes:
    """The job's peer secret (``job_secret``: read once per process, then cached)."""
    return job_secret(self.client, self.timeout_s)

  def prefix(self, item_dir: str) -> str:
    """The key of this restore's round for ``item_dir`` (one per call). Every process numbers
    its restores of one item alike (multi-controller JAX restores the same items everywhere)."""
    seq = rounds.sequence(_name(item_dir), keep=2)
    key = seq.next()
    self._sequences[key] = seq
    return key

  def _round(self, prefix: str) -> rounds.Round:
    return rounds.Round(self.client, prefix, me=self.me, members=range(self.count),
                        count=self.count, what=f'orbax_pathways: the tier peers of {prefix}')

  def publish(self, prefix: str, address: str, held: Iterable[tuple[str, str]],
              holds: Mapping[str, Iterable[tuple[str, str]]] | None = None) -> None:
    """Publishes, under ``prefix``, this process's server and the (writer, save id) of the
    entries its node holds of the item, and first, for each writer whose chunks those entries
    hold (``holds``: writer -> the entries holding its chunks; by the committed index's writer
    column), one holder key (``<round>.h/<writer>/<me>``) that readers lacking that writer's chunks
    read instead of every process's key. Then deletes its own keys of the restore before last
    (every process is past it: nobody reads them now)."""
    rnd = self._round(prefix)
    for writer, entries in sorted((holds or {}).items()):
      if _PART.match(writer):
        rnd.publish_at(f'{HOLDERS}/{writer}', json.dumps(
            {'addr': address, 'entries': sorted(set(map(tuple, entries)))}))
    value = json.dumps({'addr': address, 'entries': sorted(set(map(tuple, held)))})
    rnd.publish(value, overwrite=False)
    seq = self._sequences.get(prefix)
    if seq is not None:
      seq.retire(self.client, self.me, whole=False, subdirs=(HOLDERS,))

  def holders(self, prefix: str, writer: str) -> dict[int, dict[str, Any]]:
    """The processes that published, under ``prefix``, a holder key for ``writer`` (one
    directory read: the holders of that writer's chunks, not the fleet), by process index."""
    if not _PART.match(writer):
      return {}
    found = {}
    for p, raw in self._round(prefix).listing(f'{HOLDERS}/{writer}').items():
      try:
        v = json.loads(raw)
        found[p] = {'addr': str(v['addr']), 'entries': [tuple(e) for e in v['entries']]}
      except (ValueError, KeyError, TypeError):  # not what a peer publishes
        pass
    counts['keys_read'] += len(found)
    counts['holder_reads'] += 1
    return found

  def gather(self, prefix: str) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """The other processes' published values (one deadline for all, in total: a restore reads
    storage rather than wait longer), and the processes whose key did not appear in time. One
    request for every key already there (a directory read of the round), then one blocking
    read per process still missing."""
    others = [p for p in range(self.count) if p != self.me]
    got = self._round(prefix).gather(self.timeout_s, processes=others, on_silence=False,
                                     missing_ok=True)
    counts['gathers'] += 1
    counts['keys_read'] += len(got)
    found: dict[int, dict[str, Any]] = {}
    for p, raw in got.items():
      try:
        found[p] = json.loads(raw)
      except ValueError:  # not what a peer publishes: treated as not published
        pass
    return found, [p for p in others if p not in found]


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
          raise PeerError(f'{self} failed earlier in this restore ({self.failed})')
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
    allocated); raises ``PeerError`` naming the peer and what was asked, and marks the peer
    failed, past ``timeout_s``, on a broken bound or on any error but an error answer or a full
    server. A pooled connection the server closed meanwhile (its idle deadline) is replaced
    once."""
    if self.failed:
      raise PeerError(f'{self} failed earlier in this restore ({self.failed}); {what} not asked')
    body = msgpack.packb(dict(req), use_bin_type=True)
    if len(body) > wire.LIMITS.max_request_bytes:
      raise PeerError(f'{what}: a request of {len(body)} bytes, more than the '
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
        raise PeerError(f'{self}: {what}: {e}; read from storage instead') from e
      except PeerError:
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
    """An answer's payload; ``PeerError`` for an error answer (the connection stays usable:
    the caller gives it back only on success, so it is dropped here after reading the text)."""
    if status != 0:
      text = wire.recv_bounded(conn.sock, n, wire.MAX_ERROR_BYTES, deadline)
      raise PeerError(f'{self} answered an error for {what}: '
                      f'{text.decode(errors="replace")}')
    if into is None:
      return msgpack.unpackb(wire.recv_bounded(conn.sock, n, wire.MAX_LIST_BYTES, deadline),
                             raw=False)
    if n != into.nbytes:  # the rest is not read: the connection is dropped
      raise PeerError(f'{self} has {n} bytes for {what}; the committed record says '
                      f'{into.nbytes}')
    view = into.reshape(-1).view(np.uint8).data  # a memoryview of the buffer itself
    for start in range(0, n, _STREAM):
      wire.recv_exact(conn.sock, min(_STREAM, n - start), view[start:start + _STREAM], deadline)
    return into

  def _raise_failed(self, e: BaseException, what: str) -> None:
    kind = 'no answer within the deadline' if isinstance(e, socket.timeout) else 'failed'
    self._fail(f'{kind}: {type(e).__name__}: {e}')
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
    return self._source.holds(self._read, origin)


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
    except PeerError as e:
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
    counts['lists'] += 1
    return self._peers[process].request({'op': 'list', 'item': list(self.item_parts)},
                                        f'the list of {"/".join(self.item_parts)}')

  def _listed_answer(self, process: int, answer: Any) -> None:
    try:
      listed = _parse_listing(self._peers[process], answer)
    except PeerError as e:
      self.problems.append(str(e))
      return
    for writer, save_id, held in listed:
      if (self.save_ids.get(writer) != save_id or writer in self.local_writers
          or writer in self._claimed):
        continue
      self._claimed.add(writer)  # a writer's entry is taken from the first peer that lists it
      for name, h in held.items():
        self._arrays.setdefault(name, []).append(h)
    self._joined.clear()
    self._listed[process] = True

  def _holders_of(self, writer: str) -> dict[int, dict[str, Any]]:
    """``writer``'s holder keys (one directory read, once per restore); a writer with none is
    looked for once more after every process's key is in: then it is lost."""
    if writer not in self._holders:
      found = self.exchange.holders(self.prefix, writer)
      if not to_ask(found, self.save_ids, self.exchange.me) and not self._everyone:
        self._gather_everyone()
        found = self.exchange.holders(self.prefix, writer)
      self._holders[writer] = found
    return self._holders[writer]

  def _find(self, read: Any, origin: Any, writer: str) -> None:
    """Lists ``writer``'s holders, in order, until one holds ``origin`` of ``read``'s array (in
    the usual case the first: the writer's own node), or none is left."""
    holders = self._holders_of(writer)
    for p in to_ask(holders, self.save_ids, self.exchange.me):
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
    record's dtype (``dtype``, the stored one) and size; ``PeerError`` (naming the peer) if the
    peer's copy is of another dtype or size, or it cannot deliver the bytes in time."""
    h = self.holding(read)
    where = h.files.get(chunk.start) if h is not None else None
    if h is None or where is None:
      raise PeerError(f'no peer holds chunk {list(chunk.start)} of {read.name!r}')
    peer, entry, file = where
    stored = np.dtype(dtype)
    if h.dtype != stored.name:
      raise PeerError(f'{peer} holds {read.name!r} as {h.dtype}; the committed record says '
                      f'{stored.name}: not used')
    record = read.chunks.get(chunk.start) if getattr(read, 'chunks', None) else None
    nbytes = chunk.size * stored.itemsize
    if record is not None and int(record.nbytes) != nbytes:
      raise PeerError(f'chunk {list(chunk.start)} of {read.name!r}: {nbytes} bytes of '
                      f'{list(chunk.shape)} {stored.name}, the committed record says '
                      f'{record.nbytes}: not asked')
    out = np.empty(chunk.shape, stored)
    budget.take(out.nbytes)
    try:
      peer.request({'op': 'get', 'item': list(self.item_parts), 'entry': entry, 'file': file},
                   f'chunk {list(chunk.start)} of {read.name!r}', into=out)
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
  """A peer's ``list`` answer as (writer, save id, array name -> chunks held); ``PeerError``
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
        if len(origins) != len(files) or not all(isinstance(f, str) and _FILE.match(f)
                                                 for f in files):
          raise ValueError(f'array {str(name)[:64]!r}: origins and files do not match')
        h.files = {tuple(int(x) for x in o): (peer, entry, f) for o, f in zip(origins, files)}
        held[str(name)] = h
      out.append((e['writer'], str(e['save_id']), held))
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    raise PeerError(f'{peer} sent a list that is not a tier listing ({type(e).__name__}: '
                    f'{str(e)[:200]}); its chunks are read from storage') from e
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
  root, step_name, item = manifest_lib.split_item_dir(item_dir)
  return manifest_lib.root_key(root), step_name, item
