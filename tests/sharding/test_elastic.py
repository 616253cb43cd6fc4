"""Elastic restore: saved on N slices, restored onto M with no hand-built target."""

import hashlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax_pathways
from orbax_pathways.sharding import elastic
from orbax_pathways.plan import remap as plan
from orbax_pathways.plan import restore as restore_plan
from orbax_pathways.plan.boxes import Box

from support import ckpt
from support import procs
from support.arrays import mesh, put
from support.workers import no_target_restore_worker


# ---- pure planning -------------------------------------------------------------------------

def _saved(n_slices, per_slice=2, model=2):
  """(data, model) mesh, data = n_slices * (per_slice // model) ... one row block per slice."""
  k = per_slice // model
  shape = (n_slices * k, model)
  ids = tuple(range(n_slices * per_slice))
  slices = tuple(i // per_slice for i in ids)
  return plan.SavedMesh(shape, ('data', 'model'), ids, slices, ('data',))


@pytest.mark.parametrize('m', [1, 2, 3, 4, 6])
def test_remap_mesh_resizes_only_the_slice_axis(m):
  saved = _saved(4)
  current = {s: [100 + 2 * s, 101 + 2 * s] for s in range(m)}
  new = plan.remap_mesh(saved, current)
  assert new.shape == (m, 2) and new.resized_axes == ('data',)
  # Each row is one slice, and intra-slice order is kept.
  assert new.device_ids == tuple(d for s in range(m) for d in current[s])


def test_remap_mesh_hybrid_axis_keeps_intra_slice_positions():
  # 2 slices of 4 devices; data = 2 (across slices) x 2 (inside), model = 2.
  saved = plan.SavedMesh((4, 2), ('data', 'model'), (0, 1, 2, 3, 4, 5, 6, 7),
                         (0, 0, 0, 0, 1, 1, 1, 1), ('data',))
  new = plan.remap_mesh(saved, {0: [10, 11, 12, 13], 1: [20, 21, 22, 23], 2: [30, 31, 32, 33]})
  assert new.shape == (6, 2)
  assert new.device_ids == (10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33)


def test_remap_mesh_without_slice_axes_scales_first_axis():
  saved = plan.SavedMesh((4, 2), ('data', 'model'), tuple(range(8)), (0,) * 8, ())
  new = plan.remap_mesh(saved, {0: [0, 1, 2, 3]})
  assert new.shape == (2, 2) and new.resized_axes == ('data',) and not new.fitted


@pytest.mark.parametrize('n, shape', [(1, (1, 1)), (3, (3, 1)), (5, (5, 1)), (7, (7, 1)),
                                      (6, (3, 2)), (12, (6, 2))])
def test_remap_mesh_lays_any_device_count(n, shape):
  # Saved 4x2 on 8 devices; 1, 3, 5, 7 fit no single axis: each axis keeps what divides.
  saved = plan.SavedMesh((4, 2), ('data', 'model'), tuple(range(8)), (0,) * 8, ())
  new = plan.remap_mesh(saved, {0: list(range(100, 100 + n))})
  assert new.shape == shape and new.device_ids == tuple(range(100, 100 + n))
  assert new.fitted == (n in (1, 3, 5, 7))
  if n in (3, 5, 7):
    assert new.resized_axes == ('data', 'model')


def test_fit_spec_replicates_only_non_dividing_dims():
  spec, changed = plan.fit_spec(('data', 'model'), (8, 6), {'data': 3, 'model': 2}, ('data',))
  assert spec == (None, 'model') and changed == [0]
  assert plan.fit_spec(('data',), (8, 2), {'data': 3}, ('data',)) == ((), [0])
  spec, changed = plan.fit_spec((('data', 'model'), None), (12, 5), {'data': 3, 'model': 2}, ('data',))
  assert spec == (('data', 'model'),) and changed == []


def test_read_plan_reads_each_chunk_once_for_overlapping_needs():
  # Two device boxes that share chunks (columns 0..8 and 4..12 with chunk width 8).
  p = restore_plan.plan_array_reads((16, 16), (16, 8), [Box((0, 0), (16, 8)), Box((0, 4), (16, 12)),
                                                        Box((0, 0), (16, 8))])
  assert len(p.regions) == 1 and p.regions[0].box == Box((0, 0), (16, 16))
  assert p.bytes_read(4) == 16 * 16 * 4


def test_read_plan_column_split_of_row_chunks():
  # Saved rows of 4 split into chunks (4, 8): a column half reads exactly half.
  p = restore_plan.plan_array_reads((16, 16), (4, 8), [Box((0, 0), (16, 8))])
  assert p.bytes_read(4) == 16 * 8 * 4


# ---- end to end on 8 CPU devices -----------------------------------------------------------

def _state(m):
  """Arrays whose dims divide every slice count tried here, and 'odd' (8 rows over 'data'),
  which does not divide 3 or 6."""
  rng = np.random.default_rng(0)
  return {
      'sharded': put(rng.standard_normal((24, 8), dtype=np.float32), m, 'data', 'model'),
      'slice_only': put(rng.standard_normal((12, 3), dtype=np.float32), m, 'data'),
      'model_only': put(rng.standard_normal((5, 8), dtype=np.float32), m, None, 'model'),
      'replicated': put(rng.standard_normal((7,), dtype=np.float32), m),
      'odd': put(rng.standard_normal((8, 2), dtype=np.float32), m, 'data'),
      'bf16': put(rng.standard_normal((24, 4)).astype(jnp.bfloat16), m, 'data', 'model'),
  }


def _save(directory, state, num_slices):
  ckpt.save_with_options(directory, state, num_slices=num_slices)


def _check(restored, state, n_devices):
  for k, v in state.items():
    np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(v), err_msg=k)
    assert restored[k].dtype == v.dtype
    assert len(restored[k].sharding.device_set) <= n_devices
    assert restored[k].sharding.device_set <= set(jax.devices()[:n_devices])


