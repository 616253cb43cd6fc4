"""The tier's peer channel on the wire: the job-secret handshake, authenticated requests, and
the bound on every receive. Sockets and bytes only (no numpy, no files, no jax). Also what
both ends share: the names a request or a list answer may carry (``PART_RE``, ``FILE_RE``) and
``PeerError``, what the channel raises when a peer did not deliver (``peer/client.py``,
``fleet/relay.py``, ``peer/server.serve``, ``peer/exchange.job_secret``; caught by
``fleet/chain.py`` and ``transports/in_process.py``).

Who calls what, on which host: ``peer/server.py``'s server (one per process, a thread per
connection) calls ``accept`` on each new connection, then ``recv_request`` per request;
``peer/client.py``'s client (``_Peer``, on the restoring process) calls ``connect`` once per
pooled connection, then ``send_request`` and ``recv_header`` / ``recv_bounded`` per request.

A connection (``K`` is the job's 32-byte secret, ``peer/exchange.job_secret``; every MAC is
HMAC-SHA256 under ``K`` over a label and the parts, each compared with
``hmac.compare_digest``)::

    server -> client   HELLO: magic 'OPTP', version, status (0 ready, 1 busy), nonce Ns (16 B)
    client -> server   nonce Nc (16 B), MAC('client', Ns, Nc)
    server -> client   MAC('server', Ns, Nc)
    then per request:
    client -> server   length n (4 B, at most Limits.max_request_bytes),
                       MAC('request', Ns, Nc, seq, body) (seq: 0, 1, ... on this connection),
                       body (n bytes of msgpack)
    server -> client   status (0 ok, 1 error), length (8 B), payload

    a ``put`` (a partner copy's file, ``fleet/receive.py``): the request names the file, its
    size and crc32c; that many raw bytes follow it; then the answer (0 bytes when ok). A put
    the server refuses is answered before the body is read, and the connection is closed.

What the server refuses, closing the connection without reading further and counting why
(``REASONS``): a client that does not send a valid proof within ``Limits.handshake_s``
('unauthenticated'; nothing it sent is parsed, at most 48 bytes are read), a request whose MAC
is wrong ('unauthenticated'), a length above the cap ('oversized'; refused before anything is
allocated), silence past ``Limits.idle_s`` while a request is awaited or arrives ('idle'),
and a connection beyond ``Limits.max_connections`` ('busy', answered with a busy HELLO at
once). The client, for its part, checks the server's proof before it sends a request (a
process that took over a dead server's port learns nothing and is not believed), and receives
an answer only into a buffer bounded by what it expects (``recv_bounded``: bytes are taken as
they arrive, so a header claiming 1 TiB allocates nothing).

Not protected (docs/architecture.md, "Trust model"): answers carry no MAC and nothing is
encrypted, so an observer on the path reads the chunks that travel; the restore checks each
chunk's crc32c and size against the committed record (which catches damage, replays and stale
copies, not a chunk crafted to a known crc32c by someone who can rewrite packets in flight).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import re
import secrets
import socket
import struct
import time

import crc32c as _crc32c

from orbax_pathways import stats

MAGIC = b'OPTP'
VERSION = 1
READY, BUSY = 0, 1
SECRET_BYTES = 32
NONCE_BYTES = 16
MAC_BYTES = 32
MAX_ERROR_BYTES = 4 << 10  # an error answer's text (the server truncates to it)
# A list answer: one peer's complete entries of one item (its node's writers' chunk lists). It
# shrinks as the fleet grows (a node's share of the item); 64 MiB is the size a tier manifest
# may have (``fsafe.MAX_SMALL_BYTES``), i.e. millions of chunks.
MAX_LIST_BYTES = 64 << 20
REASONS = stats.PEER_REFUSED  # counted in ``stats.peer_server()``
PART_RE = re.compile(r'^[A-Za-z0-9_.=+-]+$')  # a tier path component (and a holder key's writer)
FILE_RE = re.compile(r'^\d+\.\d+\.bin$')  # a chunk file's name (a get, a list answer)

_HELLO = struct.Struct(f'!4sBB{NONCE_BYTES}s')
_LENGTH = struct.Struct('!I')  # a request's body bytes
_SEQ = struct.Struct('!Q')
ANSWER = struct.Struct('!BQ')  # status (0 ok, 1 error), payload bytes
_PIECE = 1 << 20  # bytes taken per receive of an answer of unknown content


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one server allows (per process; ``peer/server.serve``)."""

  max_connections: int = 64  # served at once, one thread each; more are refused at once
  handshake_s: float = 10.0  # a new connection must prove the job's secret within this
  idle_s: float = 60.0  # silence allowed while a request is awaited, arrives, or is answered
  max_request_bytes: int = 8 << 10  # a request (a list, get or relay: a few hundred bytes)


