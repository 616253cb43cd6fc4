"""The tier's peer channel under attack: a real server of a real tier (saved by an unchanged
``ocp.CheckpointManager``), a client outside the job, the job's own client, and a hostile peer.

- Authentication: a client without the job's secret is closed after the server's hello with
  nothing it sent parsed: no list, no chunk, no relay; counted, one warning naming its address.
  A client of another job (another secret) likewise; the job's client reads everything.
- The server's bounds, measured on a server in its own process: two connections claiming
  1 GiB requests (its RSS), 400 idle connections (its threads and descriptors, all closed after
  the deadlines), a request above the cap from an authenticated client.
- The client's bounds: a peer that proved the secret but answers a list, an error or a chunk
  with a header claiming 1 TiB costs a ``PeerError``, never a ``MemoryError``
  (``test_tier_peer.py`` runs the same peer inside a restore: storage serves, values exact).
- Files: a chunk that is a symlink to another user's file of the same size, a FIFO, a file of
  another size, a symlinked manifest or entry directory: never served; error answers name
  paths relative to the tier, never its absolute path.
- The job's secret: one per job, the same in every process of a real ``jax.distributed`` job,
  read once per process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import socket
import struct
import subprocess
import threading
import time

import jax
import msgpack
import numpy as np
import orbax.checkpoint as ocp
import psutil
import pytest

import orbax_pathways
from orbax_pathways import stats
from support import procs
from support.mp_harness import run_processes
from support.workers import peer_secret_worker, peer_server_worker
from orbax_pathways.fleet import ops as fleet_ops
from orbax_pathways.peer import exchange
from orbax_pathways.tier import manifest as manifest_lib
from orbax_pathways.peer import client as peer
from orbax_pathways.peer import server as peer_server
from orbax_pathways.tier import store as tier_store
from orbax_pathways.peer import wire

SECRET = bytes(range(32))
OTHER_JOB = bytes(range(1, 33))
FAST = wire.Limits(max_connections=8, handshake_s=1.5, idle_s=1.5)


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """A committed step of a small state (1 KiB chunks), its node-local tier written by the save."""
  base = tmp_path_factory.mktemp('channel')
  root, tier = base / 'ckpt', base / 'tier'
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), max_chunk_bytes=1024))
  try:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('x', 'y'))
    host = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    arr = jax.device_put(host, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x')))
    with ocp.CheckpointManager(root) as m:
      m.save(1, args=ocp.args.StandardSave({'w': arr}))
      m.wait_until_finished()
    tier_store.flush()
  finally:
    orbax_pathways.install(orbax_pathways.Options.from_env())
  (entry,) = tier_store.entries(str(tier))
  return tier, peer.item_parts(str(root / '1' / 'default')), entry


@pytest.fixture
def tier(saved, tmp_path):
  """A private copy of the saved tier (tests damage it) and its item's (root key, step, item)."""
  src, parts, entry = saved
  dst = tmp_path / 'tier'
  procs.run(['cp', '-a', src, dst], timeout=60)
  return dst, parts, os.path.join(str(dst), *parts, os.path.basename(entry.path)), entry.manifest


@pytest.fixture
def server(tier, monkeypatch):
  """This process's server of the copy, with short deadlines, and fresh counters."""
  monkeypatch.setattr(peer_server, 'COUNTS', peer_server._Counts())
  monkeypatch.setattr(stats, '_peer_refused', dict.fromkeys(stats.PEER_REFUSED, 0))
  address = peer_server.serve(str(tier[0]), SECRET, FAST, ops=fleet_ops.TABLE)
  yield address
  peer_server.stop_serving()


def _connect(address):
  host, _, port = address.rpartition(':')
  return socket.create_connection((host, int(port)), timeout=10)


def _old_request(obj) -> bytes:
  """A request as a client without the secret sends it: a length and a msgpack map."""
  body = msgpack.packb(obj, use_bin_type=True)
  return struct.pack('!I', len(body)) + body


def _drain(sock, timeout=10.0) -> bytes:
  """Everything the server sends until it closes the connection."""
  out, deadline = b'', time.monotonic() + timeout
  while time.monotonic() < deadline:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
      data = sock.recv(1 << 16)
    except ConnectionResetError:
      return out
    if not data:
      return out
    out += data
  raise AssertionError(f'the server kept the connection open ({len(out)} bytes so far)')