@pytest.mark.parametrize('m', [3, 2, 1])
def test_four_slices_restore_onto_fewer_without_target(tmp_path, m):
  state = _state(mesh((4, 2)))
  _save(tmp_path, state, num_slices=4)
  with elastic.topology(jax.devices()[: 2 * m], num_slices=m):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      with ocp.CheckpointManager(tmp_path) as mngr:
        restored = mngr.restore(0)
  _check(restored, state, 2 * m)
  assert restored['sharded'].sharding.mesh.shape == {'data': m, 'model': 2}
  assert restored['sharded'].sharding.spec == P('data', 'model')
  odd_warned = [str(w.message) for w in caught if "array 'odd'" in str(w.message)]
  if 8 % m:
    assert restored['odd'].sharding.spec == P()
    assert odd_warned and 'replicating it along them' in odd_warned[0]
    assert 'bytes per device' in odd_warned[0]
  else:
    assert restored['odd'].sharding.spec == P('data') and not odd_warned


@pytest.mark.parametrize('n', [1, 3, 5, 7])
def test_no_target_restore_onto_any_device_count(tmp_path, n):
  # Saved on a 4x2 mesh of 8 devices; restored in a fresh process that has n devices.
  state = _state(mesh((4, 2)))
  ckpt.save(tmp_path, state)
  got = procs.worker_json(no_target_restore_worker, tmp_path, devices=n, timeout=300)
  assert got['devices'] == n
  for k, v in state.items():
    digest, dtype, mesh_shape, spec, used = got['arrays'][k]
    assert digest == hashlib.sha256(np.asarray(v).tobytes()).hexdigest(), k  # bit-exact
    assert dtype == str(v.dtype) and used == n
    assert mesh_shape == {'data': n, 'model': 1}
  # Sharded along what divides n, replicated along the rest.
  expect = {'sharded': ('data', 'model') if 24 % n == 0 else (None, 'model'),
            'slice_only': ('data',) if 12 % n == 0 else (), 'odd': ('data',) if 8 % n == 0 else ()}
  for k, spec in expect.items():
    assert got['arrays'][k][3] == str(P(*spec)), k
  (line,) = got['laid']  # one line says what was laid out how
  assert f"onto {n} device(s): saved mesh {{'data': 4, 'model': 2}} (8 device(s)) laid over " \
         f"them as {{'data': {n}, 'model': 1}}" in line
  replicated = [k for k, spec in expect.items() if 'data' not in spec]
  replicated += ['bf16'] if 24 % n else []
  assert f'{len(state) - len(replicated)} of {len(state)} arrays keep their PartitionSpec' in line
  for k in replicated:
    assert f"'{k}'" in line


