"""This node's tier, served to the job's other processes: a small TCP server per process, the
job's secret on every connection, a deadline on every wait and a cap on connections.

Who calls what, on which host (multi-controller JAX, every process):

- ``fleet/chain.for_restore`` calls ``serve`` at every restore: it starts this process's server
  once (a daemon thread), with the job's secret (``peer/exchange.job_secret``, which the local
  transport read just before through ``Exchange.secret``), and returns the address that the
  chain then publishes (``Exchange.publish``): ``ORBAX_PATHWAYS_PEER_ADDRESS`` (``ADDRESS_ENV``)
  names the host, else this host name's address. The server lives as long as the process, so a
  peer still reading after this process's restore ended gets its chunks.
- The server (``_Server``, a thread per connection, at most ``wire.Limits.max_connections``)
  serves only this node's tier directory, only to a client that proved the job's secret
  (``peer/wire.py``: the handshake, a MAC on every request, the size caps, the idle deadline),
  only complete manifests, only the regular files they name, of the size they record, never
  through a symlink (``tier/fsafe.py``). Error answers name paths relative to the tier.
- The requests come from the other processes' restores (``peer/client.py``'s ``_Peer``): ``list``
  (the complete entries of one item: writer, save id and per array the chunks and their files)
  and ``get`` (one chunk file, streamed with ``sendfile``; or, with ``chunk``, one chunk of a
  band file: its rows sent from a read-only mapping of the band), and the kinds of its op
  table (``Ops``; the package's is ``fleet/ops.TABLE``): ``relay`` (``fleet/relay.py``, a chunk
  answered from memory) and, from the processes whose partner this one is
  (``Options.local_copies=2``, ``fleet/partner_copy.py``), ``put``: one file of a partner copy,
  written into this node's tier (``fleet/receive.py``).
- What a server closed unread is counted by reason (``server_counts``, and
  ``stats.peer_server()``), with one warning per ``LOG_EVERY_S`` for connections that did not
  prove the job's secret.

What grows with what: a server holds at most ``max_connections`` connections and threads,
however many readers ask; it streams files (``sendfile``) without reading them whole, and keeps
the manifests it read (at most ``_Manifests.cap``), re-read when one changes. No jax here.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import mmap
import os
import socket
import socketserver
import stat
import threading
import time
from typing import Any, Callable, Mapping

import msgpack
import numpy as np

from orbax_pathways import stats
from orbax_pathways.tier import chunk_read
from orbax_pathways.peer import exchange as exchange_lib
from orbax_pathways.tier import fsafe
from orbax_pathways.tier import manifest as manifest_lib
from orbax_pathways.peer import wire

log = logging.getLogger('orbax_pathways')

ADDRESS_ENV = 'ORBAX_PATHWAYS_PEER_ADDRESS'  # the address this host's peers reach it at


# ---- the server: this node's tier, to the other processes -------------------------------------


def _safe(part: Any) -> str:
  if not isinstance(part, str) or not wire.PART_RE.match(part) or part in ('.', '..'):
    raise ValueError(f'not a tier path component: {str(part)[:64]!r}')
  return part


class Refused(ValueError):
  """A streamed request (``Ops.receive``) this server does not take: answered with the text
  before its body was read, then the connection closes (the body is never drained)."""


@dataclasses.dataclass(frozen=True)
class Ops:
  """A server's op table: the request kinds it answers beyond ``list`` and ``get`` of its own
  tier. ``answer``: kind -> ``fn(request)``, what the answer carries (an array, bytes, or an
  open file and its size, sent with ``sendfile``); ``receive``: kind ->
  ``fn(sock, request, tier, idle_s)``, which reads the request's body from the connection and
  raises ``Refused`` to refuse it. The package's table is ``fleet/ops.TABLE``."""

  answer: Mapping[str, Callable[[Mapping[str, Any]], Any]] = dataclasses.field(
      default_factory=dict)
  receive: Mapping[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
  # kind -> ``fn(tier_dir, request)``: an answer from this server's tier directory (as
  # ``answer``'s kinds; ``fleet/node_receive.py``).
  serve: Mapping[str, Callable[[str, Mapping[str, Any]], Any]] = dataclasses.field(
      default_factory=dict)


NO_OPS = Ops()


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
  # band file -> (origin, shape, itemsize, the chunk boxes (origin, shape) it holds)
  bands: dict[str, tuple[tuple[int, ...], tuple[int, ...], int, frozenset]] = dataclasses.field(
      default_factory=dict)


class _Manifests:
  """Complete entries' manifests by entry directory, re-read when the manifest changed (its
  inode, size or mtime), at most ``cap`` kept. Never through a symlink: every directory from
  the tier root down is checked with ``lstat``, the manifest is read with ``fsafe.read_small``
  (a regular file only, ``O_NOFOLLOW``)."""

  def __init__(self, tier_dir: str, cap: int = 32):
    self.tier_dir, self.cap = tier_dir, cap
    self._cache: collections.OrderedDict[str, tuple[tuple[int, int, int], _Listed]] = (
        collections.OrderedDict())
    self._lock = threading.Lock()

  def get(self, parts: tuple[str, str, str], entry: str) -> _Listed | None:
    """The entry ``entry`` of item ``parts`` (root key, step, item), or None: not a real
    directory, no (or a damaged) manifest, or one that does not describe this entry."""
    path = self.tier_dir
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
        or m.item != parts[2] or manifest_lib.root_key(m.root) != parts[0]
        or manifest_lib.manifest_problem(m)):
      return None
    sizes = manifest_lib.file_sizes(m)
    arrays, bands = {}, {}
    for a in m.arrays:
      if any(not wire.FILE_RE.match(f) for f in a.files):
        return None
      arrays[a.name] = {'dtype': a.dtype, 'shape': list(a.shape),
                        'chunk_shape': list(a.chunk_shape),
                        'origins': [list(o) for o in a.origins], 'files': list(a.files)}
      if a.bands:
        arrays[a.name]['bands'] = [[f, list(o), list(sh)] for f, o, sh in a.bands]
        itemsize = manifest_lib.dtype_of(a.dtype).itemsize
        boxes = manifest_lib.band_boxes(a)
        held: dict[str, set] = {f: set() for f in boxes}
        for o, f in zip(a.origins, a.files):
          if f in held:
            held[f].add((tuple(o), manifest_lib.chunk_box(a, o).shape))
        for f, (o, sh) in boxes.items():
          bands[f] = (o, sh, itemsize, frozenset(held[f]))
  except (TypeError, ValueError):
    return None
  return _Listed(m.writer, m.save_id, arrays, sizes, bands)


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
        op = req.get('op')
        streamed = srv.ops.receive.get(op) if isinstance(op, str) else None
        if streamed is not None:
          if not self.receive(sock, req, streamed):
            return
          continue
        self.answer(sock, req)
    except wire.Refused as e:
      COUNTS.refused(e.reason, address, str(e))
    except (OSError, ValueError, msgpack.UnpackException):
      return

  def receive(self, sock: socket.socket, req: Mapping[str, Any],
              fn: Callable[..., Any]) -> bool:
    """A streamed request (``Ops.receive``: ``put``, a partner copy's file,
    ``fleet/receive.py``); whether the connection can go on. One refused before its body was
    read is answered with why, then the connection closes (the body is never drained); one cut
    short closes it."""
    try:
      fn(sock, req, self.server.tier, self.server.limits.idle_s)
    except Refused as e:
      text = self.server.scrub(f'Refused: {e}').encode()[:wire.MAX_ERROR_BYTES]
      sock.sendall(wire.ANSWER.pack(1, len(text)) + text)
      return False
    sock.sendall(wire.ANSWER.pack(0, 0))
    return True

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
    elif isinstance(found, _BandChunk):
      try:
        sock.sendall(wire.ANSWER.pack(0, found.nbytes))
        found.send(sock)
      finally:
        found.close()
    else:
      f, size = found
      with f:
        sock.sendall(wire.ANSWER.pack(0, size))
        sent = sock.sendfile(f, 0, size)  # streamed: the file is never read whole into memory
        if sent != size:  # shrank since it was opened: the reader must not wait for the rest
          raise OSError(f'sent {sent} of {size} bytes')

  def prepare(self, req: Mapping[str, Any]) -> Any:
    """A ``list``'s payload (bytes), an answer op's array (``Ops.answer``: answered from
    memory), or a ``get``'s (open chunk file, size), or one chunk of a band (``_BandChunk``):
    only a regular file that a complete entry's manifest names, of the size it records, opened
    without following a symlink; only a chunk box the manifest places in that band."""
    op = req.get('op')
    answer = self.server.ops.answer.get(op) if isinstance(op, str) else None
    served = self.server.ops.serve.get(op) if isinstance(op, str) else None
    if answer is not None or served is not None:  # an array, bytes, or (open file, size)
      found = (answer(req) if answer is not None
               else served(self.server.tier_dir, req))  # type: ignore[misc]
      return found if isinstance(found, (bytes, tuple)) else np.ascontiguousarray(found)
    parts = _item(req)
    if op == 'list':
      return self.server.listing(parts)
    if op != 'get':
      raise ValueError(f'unknown request {str(op)[:32]!r}')
    entry, file = _safe(req.get('entry')), req.get('file')
    if not isinstance(file, str) or not wire.FILE_RE.match(file):
      raise ValueError(f'not a chunk file name: {str(file)[:64]!r}')
    where = f'{"/".join(parts)}/{entry}'
    listed = self.server.manifests.get(parts, entry)
    if listed is None:
      raise FileNotFoundError(f'{where}: no complete entry')
    size = listed.sizes.get(file)
    if size is None:
      raise FileNotFoundError(f'{where}: its manifest names no {file}')
    chunk = req.get('chunk')
    if chunk is not None:  # one chunk of a band file; without it, the whole file
      return self._band_chunk(where, parts, entry, file, size, listed.bands.get(file), chunk)
    try:
      return fsafe.open_regular(os.path.join(self.server.tier_dir, *parts, entry, file), size), size
    except fsafe.UnsafeError as e:
      raise fsafe.UnsafeError(e.errno, f'{where}/{file} refused: {self.server.scrub(str(e))}'
                              ) from None
    except OSError as e:
      raise OSError(e.errno, f'{where}/{file}: {e.strerror}') from None


  def _band_chunk(self, where: str, parts: tuple[str, str, str], entry: str, file: str,
                  size: int, band: Any, chunk: Any) -> '_BandChunk':
    """A ``get`` of one chunk of a band file (``chunk``: [origin, shape], one of the chunks the
    manifest places in that band): the band mapped read-only, the chunk's rows sent from it."""
    try:
      box = (tuple(int(x) for x in chunk[0]), tuple(int(x) for x in chunk[1]))
    except (TypeError, ValueError, IndexError):
      box = None
    if band is None or box is None or box not in band[3]:
      raise ValueError(f'{where}/{file}: {str(chunk)[:80]} is not a chunk its manifest places '
                       'in that file')
    path = os.path.join(self.server.tier_dir, *parts, entry, file)
    try:
      f = fsafe.open_regular(path, size)
      try:
        return _BandChunk(f, size, band[0], band[1], band[2], box)
      except BaseException:
        f.close()
        raise
    except fsafe.UnsafeError as e:
      raise fsafe.UnsafeError(e.errno, f'{where}/{file} refused: {self.server.scrub(str(e))}'
                              ) from None
    except OSError as e:
      raise OSError(e.errno, f'{where}/{file}: {e.strerror}') from None


