"""A node step's partner copy over the peer channel (``fleet/node_copy.py`` sends,
``fleet/node_receive.py`` takes): a real server in this process, its tier an empty private
directory; the node step a directory of many small files, as one of a state of many arrays is
(a chunk file and a ``.zarray`` per array, Orbax's metadata, the writer record).

- The copy lands whole: every file byte-equal, files ``0600``, directories ``0700``, at the
  copy's place (``copy_dir``), with nothing left of its arrival; then ``fetch`` brings it back.
- A server that takes no copies refuses the first file, and the sender reports the server's
  reason, even with requests of later files already on their way (the sender does not wait
  for each file's answer before it sends the next).
- A commit naming files that did not arrive is refused, and no copy is made. (A commit names
  the files by count and digest: the list of a step of many files outgrows a request, which
  the server refused unread.)
"""

from __future__ import annotations

import os
import socket
import stat
import time

import crc32c
import msgpack
import pytest

from orbax_pathways.fleet import node_copy
from orbax_pathways.fleet import ops as fleet_ops
from orbax_pathways.peer import server as peer_server
from orbax_pathways.peer import wire
from orbax_pathways.tier import config as tier_config
from support import files

SECRET = bytes(range(32))
FAST = wire.Limits(max_connections=8, handshake_s=1.5, idle_s=1.5)
DIGEST = '0123456789abcdef'
ARRAYS = 1000


@pytest.fixture(scope='module')
def step_dir(tmp_path_factory):
  """A node step of ``ARRAYS`` arrays: per array a 4 KiB chunk file and a ``.zarray``."""
  root = tmp_path_factory.mktemp('node') / '7'
  item = root / 'state'
  for i in range(ARRAYS):
    a = item / f'w{i}'
    a.mkdir(parents=True, mode=0o700)
    (a / '0.0').write_bytes(i.to_bytes(4, 'little') * 1024)
    (a / '.zarray').write_text('{"shape": [%d]}' % i)
  (item / '_METADATA').write_text('{}')
  (item / '_pathways').mkdir(mode=0o700)
  (item / '_pathways' / 'p3.msgpack').write_bytes(b'record')
  (root / '_CHECKPOINT_METADATA').write_text('{}')
  return root


def _serve(tmp_path, name, takes_copies=True):
  cfg = tier_config.usable(tier_config.resolve(str(tmp_path / name), 1))
  assert cfg is not None
  address = peer_server.serve(cfg.tier_dir, SECRET, FAST, tier=cfg if takes_copies else None,
                              ops=fleet_ops.TABLE)
  return address, cfg


def test_a_node_step_of_many_files_lands_whole_and_comes_back(step_dir, tmp_path):
  address, cfg = _serve(tmp_path, 'partner')
  try:
    assert node_copy.send(str(step_dir), DIGEST, 'p3', 7, 2, address, SECRET, 10) is None
    copy = node_copy.copy_dir(cfg.tier_dir, DIGEST, 'p3', 7)
    assert files.contents(copy) == files.contents(step_dir)
    assert len(files.contents(copy)) == 2 * ARRAYS + 3
    assert sorted(os.listdir(os.path.dirname(copy))) == ['7']  # nothing left of its arrival
    for d, dirs, fs in os.walk(copy):
      for x in dirs:
        assert stat.S_IMODE(os.lstat(os.path.join(d, x)).st_mode) == 0o700
      for x in fs:
        assert stat.S_IMODE(os.lstat(os.path.join(d, x)).st_mode) == 0o600
    back = tmp_path / 'fetched'
    assert node_copy.fetch(address, SECRET, DIGEST, 'p3', 7, str(back), 10) is None
    assert files.contents(back) == files.contents(step_dir)
  finally:
    peer_server.stop_serving()


def test_a_server_that_takes_no_copies_is_reported_with_its_reason(step_dir, tmp_path):
  address, cfg = _serve(tmp_path, 'restore_only', takes_copies=False)
  try:
    why = node_copy.send(str(step_dir), DIGEST, 'p3', 7, 2, address, SECRET, 10)
  finally:
    peer_server.stop_serving()
  assert why is not None and 'takes no partner copies' in why, why
  assert files.contents(cfg.tier_dir) == {}


def test_a_commit_naming_files_that_did_not_arrive_is_refused(step_dir, tmp_path):
  """One file sent, a commit naming two: refused with what arrived, and no copy made."""
  address, cfg = _serve(tmp_path, 'partner')
  host, _, port = address.rpartition(':')
  sock = socket.create_connection((host, int(port)), timeout=10)
  try:
    session = wire.connect(sock, SECRET, time.monotonic() + 10)
    head = {'digest': DIGEST, 'writer': 'p3', 'step': 7}
    body = (step_dir / '_CHECKPOINT_METADATA').read_bytes()
    _request(sock, session, {'op': 'node_put', **head, 'file': '_CHECKPOINT_METADATA',
                             'size': len(body), 'crc32c': crc32c.crc32c(body)}, body)
    status, _ = _answer(sock)
    assert status == 0
    listed = [('_CHECKPOINT_METADATA', len(body)), ('state/_METADATA', 2)]
    _request(sock, session, {'op': 'node_commit', **head, 'count': 2, 'keep': 2,
                             'listing': node_copy.listing_digest(listed)})
    status, text = _answer(sock)
  finally:
    sock.close()
    peer_server.stop_serving()
  assert status == 1 and 'the 1 files that arrived are not the 2 the sender listed' in text, text
  assert not os.path.exists(node_copy.copy_dir(cfg.tier_dir, DIGEST, 'p3', 7))


def _request(sock, session, req, body=b''):
  wire.send_request(sock, session, msgpack.packb(req, use_bin_type=True), time.monotonic() + 10)
  if body:
    sock.sendall(body)


def _answer(sock):
  status, n = wire.recv_header(sock, time.monotonic() + 10)
  return status, wire.recv_bounded(sock, n, wire.MAX_ERROR_BYTES, time.monotonic() + 10).decode()
