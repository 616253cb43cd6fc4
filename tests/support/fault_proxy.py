"""A small fault-injecting HTTP/1.1 proxy for tests (stdlib only, loopback only).

It sits in front of one upstream server (fake-gcs-server) and relays requests and responses
byte for byte, streaming bodies (Content-Length or chunked), keeping client and upstream
connections alive. With probability ``rate`` per request, chosen by a seeded RNG, it
instead injects one fault:

- ``"429"`` / ``"503"``: answers that status itself; the request never reaches the server.
- ``"reset"``: resets the client connection (RST) after reading the request head; the request
  never reaches the server.
- ``"reset_after"``: forwards the request, lets the server act on it, then resets the client
  connection instead of relaying the response (a lost response: the write happened).
  Not in the default mix.
- ``"delay"``: forwards the request, then holds the response for ``delay_s`` seconds.

Separately, ``hold(match, count=1)`` makes the next ``count`` requests for which
``match(method, target)`` is true hang: the proxy reads the whole request (answering
``Expect: 100-continue`` itself, so the client sends its body) and then answers nothing, never
forwarding it, until ``release()`` or ``stop()`` resets those connections. That is a request the
server accepted and never answered: the client sees no error, only silence. ``held()`` lists
the (method, target) of the requests held so far; ``log()`` every request received, with its
client's User-Agent (which library sent it: gcsfs, google-cloud-storage, tensorstore).

``bandwidth`` (bytes per second, None: unlimited) caps the bytes of request and response
bodies the proxy relays, all connections together (one token bucket), so storage is slower
than memory as in production (``benchmarks/tier.py``); ``set_bandwidth`` changes it.

``stats()`` returns counts of requests and of faults by kind, so tests can assert on them, and
the body bytes relayed each way (``response_bytes``, ``request_bytes``).
``proxy_errors`` counts connections that ended abnormally, keyed ``phase:method:status:error``.
A few ``relay_response:GET:200:BrokenPipeError`` are normal even at rate 0: a client (gcsfs
or tensorstore) closed its connection without reading a whole response body.

Runs as threads of the process that starts it: the pytest process (``faulty_gcs``) or a child
that counts its own requests (``test_fleet``, ``benchmarks/fleet.py``).
"""

from __future__ import annotations

import random
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from typing import Callable, Iterable

DEFAULT_KINDS = ('429', '503', 'reset', 'delay')
ALL_KINDS = ('429', '503', 'reset', 'reset_after', 'delay')

_CHUNK = 1 << 16
_MAX_HEAD = 1 << 16
_NO_BODY_STATUS = {204, 304}


class _Closed(Exception):
  """The peer closed the connection between messages."""


def _read_head(f) -> tuple[bytes, list[tuple[bytes, bytes]]] | None:
  """Read a start line and headers. None on clean EOF before any byte."""
  start = f.readline(_MAX_HEAD)
  while start in (b'\r\n', b'\n'):  # tolerate stray CRLF between messages
    start = f.readline(_MAX_HEAD)
  if not start:
    return None
  if not start.endswith(b'\n'):
    raise ConnectionError('truncated start line')
  headers = []
  total = 0
  while True:
    line = f.readline(_MAX_HEAD)
    if not line:
      raise ConnectionError('EOF in headers')
    total += len(line)
    if total > _MAX_HEAD:
      raise ConnectionError('headers too large')
    if line in (b'\r\n', b'\n'):
      break
    name, _, value = line.partition(b':')
    headers.append((name.strip(), value.strip()))
  return start.rstrip(b'\r\n'), headers


def _get(headers, name: bytes) -> bytes | None:
  name = name.lower()
  for k, v in headers:
    if k.lower() == name:
      return v
  return None


def _has_token(headers, name: bytes, token: bytes) -> bool:
  v = _get(headers, name)
  return v is not None and token in [t.strip().lower() for t in v.split(b',')]


def _encode_head(start: bytes, headers) -> bytes:
  return start + b'\r\n' + b''.join(k + b': ' + v + b'\r\n' for k, v in headers) + b'\r\n'


