"""Persistence transport: what we build and send to Pathways' persistence plugin.

NOT run against a real Pathways server (none is reachable here): these tests check the requests
(content, grouping) and the limit checks/fallback; the plugin program itself is not executed.
"""

import base64
import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways.transports import values
from orbax_pathways.transports import persistence

from support.arrays import assert_trees_equal, mesh, put


def _leaf(name, arr, stored=None):
  dtype = np.dtype(arr.dtype)
  return values.SaveLeaf(name=name, shape=tuple(arr.shape), dtype=dtype,
                         stored_dtype=np.dtype(stored) if stored is not None else dtype,
                         compress=False, max_chunk_bytes=1 << 24)


_ITEM = values.Item(directory='/ckpt/1/default', use_ocdbt=False)


def _b64(s):
  return base64.b64decode(s).decode()


def test_requests_are_grouped_by_directory_and_device_assignment():
  m8, m4 = mesh(), mesh((2, 2), ('a', 'b'), jax.devices()[4:])
  arrays = [put(np.zeros((8, 4), np.float32), m8, 'data', 'model'),
            put(np.zeros((4, 4), jnp.bfloat16), m4, 'a'),
            put(np.zeros((8,), np.int32), m8)]
  leaves = [_leaf('w', arrays[0]), _leaf('e', arrays[1]), _leaf('b', arrays[2])]
  groups = persistence.build_groups(arrays, leaves, _ITEM)
  assert [g.names for g in groups] == [('w', 'b'), ('e',)]
  first = json.loads(groups[0].request)['bulk_persistence_write_request']['write_requests']
  assert [_b64(r['b64_name']) for r in first] == ['w', 'b']
  assert {_b64(r['b64_location']) for r in first} == {'/ckpt/1/default'}
  assert first[0]['shape'] == [8, 4]
  assert first[0]['devices']['device_ids'] == [d.id for d in m8.devices.flat]
  assert first[0]['timeout'] == {'seconds': 3600, 'nanos': 0}
  assert first[0]['b64_hlo_sharding_string']  # an HloSharding proto, base64
  second = json.loads(groups[1].request)['bulk_persistence_write_request']['write_requests']
  assert second[0]['devices']['device_ids'] == [4, 5, 6, 7]


# unsupported()'s reasons (OCDBT, casts, dtypes) and the fallback they cause: the transport
# conformance suite (tests/transports/test_transport_conformance.py, TestPersistence).


def test_ocdbt_checkpoint_falls_back_to_colocated_with_a_warning(tmp_path):
  m = mesh()
  state = {'w': put(np.arange(32, dtype=np.float32).reshape(8, 4), m, 'data', 'model')}
  orbax_pathways.install(orbax_pathways.Options(transport='persistence'))
  with ocp.CheckpointManager(tmp_path) as mngr:  # OCDBT on by default
    with pytest.warns(RuntimeWarning, match=r'persistence transport cannot write this save \(the '
                      r'checkpoint uses OCDBT.*using the colocated transport instead'):
      mngr.save(0, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    assert orbax_pathways.stats.last_save().transport == 'colocated'
    assert_trees_equal(mngr.restore(0), state)
