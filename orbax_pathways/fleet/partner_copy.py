"""Partner copies, the sending end (``Options.local_copies=2``, ``docs/multi_tier.md``): after a
process wrote its share of a local-only step into its node's tier, the same entry goes to its
partner's tier (``fleet/partners.py``: a process of another slice) over the peer channel, so the
step survives the loss of any one slice even where state is sharded across every device.

Who calls what, on which host (multi-controller JAX, every process of a local-only save):

- ``ready(tier, client, me, timeout_s)``, before the share is written (``transports/in_process.py``):
  reads the job's secret (``peer/exchange.job_secret``), starts this process's tier server with
  this node's tier so that it takes copies (``peer/server.serve(tier=...)``) and publishes
  its address once per process and job (``coord.rounds.partner_address_key``).
- ``send(entry_path, partner, client, timeout_s)``, right after the share landed in this node's
  tier (``transports/share.tier_only_pieces``, in the save's background part, so the step
  commits only after its copy did or failed): reads the partner's address (one blocking read,
  within ``timeout_s``), then sends the entry's chunk files (``sendfile``: from the tier's
  files, never read whole into memory) and its manifest last, each as one ``put`` request
  followed by its bytes (``fleet/receive.py`` writes them). Returns None, or why the copy did
  not happen: the caller logs it and the save goes on (the step then has one copy, as with
  ``local_copies=1``).

Bounds: every request is authenticated (``peer/wire.py``), each file has ``timeout_s`` plus its
bytes at ``MIN_RATE`` to arrive, and the receiver takes no more than its tier's free space.
What grows with what: one connection and one key read per process per local-only save; the
bytes sent are this process's share of the step. No jax here.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import crc32c as _crc32c
import msgpack

from orbax_pathways.coord import rounds
from orbax_pathways.fleet import ops as fleet_ops
from orbax_pathways.peer import exchange as exchange_lib
from orbax_pathways.tier import fsafe
from orbax_pathways.tier import manifest as manifest_lib
from orbax_pathways.peer import server as peer_server
from orbax_pathways.tier import config as tier_config
from orbax_pathways.tier import store
from orbax_pathways.peer import wire

log = logging.getLogger('orbax_pathways')
MIN_RATE = 64 << 20  # bytes per second a partner copy is allowed at least, beyond timeout_s

_published: set[tuple[int, int, str]] = set()  # (id of the client, process, address) published
_lock = threading.Lock()


def ready(tier: tier_config.TierConfig, client: Any, me: int, timeout_s: float) -> str:
  """This process's server takes partner copies into ``tier``, and its address is published
  (once per process, key-value client and address); returns the address. ``wire.PeerError``
  if the job's secret cannot be read."""
  secret = exchange_lib.job_secret(client, timeout_s)
  address = peer_server.serve(tier.tier_dir, secret, tier=tier, ops=fleet_ops.TABLE)
  key = (id(client), me, address)
  with _lock:
    if key not in _published:
      rounds.put(client, rounds.partner_address_key(me), address)
      _published.add(key)
  return address


def _files(m: manifest_lib.Manifest) -> list[tuple[str, int]]:
  return sorted(manifest_lib.file_sizes(m).items())


def send(entry_path: str, partner: int, client: Any, timeout_s: float) -> str | None:
  """Sends the complete entry at ``entry_path`` (this node's tier) to process ``partner``'s
  tier (its address: one blocking key-value read); None when it landed whole, else why not
  (one line naming the partner)."""
  who = f'partner process {partner}'
  try:
    address = rounds.wait_for(client, rounds.partner_address_key(partner), timeout_s)
  except Exception as e:  # pylint: disable=broad-except
    return f'{who} did not publish its tier server within {timeout_s:g} s ({type(e).__name__}: {e})'
  secret = exchange_lib.cached_secret()
  if secret is None:
    return 'this process has no job secret (fleet.partner_copy.ready was not called)'
  why = send_to(entry_path, str(address), secret, timeout_s)
  return None if why is None else f'{who} ({address}): {why}'


def send_to(entry_path: str, address: str, secret: bytes, timeout_s: float) -> str | None:
  """The entry at ``entry_path`` to the tier server at ``address`` (``host:port``): its chunk
  files, then its manifest; None when it landed whole, else why not."""
  try:
    entry = store.read_entry(entry_path)
    if entry.manifest is None:
      return f'{entry_path} is not a complete entry ({entry.error})'
    parts = entry_path.rstrip('/').split('/')[-4:]
    item, name = parts[:3], parts[3]
    manifest = fsafe.read_small(os.path.join(entry_path, manifest_lib.MANIFEST))
    host, _, port = address.rpartition(':')
    deadline = time.monotonic() + timeout_s
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    try:
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      session = wire.connect(sock, secret, deadline)
      for fname, size in _files(entry.manifest):
        path = os.path.join(entry_path, fname)
        _put(sock, session, item, name, fname, size, fsafe.crc32c_of(path, size), timeout_s, path=path)
      _put(sock, session, item, name, manifest_lib.MANIFEST, len(manifest),
           _crc32c.crc32c(manifest), timeout_s, data=manifest)
    finally:
      sock.close()
  except (OSError, ValueError, wire.PeerError, wire.ProtocolError) as e:
    return f'{type(e).__name__}: {e}'
  return None


def _put(sock: socket.socket, session: wire.Session, item: list[str], entry: str, fname: str,
         size: int, crc: int, timeout_s: float, *, path: str | None = None,
         data: bytes | None = None) -> None:
  """One file: the request, its bytes (``sendfile`` from ``path``, or ``data``), the answer."""
  deadline = time.monotonic() + timeout_s + size / MIN_RATE
  body = msgpack.packb({'op': 'put', 'item': item, 'entry': entry, 'file': fname, 'size': size,
                        'crc32c': crc}, use_bin_type=True)
  wire.send_request(sock, session, body, deadline)
  sock.settimeout(max(0.001, deadline - time.monotonic()))
  if path is not None:
    with fsafe.open_regular(path, size) as f:
      sent = sock.sendfile(f, 0, size)
    if sent != size:
      raise OSError(f'{fname}: sent {sent} of {size} bytes')
  else:
    sock.sendall(data or b'')
  wire.recv_empty_answer(sock, deadline, fname)


def send_or_say(entry_path: str, partner: int, client: Any, timeout_s: float) -> bool:
  """``send``, and one warning per partner (later failures: info) when the copy did not land:
  the step is then committed with one copy, as with ``local_copies=1``. Whether it landed."""
  why = send(entry_path, partner, client, timeout_s)
  if why is None:
    return True
  with _lock:
    first = partner not in _failed
    _failed.add(partner)
  log.log(logging.WARNING if first else logging.INFO,
          'orbax_pathways: the partner copy of %s was not made: %s. The local-only step keeps '
          'one copy (this node\'s): losing this node loses its chunks of the step, and a resume '
          'then takes an older step.%s', entry_path, why,
          ' Later failures to that partner are logged at INFO.' if first else '')
  return False


_failed: set[int] = set()