def _client(address, secret=SECRET, timeout_s=5.0):
  return peer._Peer(1, address, timeout_s, secret)


def _get(parts, entry, file):
  return {'op': 'get', 'item': list(parts), 'entry': entry, 'file': file}


# ---- authentication ------------------------------------------------------------------------------


def test_a_client_without_the_secret_gets_no_list_chunk_or_relay_and_is_counted(
    server, tier, caplog, monkeypatch):
  tier_dir, parts, entry_dir, manifest = tier
  probed = []  # an op of the server's table that says whether a request reached it
  peer_server.serve(str(tier_dir), SECRET, FAST, ops=peer_server.Ops(
      answer={**fleet_ops.TABLE.answer,
              'probe': lambda req: probed.append(req) or np.zeros(4, np.uint8)}))
  entry, file = os.path.basename(entry_dir), manifest.arrays[0].files[0]
  chunk = open(os.path.join(entry_dir, file), 'rb').read()
  asks = [{'op': 'list', 'item': list(parts)}, _get(parts, entry, file),
          {'op': 'relay', 'prefix': 'orbax_pathways/tier_peers/x/1', 'array': 'w',
           'origin': [0, 0], 'shape': [8, 32]}, {'op': 'probe'}]
  caplog.set_level(logging.WARNING, logger='orbax_pathways')
  for ask in asks:
    with _connect(server) as s:
      s.sendall(_old_request(ask) + b'\0' * 64)  # long enough to be read as a (wrong) proof
      got = _drain(s)
    assert got[:4] == wire.MAGIC and len(got) == 22, got  # the hello, then closed: nothing else
  assert probed == []
  assert peer_server.server_counts()['unauthenticated'] == len(asks)
  assert stats.peer_server() == peer_server.server_counts()
  lines = [r.getMessage() for r in caplog.records if 'did not prove' in r.getMessage()]
  assert len(lines) == 1, lines  # rate-limited: one line for the four
  assert '127.0.0.1:' in lines[0] and 'got no data' in lines[0], lines
  # The job's own client, on the same server, gets all of it.
  c = _client(server)
  listed = c.request({'op': 'list', 'item': list(parts)}, 'the list')
  assert listed[entry]['arrays']['w']['files'][0] == file
  out = np.empty(len(chunk), np.uint8)
  c.request(_get(parts, entry, file), 'a chunk', into=out)
  assert out.tobytes() == chunk
  assert c.request({'op': 'probe'}, 'a probe', into=np.empty(4, np.uint8)).tolist() == [0] * 4
  assert len(probed) == 1


def test_a_client_of_another_job_and_a_silent_one_are_refused(server, tier):
  _, parts, _, _ = tier
  with pytest.raises(wire.PeerError, match="does not hold this job's secret"):
    _client(server, OTHER_JOB).request({'op': 'list', 'item': list(parts)}, 'the list')
  with _connect(server) as s:  # connects and sends nothing: closed at the handshake deadline
    t0 = time.monotonic()
    assert len(_drain(s)) == 22
    assert time.monotonic() - t0 < 10
  assert peer_server.server_counts()['unauthenticated'] == 2


def test_a_server_never_starts_without_the_jobs_secret(tmp_path, monkeypatch):
  monkeypatch.setattr(exchange, '_secret', None)  # no Exchange has read one in this process
  with pytest.raises(wire.PeerError, match="needs this job's secret"):
    peer_server.serve(str(tmp_path))
  with pytest.raises(wire.PeerError, match="needs this job's secret"):
    peer_server.serve(str(tmp_path), b'short')


def test_a_request_with_a_wrong_mac_is_closed_unread(server, tier):
  """An attacker on the path who cannot compute the MAC cannot slip a request into a
  connection the job's client opened."""
  _, parts, _, _ = tier
  with _connect(server) as s:
    session = wire.connect(s, SECRET, time.monotonic() + 5)
    body = msgpack.packb({'op': 'list', 'item': list(parts)})
    s.sendall(struct.pack('!I', len(body)) + b'\0' * 32 + body)
    assert _drain(s) == b''
    del session
  assert peer_server.server_counts()['unauthenticated'] == 1


# ---- the server's files: only what a complete manifest names ------------------------------------