class _BandChunk:
  """One chunk of a band file, as the runs of its bytes in the band's C order (``answer`` sends
  them in order: the chunk's own C order). Closes the file and its mapping when done."""

  def __init__(self, f: Any, size: int, band_start: tuple[int, ...], band_shape: tuple[int, ...],
               itemsize: int, box: tuple[tuple[int, ...], tuple[int, ...]]):
    self.f = f
    self.map = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    rel = tuple(o - b for o, b in zip(box[0], band_start))
    self.offsets = chunk_read.run_offsets(band_shape, rel, box[1], itemsize)
    _, self.run, _ = chunk_read.runs(band_shape, rel, box[1], itemsize)
    self.nbytes = math.prod(box[1]) * itemsize

  def send(self, sock: socket.socket) -> None:
    view = memoryview(self.map)
    try:
      for o in self.offsets:
        sock.sendall(view[o:o + self.run])
    finally:
      view.release()

  def close(self) -> None:
    self.map.close()
    self.f.close()


class _Server(socketserver.ThreadingTCPServer):
  """One process's server of its node's tier: at most ``limits.max_connections`` connections
  (threads) at once; one more is answered 'busy' and closed by the accepting thread at once."""

  daemon_threads = True
  allow_reuse_address = True
  request_queue_size = 128

  def __init__(self, address: tuple[str, int], tier_dir: str, secret: bytes,
               limits: wire.Limits = wire.LIMITS):
    self.tier_dir, self.secret, self.limits = tier_dir, secret, limits
    self.tier: Any = None  # tier.config.TierConfig: set when it takes partner copies (``serve``)
    self.ops: Ops = NO_OPS  # its op table (``serve``)
    self.manifests = _Manifests(tier_dir)
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
    return text.replace(self.tier_dir.rstrip('/') + '/', '').replace(self.tier_dir,
                                                                       '<tier dir>')

  def listing(self, parts: tuple[str, str, str]) -> bytes:
    """Every complete entry of one item in this node's tier (real directories only): its
    writer, save id and, per array, the stored layout and the chunk origins with their files."""
    item_dir = os.path.join(self.tier_dir, *parts)
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