def test_strict_divisibility_raises_with_the_facts(tmp_path):
  state = _state(mesh((4, 2)))
  _save(tmp_path, state, num_slices=4)
  with ckpt.options(divisibility='strict'), elastic.topology(jax.devices()[:6], num_slices=3):
    with ocp.CheckpointManager(tmp_path) as mngr:
      with pytest.raises(orbax_pathways.TopologyError,
                         match=r"array 'odd' \(8, 2\): dim 0 \(size 8\) over data does not divide "
                               r"after resizing mesh axes \['data'\] to \[3\]"):
        mngr.restore(0)


def test_grow_from_two_slices_back_to_four(tmp_path):
  m2 = mesh((2, 2), devices=jax.devices()[:4])
  state = {k: v for k, v in _state(m2).items()}
  _save(tmp_path, state, num_slices=2)
  with elastic.topology(jax.devices(), num_slices=4):
    with ocp.CheckpointManager(tmp_path) as mngr:
      restored = mngr.restore(0)
  _check(restored, state, 8)
  assert restored['sharded'].sharding.mesh.shape == {'data': 4, 'model': 2}
  assert len(restored['sharded'].sharding.device_set) == 8


def test_hybrid_mesh_data_axis_spans_slices(tmp_path):
  state = _state(mesh((4, 2)))
  _save(tmp_path, state, num_slices=2)  # slices of 4 devices: data = 2 across x 2 inside
  with elastic.topology(jax.devices()[:4], num_slices=1):
    abstract = elastic.remapped_abstract_state(tmp_path, 0)
    assert abstract['sharded'].sharding.mesh.shape == {'data': 2, 'model': 2}
    with ocp.CheckpointManager(tmp_path) as mngr:
      restored = mngr.restore(0, args=ocp.args.StandardRestore(
          {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in state.items()}))
  _check(restored, state, 4)
  assert restored['sharded'].sharding.mesh.devices.tolist() == np.asarray(jax.devices()[:4]).reshape(2, 2).tolist()


def test_explicit_targets_still_win(tmp_path):
  state = _state(mesh((4, 2)))
  _save(tmp_path, state, num_slices=4)
  target_mesh = mesh((2,), ('x',), jax.devices()[6:])
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(target_mesh, P())) for k, v in state.items()}
  with elastic.topology(jax.devices()[:2], num_slices=1):
    with ocp.CheckpointManager(tmp_path) as mngr:
      restored = mngr.restore(0, args=ocp.args.StandardRestore(target))
  for k in state:
    assert restored[k].sharding == target[k].sharding
    np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(state[k]))


def test_stock_checkpoint_restores_onto_fewer_devices(tmp_path):
  state = _state(mesh((4, 2)))
  with ckpt.stock_orbax():
    ckpt.save(tmp_path, state)
  with elastic.topology(jax.devices()[:4], num_slices=1):
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      with ocp.CheckpointManager(tmp_path) as mngr:
        restored = mngr.restore(0)
  _check(restored, state, 4)