def test_a_chunk_replaced_by_a_symlink_to_another_file_is_never_sent(server, tier, tmp_path):
  tier_dir, parts, entry_dir, manifest = tier
  file = manifest.arrays[0].files[0]
  size = manifest_lib.file_sizes(manifest)[file]
  victim = tmp_path / 'victim_private'
  victim.write_bytes(b'S' * size)  # the recorded size: only the symlink check can refuse it
  os.chmod(victim, 0o600)
  path = os.path.join(entry_dir, file)
  os.remove(path)
  os.symlink(victim, path)
  out = np.zeros(size, np.uint8)
  with pytest.raises(wire.PeerError) as e:
    _client(server).request(_get(parts, os.path.basename(entry_dir), file), 'a chunk', into=out)
  text = str(e.value)
  assert 'symlink' in text and f'{"/".join(parts)}/{os.path.basename(entry_dir)}/{file}' in text
  assert str(tier_dir) not in text and str(victim) not in text, text
  assert not out.any()


def test_a_fifo_or_a_file_of_another_size_is_refused_without_blocking(server, tier):
  _, parts, entry_dir, manifest = tier
  sizes = manifest_lib.file_sizes(manifest)  # the chunks of one row share a band file
  f0, f1 = list(dict.fromkeys(manifest.arrays[0].files))[:2]
  entry = os.path.basename(entry_dir)
  os.remove(os.path.join(entry_dir, f0))
  os.mkfifo(os.path.join(entry_dir, f0))
  with open(os.path.join(entry_dir, f1), 'ab') as f:
    f.write(b'x')
  c = _client(server)
  with pytest.raises(wire.PeerError, match='a FIFO'):
    c.request(_get(parts, entry, f0), 'a chunk', into=np.empty(sizes[f0], np.uint8))
  with pytest.raises(wire.PeerError, match=f'holds {sizes[f1] + 1} bytes; its record says '
                                           f'{sizes[f1]}'):
    c.request(_get(parts, entry, f1), 'a chunk', into=np.empty(sizes[f1], np.uint8))
  with pytest.raises(wire.PeerError, match='its manifest names no 9.9.bin'):
    c.request(_get(parts, entry, '9.9.bin'), 'a chunk', into=np.empty(4, np.uint8))
  assert not c.failed  # error answers: the peer is still asked for its other chunks


def test_a_symlinked_manifest_or_entry_is_not_listed_or_served(server, tier, tmp_path):
  _, parts, entry_dir, manifest = tier
  entry, file = os.path.basename(entry_dir), manifest.arrays[0].files[0]
  item_dir = os.path.dirname(entry_dir)
  elsewhere = tmp_path / 'elsewhere'
  procs.run(['cp', '-a', entry_dir, elsewhere], timeout=60)
  # The entry directory itself a symlink to a complete copy of it.
  os.rename(entry_dir, entry_dir + '.moved')
  os.symlink(elsewhere, entry_dir)
  c = _client(server)
  assert c.request({'op': 'list', 'item': list(parts)}, 'the list') == {}
  with pytest.raises(wire.PeerError, match=f'{entry}: no complete entry'):
    c.request(_get(parts, entry, file), 'a chunk', into=np.empty(manifest.arrays[0].nbytes[0],
                                                                   np.uint8))
  # A real entry directory whose manifest is a symlink to the copy's.
  os.remove(entry_dir)
  os.rename(entry_dir + '.moved', entry_dir)
  os.remove(os.path.join(entry_dir, 'manifest.msgpack'))
  os.symlink(elsewhere / 'manifest.msgpack', os.path.join(entry_dir, 'manifest.msgpack'))
  assert c.request({'op': 'list', 'item': list(parts)}, 'the list') == {}
  del item_dir


def test_error_answers_name_no_absolute_tier_path(server, tier):
  tier_dir, parts, _, _ = tier
  with pytest.raises(wire.PeerError) as e:
    _client(server).request(_get(parts, 'p9.nosuchsave', '0.0.bin'), 'a chunk',
                            into=np.empty(4, np.uint8))
  text = str(e.value)
  assert f'{"/".join(parts)}/p9.nosuchsave: no complete entry' in text, text
  assert str(tier_dir) not in text and os.path.realpath(tier_dir) not in text, text


# ---- the client: a pooled connection the server closed, a busy server ----------------------------


