"""Partner copies on the peer channel (``Options.local_copies=2``): the
``put`` requests a process sends its partner (``fleet/partner_copy.py``) and what the partner's
server writes into its tier (``fleet/receive.py``). A real server of a real tier entry (saved by
an unchanged ``ocp.CheckpointManager``), in this process; the receiving tier an empty private
directory. The multi-process cases (each node keeps its partner's share; a lost node's share
restored from its partner; a flipped byte read from the partner's copy) are in
``test_local_steps.py``.

- The copy: the receiving tier lists the sender's entry, manifest and bytes equal, files 0600,
  directories 0700, marked committed with its step.
- Refused, with nothing written: a client without the job's secret; a server started for
  restores only; a name outside the tier (``..``, a path); a size beyond the tier's free space
  (before a byte is read: 1 TiB claimed, nothing allocated); bytes whose crc32c is not the
  request's; a manifest naming a file that did not arrive; an entry the tier holds whole.
- The sender: a partner whose port is closed (its process gone) or that never answers costs a
  reason naming it within the deadline, never a hang.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time

import crc32c
import jax
import msgpack
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways.tier import fsafe
from orbax_pathways.tier import manifest as manifest_lib
from orbax_pathways.fleet import ops as fleet_ops
from orbax_pathways.fleet import partner_copy
from orbax_pathways.fleet import partners
from orbax_pathways.peer import server as peer_server
from orbax_pathways.tier import config as tier_config
from orbax_pathways.tier import store as tier_store
from orbax_pathways.peer import wire
from support import files

SECRET = bytes(range(32))
FAST = wire.Limits(max_connections=8, handshake_s=1.5, idle_s=1.5)


# ---- who is whose partner (pure) ---------------------------------------------------------------


def test_a_partner_is_always_in_another_slice_and_each_process_has_one():
  rng = np.random.default_rng(0)
  for _ in range(200):
    n = int(rng.integers(2, 40))
    slices = int(rng.integers(2, n + 1))
    slice_of = {p: int(rng.integers(0, slices)) for p in range(n)}
    if len(set(slice_of.values())) < 2:
      continue
    for p in range(n):
      q = partners.partner_of(p, slice_of)
      assert q is not None and slice_of[q] != slice_of[p], (slice_of, p, q)


def test_partners_follow_rank_into_the_next_slice():
  # 4 slices of one process (the benchmark's and the tests' layout): the next process.
  assert [partners.partner_of(p, {0: 0, 1: 1, 2: 2, 3: 3}) for p in range(4)] == [1, 2, 3, 0]
  # 2 slices of 2: the same rank in the other slice; each receives from one.
  two = {0: 0, 1: 0, 2: 1, 3: 1}
  assert [partners.partner_of(p, two) for p in range(4)] == [2, 3, 0, 1]
  # One slice: no partner (a copy there would share the slice's fate).
  assert partners.partner_of(0, {0: 0, 1: 0}) is None
  with pytest.raises(ValueError, match='process 5 is not among'):
    partners.partner_of(5, two)


# ---- the channel -------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """A committed step (1 KiB chunks) and its node-local tier entry, written by the save."""
  base = tmp_path_factory.mktemp('partner')
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
  return entry


@pytest.fixture
def receiver(tmp_path):
  """A partner's server that takes copies into its (empty, private) tier."""
  local = tmp_path / 'partner_tier'
  cfg = tier_config.usable(tier_config.resolve(str(local), 1))
  assert cfg is not None
  address = peer_server.serve(cfg.tier_dir, SECRET, FAST, tier=cfg, ops=fleet_ops.TABLE)
  yield address, cfg
  peer_server.stop_serving()


def test_a_partner_copy_lands_whole_private_and_committed(saved, receiver):
  address, cfg = receiver
  assert partner_copy.send_to(saved.path, address, SECRET, 10) is None
  (got,) = tier_store.entries(cfg.tier_dir)
  assert (got.writer, got.save_id, got.step, got.committed) == (
      saved.writer, saved.save_id, 1, True)  # its step committed in this process already
  assert got.manifest == saved.manifest
  for a in saved.manifest.arrays:
    for f in a.files:
      assert open(os.path.join(got.path, f), 'rb').read() == open(
          os.path.join(saved.path, f), 'rb').read()
  for d, dirs, fs in os.walk(cfg.tier_dir):
    for x in dirs:
      assert stat.S_IMODE(os.lstat(os.path.join(d, x)).st_mode) == 0o700
    for x in fs:
      assert stat.S_IMODE(os.lstat(os.path.join(d, x)).st_mode) == 0o600
  # An entry the tier holds whole is never overwritten: a second copy is refused.
  before = files.contents(cfg.tier_dir)
  why = partner_copy.send_to(saved.path, address, SECRET, 10)
  assert 'holds that entry whole already' in why, why
  assert files.contents(cfg.tier_dir) == before