def serve(tier_dir: str, secret: bytes | None = None, limits: wire.Limits | None = None,
          tier: Any = None, ops: Ops | None = None) -> str:
  """Starts (once per process and directory) the server of this node's tier in a daemon
  thread; returns the ``host:port`` peers reach it at (``ORBAX_PATHWAYS_PEER_ADDRESS`` names
  the host, else this host name's address). ``secret``: the job's (``job_secret``); None takes
  the one this process last read (``Exchange.secret``, which the in-process transport calls before
  the chain serves). ``limits``: the server's bounds (``wire.LIMITS``), at its start.
  ``tier``: this node's ``TierConfig`` (``fleet/partner_copy.py``, ``Options.local_copies=2``):
  the server then also takes partner copies into it (``put``); else it refuses them. ``ops``:
  its op table (``fleet/ops.TABLE``; None: the one it has, or none at its start)."""
  if secret is None:
    secret = exchange_lib.cached_secret()
  if secret is None or len(secret) != wire.SECRET_BYTES:
    raise wire.PeerError('the tier\'s peer server needs this job\'s secret (Exchange.secret()); it '
                         'never serves without one')
  with _servers_lock:
    if tier_dir in _servers:
      server, address = _servers[tier_dir]
      server.secret = secret  # a later job in this process (jax.distributed restarted)
      if tier is not None:
        server.tier = tier
      if ops is not None:
        server.ops = ops
      return address
    host = _advertised_host()
    server = _Server((host, 0), tier_dir, secret, limits or wire.LIMITS)
    server.tier, server.ops = tier, ops or NO_OPS
    address = f'{host}:{server.server_address[1]}'
    threading.Thread(target=server.serve_forever, name='orbax-pathways-tier-peer',
                     daemon=True).start()
    _servers[tier_dir] = (server, address)
    return address


def stop_serving() -> None:
  """Closes this process's servers (tests: a peer whose process is gone refuses connections)."""
  with _servers_lock:
    for server, _ in _servers.values():
      server.shutdown()
      server.server_close()
    _servers.clear()