LIMITS = Limits()


class PeerError(Exception):
  """A peer did not deliver: refused, closed, answered an error, or missed its deadline."""


class Refused(Exception):
  """Server side: why a connection is closed unread (one of ``REASONS``)."""

  def __init__(self, reason: str, detail: str):
    super().__init__(f'{reason}: {detail}')
    self.reason = reason


class BusyError(ConnectionError):
  """Client side: the server is serving ``Limits.max_connections`` connections already."""


class ProtocolError(ValueError):
  """Client side: the other end is not a tier server of this job (wrong magic or version, or
  its proof of the job's secret is wrong), or its answer breaks the channel's bounds."""


def mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
  h = hmac.new(secret, label, hashlib.sha256)
  for p in parts:
    h.update(_SEQ.pack(len(p)))  # length-prefixed: no two part lists give one MAC input
    h.update(p)
  return h.digest()


def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None,
               deadline: float | None = None) -> memoryview:
  """``n`` bytes into ``into`` (or a new buffer of ``n``: callers bound ``n`` first);
  ``socket.timeout`` past ``deadline``, ``ConnectionError`` if the other end closes first."""
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


def recv_bounded(sock: socket.socket, n: int, limit: int, deadline: float) -> bytes:
  """An answer of ``n`` bytes that may be at most ``limit``: ``ProtocolError`` above it
  (nothing read), else taken piece by piece as it arrives (memory follows the bytes that came,
  never the length claimed)."""
  if n > limit:
    raise ProtocolError(f'an answer of {n} bytes, more than the {limit} this channel accepts')
  out = bytearray()
  while len(out) < n:
    piece = recv_exact(sock, min(_PIECE, n - len(out)), deadline=deadline)
    out += piece
  return bytes(out)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
  left = deadline - time.monotonic()
  if left <= 0:
    raise socket.timeout('no time left to send')
  sock.settimeout(left)
  sock.sendall(data)


# ---- the server's side -------------------------------------------------------------------------


@dataclasses.dataclass
class Session:
  """One authenticated connection: both nonces, and the next request's sequence number."""

  secret: bytes
  nonces: bytes
  seq: int = 0

  def request_mac(self, body: bytes) -> bytes:
    return mac(self.secret, b'request', self.nonces, _SEQ.pack(self.seq), body)


def refuse_busy(sock: socket.socket) -> None:
  """A busy HELLO, sent without waiting (the accepting thread must never block on it)."""
  try:
    sock.setblocking(False)
    sock.send(_HELLO.pack(MAGIC, VERSION, BUSY, bytes(NONCE_BYTES)))
  except OSError:
    pass


def accept(sock: socket.socket, secret: bytes, limits: Limits) -> Session:
  """The server's handshake on a new connection: HELLO, then the client's proof (48 bytes,
  within ``limits.handshake_s``), then its own. ``Refused('unauthenticated')`` if the proof is
  wrong or late; nothing else the client sent is read."""
  deadline = time.monotonic() + limits.handshake_s
  nonce = secrets.token_bytes(NONCE_BYTES)
  _send(sock, _HELLO.pack(MAGIC, VERSION, READY, nonce), deadline)
  try:
    proof = bytes(recv_exact(sock, NONCE_BYTES + MAC_BYTES, deadline=deadline))
  except socket.timeout as e:
    raise Refused('unauthenticated', f'no proof of the job\'s secret within '
                  f'{limits.handshake_s:g} s') from e
  except ConnectionError as e:
    raise Refused('unauthenticated', 'closed before proving the job\'s secret') from e
  client_nonce, tag = proof[:NONCE_BYTES], proof[NONCE_BYTES:]
  if not hmac.compare_digest(tag, mac(secret, b'client', nonce, client_nonce)):
    raise Refused('unauthenticated', 'a wrong proof of the job\'s secret')
  _send(sock, mac(secret, b'server', nonce, client_nonce), deadline)
  return Session(secret, nonce + client_nonce)