def test_a_client_without_the_secret_writes_nothing(saved, receiver):
  address, cfg = receiver
  why = partner_copy.send_to(saved.path, address, bytes(32), 10)
  assert why is not None and 'ProtocolError' in why, why
  assert files.contents(cfg.tier_dir) == {}


def test_a_server_started_for_restores_only_takes_no_copy(saved, tmp_path):
  local = tmp_path / 'restore_only'
  cfg = tier_config.usable(tier_config.resolve(str(local), 1))
  address = peer_server.serve(cfg.tier_dir, SECRET, FAST, ops=fleet_ops.TABLE)  # as a restore's
  try:
    why = partner_copy.send_to(saved.path, address, SECRET, 10)
  finally:
    peer_server.stop_serving()
  assert 'takes no partner copies' in why, why
  assert files.contents(cfg.tier_dir) == {}


def _session(address, secret=SECRET):
  host, _, port = address.rpartition(':')
  sock = socket.create_connection((host, int(port)), timeout=10)
  return sock, wire.connect(sock, secret, time.monotonic() + 10)


def _put(sock, session, req, data=b''):
  wire.send_request(sock, session, msgpack.packb(req, use_bin_type=True), time.monotonic() + 10)
  if data:
    sock.sendall(data)
  status, n = wire.recv_header(sock, time.monotonic() + 10)
  return status, wire.recv_bounded(sock, n, wire.MAX_ERROR_BYTES, time.monotonic() + 10).decode()


def _req(saved, **kw):
  parts = saved.path.rstrip('/').split('/')[-4:]
  out = {'op': 'put', 'item': parts[:3], 'entry': parts[3], 'file': '0.0.bin', 'size': 4,
         'crc32c': crc32c.crc32c(b'abcd')}
  out.update(kw)
  return out


@pytest.mark.parametrize('bad, text', [
    ({'entry': '..'}, 'not a tier path component'),
    ({'item': ['..', '1', 'default']}, 'not a tier path component'),
    ({'file': '../../x.bin'}, 'not a chunk file or manifest name'),
    ({'file': 'COMMITTED'}, 'not a chunk file or manifest name'),
    ({'size': 1 << 40}, 'do not fit this node\'s tier'),
    ({'size': -1}, 'needs its size and crc32c as integers'),
    ({'file': 'manifest.msgpack', 'size': 1 << 30}, 'more than the'),
])
def test_a_put_outside_the_tier_or_beyond_its_room_is_refused_unread(saved, receiver, bad, text):
  """Refused before a byte of the body is read, then the connection is closed: 1 TiB claimed
  allocates nothing, and nothing is created in the tier."""
  address, cfg = receiver
  sock, session = _session(address)
  try:
    status, answer = _put(sock, session, _req(saved, **bad))
    assert status == 1 and text in answer, answer
    assert cfg.tier_dir not in answer  # error answers name no absolute tier path
    sock.settimeout(5)
    assert sock.recv(1) == b''  # closed: the body is never drained
  finally:
    sock.close()
  assert files.contents(cfg.tier_dir) == {}


def test_bytes_that_do_not_match_their_crc32c_are_removed(saved, receiver):
  address, cfg = receiver
  sock, session = _session(address)
  try:
    status, answer = _put(sock, session, _req(saved), b'abcX')
  finally:
    sock.close()
  assert status == 1 and 'crc32c' in answer, answer
  assert not any(f.endswith('.bin') for f in files.contents(cfg.tier_dir))


def test_a_manifest_naming_a_file_that_did_not_arrive_is_refused(saved, receiver):
  address, cfg = receiver
  manifest = fsafe.read_small(os.path.join(saved.path, manifest_lib.MANIFEST))
  sock, session = _session(address)
  try:
    status, answer = _put(sock, session, _req(saved, file=manifest_lib.MANIFEST,
                                              size=len(manifest),
                                              crc32c=crc32c.crc32c(manifest)), manifest)
  finally:
    sock.close()
  assert status == 1 and 'did not arrive whole' in answer, answer
  assert tier_store.entries(cfg.tier_dir) == [] or all(
      e.manifest is None for e in tier_store.entries(cfg.tier_dir))


def test_a_partner_that_is_gone_or_silent_costs_a_reason_within_the_deadline(saved):
  gone = socket.socket()
  gone.bind(('127.0.0.1', 0))
  port = gone.getsockname()[1]
  gone.close()  # nothing listens there: its process is gone
  t0 = time.monotonic()
  why = partner_copy.send_to(saved.path, f'127.0.0.1:{port}', SECRET, 2)
  assert why is not None and 'ConnectionRefusedError' in why, why
  silent = socket.socket()
  silent.bind(('127.0.0.1', 0))
  silent.listen(1)  # accepts, never says hello
  try:
    why = partner_copy.send_to(saved.path, '127.0.0.1:%d' % silent.getsockname()[1], SECRET, 2)
  finally:
    silent.close()
  assert why is not None and ('timeout' in why.lower() or 'timed out' in why), why
  assert time.monotonic() - t0 < 30