def _relay_body(src, dst: Callable[[bytes], None], headers, until_eof: bool) -> None:
  """Copy one message body from file ``src`` to ``dst`` as raw bytes."""
  if _has_token(headers, b'transfer-encoding', b'chunked'):
    while True:
      line = src.readline(_MAX_HEAD)
      if not line.endswith(b'\n'):
        raise ConnectionError('EOF in chunk size')
      dst(line)
      size = int(line.split(b';', 1)[0].strip(), 16)
      if size == 0:
        while True:  # trailers, then the empty line
          t = src.readline(_MAX_HEAD)
          if not t:
            raise ConnectionError('EOF in trailers')
          dst(t)
          if t in (b'\r\n', b'\n'):
            return
      _copy_n(src, dst, size + 2)
    return
  length = _get(headers, b'content-length')
  if length is not None:
    _copy_n(src, dst, int(length))
  elif until_eof:
    while True:
      b = src.read1(_CHUNK) if hasattr(src, 'read1') else src.read(_CHUNK)
      if not b:
        return
      dst(b)


def _copy_n(src, dst, n: int) -> None:
  while n > 0:
    b = src.read1(min(n, _CHUNK)) if hasattr(src, 'read1') else src.read(min(n, _CHUNK))
    if not b:
      raise ConnectionError('EOF in body')
    dst(b)
    n -= len(b)


def _rst_close(sock: socket.socket) -> None:
  """Close with RST instead of FIN."""
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))
  except OSError:
    pass
  try:
    sock.close()
  except OSError:
    pass


class _Throttle:
  """An aggregate byte-rate cap: each caller reserves the next ``n / rate`` seconds of the
  link and sleeps until its bytes would have passed."""

  def __init__(self, rate: float | None):
    self.rate = rate
    self._next = time.monotonic()
    self._lock = threading.Lock()

  def wait(self, n: int) -> None:
    if not self.rate:
      return
    with self._lock:
      now = time.monotonic()
      self._next = max(now, self._next) + n / self.rate
      delay = self._next - now
    if delay > 0:
      time.sleep(delay)


class _Server(socketserver.ThreadingTCPServer):
  daemon_threads = True
  allow_reuse_address = True
  proxy: 'FaultProxy'


class _Handler(socketserver.BaseRequestHandler):
  def handle(self) -> None:
    self.server.proxy._serve_connection(self.request)