def recv_request(sock: socket.socket, session: Session, limits: Limits) -> bytes | None:
  """The next request's body on an authenticated connection, or None when the client closed
  it between requests. The request must arrive whole within ``limits.idle_s``; ``Refused``
  ('idle', 'oversized' before anything is allocated, 'unauthenticated' for a wrong MAC)."""
  deadline = time.monotonic() + limits.idle_s
  try:
    head = recv_exact(sock, _LENGTH.size, deadline=deadline)
  except ConnectionError:
    return None
  except socket.timeout as e:
    raise Refused('idle', f'no request within {limits.idle_s:g} s') from e
  (n,) = _LENGTH.unpack(head)
  if n > limits.max_request_bytes:
    raise Refused('oversized', f'a request of {n} bytes (at most {limits.max_request_bytes})')
  try:
    rest = bytes(recv_exact(sock, MAC_BYTES + n, deadline=deadline))
  except socket.timeout as e:
    raise Refused('idle', f'a request of {n} bytes not whole within {limits.idle_s:g} s') from e
  tag, body = rest[:MAC_BYTES], rest[MAC_BYTES:]
  if not hmac.compare_digest(tag, session.request_mac(body)):
    raise Refused('unauthenticated', f'request {session.seq}: a wrong MAC')
  session.seq += 1
  return body


# ---- the client's side -------------------------------------------------------------------------


def connect(sock: socket.socket, secret: bytes, deadline: float) -> Session:
  """The client's handshake on a new connection; ``BusyError`` (the server is full),
  ``ProtocolError`` (not a tier server of this job), ``socket.timeout`` past ``deadline``."""
  magic, version, status, nonce = _HELLO.unpack(recv_exact(sock, _HELLO.size, deadline=deadline))
  if magic != MAGIC or version != VERSION:
    raise ProtocolError(f'not an orbax-pathways tier server of this version (hello {magic!r}, '
                        f'version {version})')
  if status == BUSY:
    raise BusyError('the server is serving as many connections as it allows')
  if status != READY:
    raise ProtocolError(f'hello status {status}')
  client_nonce = secrets.token_bytes(NONCE_BYTES)
  _send(sock, client_nonce + mac(secret, b'client', nonce, client_nonce), deadline)
  try:
    proof = bytes(recv_exact(sock, MAC_BYTES, deadline=deadline))
  except ConnectionError as e:
    raise ProtocolError('the server closed the connection at the handshake: it does not hold '
                        'this job\'s secret (a process of another job, or another run of it)'
                        ) from e
  if not hmac.compare_digest(proof, mac(secret, b'server', nonce, client_nonce)):
    raise ProtocolError('the server did not prove this job\'s secret')
  return Session(secret, nonce + client_nonce)


def send_request(sock: socket.socket, session: Session, body: bytes, deadline: float) -> None:
  _send(sock, _LENGTH.pack(len(body)) + session.request_mac(body) + body, deadline)
  session.seq += 1


def recv_header(sock: socket.socket, deadline: float) -> tuple[int, int]:
  """An answer's (status, payload bytes)."""
  status, n = ANSWER.unpack(recv_exact(sock, ANSWER.size, deadline=deadline))
  return status, n


def recv_to_file(sock: socket.socket, fd: int, size: int, *, deadline: float | None = None,
                 idle_s: float | None = None) -> int:
  """A body of ``size`` bytes from ``sock`` into the file ``fd``, in pieces of 1 MiB (never
  held whole), each by ``deadline`` and within ``idle_s`` of the one before; its crc32c."""
  crc, left = 0, size
  buf = memoryview(bytearray(min(_PIECE, size) or 1))
  while left:
    n = min(left, len(buf))
    due = [d for d in (deadline, None if idle_s is None else time.monotonic() + idle_s)
           if d is not None]
    recv_exact(sock, n, buf[:n], deadline=min(due) if due else None)
    crc = _crc32c.crc32c(buf[:n], crc)
    view = buf[:n]
    while view:
      view = view[os.write(fd, view):]
    left -= n
  return crc


def recv_empty_answer(sock: socket.socket, deadline: float, what: str) -> None:
  """The answer to a streamed request (a put): nothing on success; ``PeerError`` with the
  server's refusal of ``what``."""
  status, n = recv_header(sock, deadline)
  if status != 0:
    text = recv_bounded(sock, n, MAX_ERROR_BYTES, deadline)
    raise PeerError(f'it refused {what}: {text.decode(errors="replace")}')
  if n:
    raise ProtocolError(f'an answer of {n} bytes to a put (none expected)')
