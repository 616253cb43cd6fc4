"""What a node's peer server serves of node steps (``fleet/node_receive.py``'s ``node_list`` and
``node_get``): the partner copies it keeps, and the committed node steps saved in the node, each
under the writer that saved it; nothing half-written, nothing of another writer."""

from __future__ import annotations

import os

import msgpack
import pytest

from orbax_pathways.fleet import node_receive

DIGEST = '0123456789abcdef'


def _step(path, writer: str, committed: bool = True) -> None:
  """A node step directory of ``writer`` at ``path``: an item with its record and a data file."""
  os.makedirs(os.path.join(path, 'default', '_pathways'), mode=0o700)
  with open(os.path.join(path, 'default', '_pathways', f'{writer}.msgpack'), 'wb') as f:
    f.write(b'record')
  with open(os.path.join(path, 'default', 'data'), 'wb') as f:
    f.write(b'bytes of ' + writer.encode())
  if committed:
    open(os.path.join(path, 'commit_success.txt'), 'w').close()


def _listed(tier, writer, step):
  req = {'digest': DIGEST, 'writer': writer, 'step': step}
  return sorted(p for p, _, _ in msgpack.unpackb(node_receive.listing(str(tier), req), raw=False))


def test_serves_copies_and_the_committed_steps_saved_in_the_node(tmp_path):
  steps = tmp_path / '.node-steps'
  _step(steps / f'{DIGEST}.copies' / 'p2' / '9', 'p2')
  _step(steps / DIGEST / '9', 'p1')
  _step(steps / DIGEST / '11', 'p1', committed=False)  # its process was killed saving it
  assert _listed(tmp_path, 'p2', 9) == ['commit_success.txt', 'default/_pathways/p2.msgpack',
                                        'default/data']
  assert 'default/_pathways/p1.msgpack' in _listed(tmp_path, 'p1', 9)
  f, size = node_receive.get(str(tmp_path), {'digest': DIGEST, 'writer': 'p1', 'step': 9,
                                             'file': 'default/data'})
  with f:
    assert f.read() == b'bytes of p1' and size == len(b'bytes of p1')
  for writer, step in (('p1', 11), ('p3', 9), ('p2', 8)):
    with pytest.raises(FileNotFoundError, match=f"no part of {writer}'s node step {step}"):
      _listed(tmp_path, writer, step)