def test_a_connection_closed_at_the_idle_deadline_is_replaced(server, tier):
  _, parts, _, _ = tier
  c = _client(server)
  first = c.request({'op': 'list', 'item': list(parts)}, 'the list')
  time.sleep(FAST.idle_s + 1.0)  # the server closed the pooled connection meanwhile
  assert c.request({'op': 'list', 'item': list(parts)}, 'the list') == first
  assert not c.failed
  assert peer_server.server_counts()['idle'] == 1


def _hostile_peer(answer_header: bytes):
  """A server that proves the job's secret, then answers every request with
  ``answer_header`` and nothing more (a rogue or broken process of the job)."""
  listener = socket.create_server(('127.0.0.1', 0))
  stop = threading.Event()

  def run():
    listener.settimeout(0.2)
    while not stop.is_set():
      try:
        conn, _ = listener.accept()
      except OSError:
        continue
      with conn:
        try:
          session = wire.accept(conn, SECRET, FAST)
          while wire.recv_request(conn, session, wire.Limits(idle_s=10)) is not None:
            conn.sendall(answer_header)
        except (OSError, wire.Refused):
          pass

  t = threading.Thread(target=run, daemon=True)
  t.start()
  return f'127.0.0.1:{listener.getsockname()[1]}', lambda: (stop.set(), t.join(5),
                                                            listener.close())


@pytest.mark.parametrize('status', [0, 1])
def test_a_peer_claiming_a_1_tib_answer_costs_a_peer_error(status, tier):
  _, parts, _, _ = tier
  address, close = _hostile_peer(wire.ANSWER.pack(status, 1 << 40))
  try:
    rss = psutil.Process().memory_info().rss
    with pytest.raises(wire.PeerError, match='an answer of 1099511627776 bytes, more than'):
      _client(address).request({'op': 'list', 'item': list(parts)}, 'the list')
    with pytest.raises(wire.PeerError, match=(
        'has 1099511627776 bytes for a chunk; the committed record says 1024' if status == 0
        else 'an answer of 1099511627776 bytes, more than')):
      _client(address).request(_get(parts, 'p0.x', '0.0.bin'), 'a chunk',
                               into=np.empty(1024, np.uint8))
    assert psutil.Process().memory_info().rss - rss < 64 << 20
  finally:
    close()


def test_a_busy_server_costs_a_peer_error_but_not_the_peer(tier, monkeypatch):
  monkeypatch.setattr(peer_server, 'COUNTS', peer_server._Counts())
  monkeypatch.setattr(stats, '_peer_refused', dict.fromkeys(stats.PEER_REFUSED, 0))
  _, parts, _, _ = tier
  address = peer_server.serve(str(tier[0]), SECRET, wire.Limits(max_connections=1, handshake_s=5))
  try:
    with _connect(address) as hold:  # takes the one slot
      assert len(hold.recv(64)) == 22
      c = _client(address)
      with pytest.raises(wire.PeerError, match='serving as many connections as it allows'):
        c.request({'op': 'list', 'item': list(parts)}, 'the list')
      assert not c.failed  # busy is not broken: its next chunk is asked for again
    assert peer_server.server_counts()['busy'] == 1
  finally:
    peer_server.stop_serving()


# ---- the server's bounds, in a process of its own -------------------------------------------------