class FaultProxy:
  """Fault-injecting HTTP/1.1 proxy in front of ``upstream_url`` (http://127.0.0.1:PORT)."""

  def __init__(
      self,
      upstream_url: str,
      rate: float = 0.0,
      seed: int = 0,
      kinds: Iterable[str] = DEFAULT_KINDS,
      delay_s: float = 0.3,
      match: Callable[[str, str], bool] | None = None,
      bandwidth: float | None = None,
  ):
    assert upstream_url.startswith('http://'), upstream_url
    hostport = upstream_url[len('http://'):].rstrip('/')
    host, _, port = hostport.partition(':')
    self.upstream = (host, int(port or 80))
    self.upstream_url = upstream_url.rstrip('/')
    self.delay_s = delay_s
    self.match = match  # (method, target) -> whether faults may hit this request
    self._lock = threading.Lock()
    self._rng = random.Random(seed)
    self._rate = 0.0
    self._kinds: tuple[str, ...] = ()
    self.set_rate(rate, kinds)
    self._requests = 0
    self._forwarded = 0
    self._faults: Counter[str] = Counter()
    self._by_method: Counter[str] = Counter()
    self._errors: Counter[str] = Counter()
    self._conns: set[socket.socket] = set()
    self._hold_match: Callable[[str, str], bool] | None = None
    self._hold_left = 0
    self._held: list[tuple[str, str]] = []
    self._log: list[tuple[str, str, str]] = []
    self._release = threading.Event()
    self._server: _Server | None = None
    self._thread: threading.Thread | None = None
    self._throttle = _Throttle(bandwidth)
    self._body_bytes: Counter[str] = Counter()

  # -- configuration -----------------------------------------------------------------
  def set_rate(self, rate: float, kinds: Iterable[str] | None = None) -> None:
    if not 0.0 <= rate <= 1.0:
      raise ValueError(rate)
    with self._lock:
      self._rate = rate
      if kinds is not None:
        kinds = tuple(kinds)
        bad = set(kinds) - set(ALL_KINDS)
        if bad or not kinds:
          raise ValueError(f'kinds must be a non-empty subset of {ALL_KINDS}')
        self._kinds = kinds

  def set_bandwidth(self, bandwidth: float | None) -> None:
    """Caps relayed body bytes per second, all connections together (None: no cap)."""
    self._throttle = _Throttle(bandwidth)

  def _relayer(self, send: Callable[[bytes], None], way: str) -> Callable[[bytes], None]:
    throttle = self._throttle

    def relay(b: bytes) -> None:
      throttle.wait(len(b))
      with self._lock:  # counted before sending: a client that has the bytes sees them counted
        self._body_bytes[way] += len(b)
      send(b)
    return relay

  def hold(self, match: Callable[[str, str], bool], count: int = 1) -> None:
    """Hold the next ``count`` requests matching ``match(method, target)`` open, unanswered."""
    with self._lock:
      self._hold_match, self._hold_left = match, count
      self._release.clear()

  def held(self) -> list[tuple[str, str]]:
    with self._lock:
      return list(self._held)

  def release(self) -> None:
    """Reset the connections of every held request (their clients see a connection error)."""
    with self._lock:
      self._hold_match, self._hold_left = None, 0
    self._release.set()

  def _take_hold(self, method: str, target: str) -> bool:
    with self._lock:
      if self._hold_left <= 0 or self._hold_match is None:
        return False
      if not self._hold_match(method, target):
        return False
      self._hold_left -= 1
      self._held.append((method, target))
      return True

  def log(self) -> list[tuple[str, str, str]]:
    """(method, target, User-Agent) of every request received so far, in arrival order."""
    with self._lock:
      return list(self._log)

  def stats(self) -> dict:
    with self._lock:
      return {
          'requests': self._requests,
          'forwarded': self._forwarded,
          'faults': dict(self._faults),
          'faults_total': sum(self._faults.values()),
          'by_method': dict(self._by_method),
          'proxy_errors': dict(self._errors),
          'response_bytes': self._body_bytes['response'],
          'request_bytes': self._body_bytes['request'],
      }

  def reset_stats(self) -> None:
    with self._lock:
      self._requests = self._forwarded = 0
      self._faults.clear()
      self._by_method.clear()
      self._body_bytes.clear()
      self._errors.clear()
      self._log.clear()

  @property
  def url(self) -> str:
    assert self._server is not None, 'not started'
    host, port = self._server.server_address[:2]
    return f'http://{host}:{port}'

  # -- lifecycle ---------------------------------------------------------------------
  def start(self) -> 'FaultProxy':
    self._server = _Server(('127.0.0.1', 0), _Handler)
    self._server.proxy = self
    self._thread = threading.Thread(
        target=self._server.serve_forever, kwargs={'poll_interval': 0.05},
        name='fault-proxy', daemon=True,
    )
    self._thread.start()
    return self

  def stop(self) -> None:
    if self._server is None:
      return
    self._release.set()
    self._server.shutdown()
    self._server.server_close()
    with self._lock:
      conns = list(self._conns)
    for c in conns:
      try:
        c.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
    self._thread.join(5)
    self._server = None

  def __enter__(self) -> 'FaultProxy':
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  # -- internals ---------------------------------------------------------------------
  def _choose(self, method: str, target: str) -> str | None:
    with self._lock:
      self._requests += 1
      self._by_method[method] += 1
      if self._rate <= 0 or (self.match is not None and not self.match(method, target)):
        return None
      if self._rng.random() >= self._rate:
        return None
      kind = self._rng.choice(self._kinds)
      self._faults[kind] += 1
      return kind

  def _count_error(self, what: str) -> None:
    with self._lock:
      self._errors[what] += 1

  def _serve_connection(self, client: socket.socket) -> None:
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with self._lock:
      self._conns.add(client)
    cf = client.makefile('rb', buffering=_CHUNK)
    up: socket.socket | None = None
    uf = None
    phase = 'read_request'
    method, status = '-', 0
    try:
      while True:
        try:
          head = _read_head(cf)
        except (ConnectionError, OSError, ValueError):
          return
        if head is None:
          return
        phase = 'decide'
        start, headers = head
        try:
          method, target, version = start.decode('latin-1').split(' ', 2)
        except ValueError:
          self._count_error('bad_request_line')
          return
        expect_continue = _has_token(headers, b'expect', b'100-continue')
        with self._lock:
          self._log.append((method, target,
                            (_get(headers, b'user-agent') or b'').decode('latin-1')))
        client_close = _has_token(headers, b'connection', b'close') or version == 'HTTP/1.0'
        kind = self._choose(method, target)
        if self._take_hold(method, target):
          if expect_continue:
            client.sendall(b'HTTP/1.1 100 Continue\r\n\r\n')
          _relay_body(cf, lambda b: None, headers, until_eof=False)
          self._release.wait()
          _rst_close(client)
          return

        if kind == 'reset':
          _rst_close(client)
          return
        if kind in ('429', '503'):
          if expect_continue:
            # The body was never sent; answer and close (it cannot be skipped).
            self._send_error(client, int(kind), close=True)
            return
          _relay_body(cf, lambda b: None, headers, until_eof=False)
          self._send_error(client, int(kind), close=client_close)
          if client_close:
            return
          continue

        # Forward. The proxy answers Expect: 100-continue itself and strips it.
        fwd = [(k, v) for k, v in headers if k.lower() != b'expect']
        if expect_continue:
          client.sendall(b'HTTP/1.1 100 Continue\r\n\r\n')
        phase = 'send_upstream'
        for attempt in (0, 1):
          if up is None:
            up = socket.create_connection(self.upstream, timeout=120)
            up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            uf = up.makefile('rb', buffering=_CHUNK)
          try:
            up.sendall(_encode_head(start, fwd))
            break
          except OSError:
            # Stale keep-alive upstream connection: reconnect once.
            up.close()
            up = None
            if attempt:
              raise
        phase = 'relay_request_body'
        _relay_body(cf, self._relayer(up.sendall, 'request'), headers, until_eof=False)
        phase = 'read_response'
        with self._lock:
          self._forwarded += 1

        rhead = _read_head(uf)
        while rhead is not None and rhead[0].split(b' ', 2)[1].startswith(b'1'):
          rhead = _read_head(uf)  # swallow interim responses
        if rhead is None:
          self._count_error('upstream_eof')
          _rst_close(client)
          return
        rstart, rheaders = rhead
        status = int(rstart.split(b' ', 2)[1])
        if kind == 'reset_after':
          _rst_close(client)
          return
        if kind == 'delay':
          time.sleep(self.delay_s)
        rheaders = [
            (k, v.replace(self.upstream_url.encode(), self.url.encode()))
            if k.lower() == b'location' else (k, v)
            for k, v in rheaders
        ]
        upstream_close = _has_token(rheaders, b'connection', b'close')
        framed = (
            _get(rheaders, b'content-length') is not None
            or _has_token(rheaders, b'transfer-encoding', b'chunked')
        )
        phase = 'relay_response'
        client.sendall(_encode_head(rstart, rheaders))
        if method != 'HEAD' and status not in _NO_BODY_STATUS:
          _relay_body(uf, self._relayer(client.sendall, 'response'), rheaders, until_eof=True)
        if upstream_close or not framed:
          uf.close()
          up.close()
          up = uf = None
        if client_close or (not framed and method != 'HEAD'
                            and status not in _NO_BODY_STATUS):
          return
        phase = 'read_request'
    except (ConnectionError, OSError, ValueError) as e:
      self._count_error(f'{phase}:{method}:{status}:{type(e).__name__}')
    finally:
      with self._lock:
        self._conns.discard(client)
      try:
        cf.close()
      except OSError:
        pass
      if up is not None:
        up.close()
      try:
        client.close()
      except OSError:
        pass

  @staticmethod
  def _send_error(client: socket.socket, status: int, close: bool) -> None:
    reason = {429: 'Too Many Requests', 503: 'Service Unavailable'}[status]
    body = (
        b'{"error":{"code":%d,"message":"injected by fault_proxy","errors":'
        b'[{"reason":"injected"}]}}' % status
    )
    head = [
        (b'Content-Type', b'application/json; charset=UTF-8'),
        (b'Content-Length', str(len(body)).encode()),
    ]
    if status == 503:
      head.append((b'Retry-After', b'0'))
    if close:
      head.append((b'Connection', b'close'))
    client.sendall(_encode_head(b'HTTP/1.1 %d %s' % (status, reason.encode()), head) + body)