@pytest.fixture
def server_process(tier):
  with procs.started(procs.worker_argv(peer_server_worker, tier[0], SECRET.hex()),
                     env={'ORBAX_PATHWAYS_DISABLE': '1'}, devices=None,
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    assert ready, 'the server process did not start'
    address = proc.stdout.readline().strip()
    assert address, proc.poll()

    def counts():
      proc.stdin.write('counts\n')
      proc.stdin.flush()
      return json.loads(proc.stdout.readline())

    yield psutil.Process(proc.pid), address, counts


def _settle(measure, until, timeout=20.0):
  deadline = time.monotonic() + timeout
  while True:
    value = measure()
    if until(value) or time.monotonic() > deadline:
      return value
    time.sleep(0.1)


def test_two_connections_claiming_1_gib_requests_do_not_grow_the_server(server_process):
  proc, address, counts = server_process
  rss = proc.memory_info().rss
  # A header-only attack: a 4-byte header claiming 1 GiB, the connection held.
  held = [_connect(address) for _ in range(2)]
  for s in held:
    s.sendall(struct.pack('!I', 1 << 30))
  # The same from a client that proved the secret: refused before anything is allocated.
  authed = _connect(address)
  wire.connect(authed, SECRET, time.monotonic() + 5)
  authed.sendall(struct.pack('!I', 1 << 30))
  assert _drain(authed) == b''
  time.sleep(0.5)
  assert proc.memory_info().rss - rss < 4 << 20, (rss, proc.memory_info().rss)
  for s in held:
    assert len(_drain(s)) == 22  # closed at the handshake deadline, after the hello
    s.close()
  authed.close()
  assert counts() == {'unauthenticated': 2, 'oversized': 1, 'idle': 0, 'busy': 0}


def test_400_idle_connections_leave_bounded_threads_and_fds_and_are_closed(server_process):
  proc, address, counts = server_process
  threads, fds = proc.num_threads(), proc.num_fds()
  idle = [_connect(address) for _ in range(400)]
  try:
    # At most 16 served at once (a thread each); the others answered busy and closed at once.
    peak_threads, peak_fds = 0, 0
    for _ in range(10):
      time.sleep(0.1)
      peak_threads, peak_fds = max(peak_threads, proc.num_threads()), max(peak_fds, proc.num_fds())
    assert peak_threads <= threads + 16, (threads, peak_threads)
    assert peak_fds <= fds + 16 + 4, (fds, peak_fds)
    hellos = [_drain(s) for s in idle]
    assert all(len(h) == 22 and h[:4] == wire.MAGIC for h in hellos)
    busy = [h for h in hellos if h[5] == wire.BUSY]
    assert busy, 'none of 400 connections was refused'
    # Every connection closed by the server (the served ones at the handshake deadline).
    assert _settle(proc.num_threads, lambda n: n <= threads) <= threads
    assert _settle(proc.num_fds, lambda n: n <= fds) <= fds
  finally:
    for s in idle:
      s.close()
  c = counts()
  assert c['busy'] == len(busy) and c['unauthenticated'] == 400 - len(busy), c
  # And the job's client is served again.
  wire.connect(_connect(address), SECRET, time.monotonic() + 5)


# ---- the job's secret: created once, the same in every process -----------------------------------

@pytest.mark.multiprocess
def test_every_process_of_a_job_reads_the_same_secret_once():
  results = run_processes(peer_secret_worker.__file__, 3, 1, timeout=240)
  got = [r.result for r in results]
  assert all(g['n'] == 32 and g['cached'] for g in got), got
  assert len({g['sha'] for g in got}) == 1, got
  assert got[0]['sha'] != hashlib.sha256(bytes(32)).hexdigest()


def test_a_get_of_one_chunk_of_a_band_sends_that_chunk_s_rows_only(server, tier):
  """The saved 'w' is stored in column blocks, so each chunk row is one band file: a peer asks
  for one chunk of it and gets exactly that chunk's bytes in its own C order; a box the
  manifest does not place in that band is refused, nothing sent."""
  _, parts, entry_dir, manifest = tier
  (w,) = manifest.arrays
  assert w.bands, 'w should be stored in bands'
  f, band_start, band_shape = w.bands[0]
  band = np.fromfile(os.path.join(entry_dir, f), np.float32).reshape(band_shape)
  entry = os.path.basename(entry_dir)
  c = _client(server)
  chunks = [(o, n) for o, g, n in zip(w.origins, w.files, w.nbytes) if g == f]
  assert len(chunks) > 1
  for origin, nbytes in chunks:
    shape = [min(s, d - o) for s, o, d in zip(w.chunk_shape, origin, w.shape)]
    out = np.empty(shape, np.float32)
    c.request({**_get(parts, entry, f), 'chunk': [list(origin), shape]}, 'a chunk', into=out)
    rel = tuple(slice(o - b, o - b + s) for o, b, s in zip(origin, band_start, shape))
    np.testing.assert_array_equal(out, band[rel])
    assert out.nbytes == nbytes
  other = next(o for o, g in zip(w.origins, w.files) if g != f)
  with pytest.raises(wire.PeerError, match='is not a chunk its manifest places in that file'):
    c.request({**_get(parts, entry, f), 'chunk': [list(other), list(w.chunk_shape)]}, 'a chunk',
              into=np.empty(w.chunk_shape, np.float32))
  assert not c.failed
