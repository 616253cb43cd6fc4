"""Orbax's emergency (multi-tier) CheckpointManager with orbax_pathways imported, on 8 CPU devices
in one process, local and persistent directories under tmp_path.

With one slice it is a plain CheckpointManager over the persistent directory, so our handler
writes the arrays (our ``_pathways`` metadata is there). With several slices it builds its
PyTreeCheckpointHandlers with explicit type-handler registries holding Orbax's own ArrayHandler,
so our handler is never called: the README says so, and the second test fails the day that changes.
"""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency

import orbax_pathways
from support.arrays import mesh, put


def _run(tmp_path, monkeypatch, slices: int):
  """Saves steps 0..2 (persistent every 2 steps), restores the latest; returns (steps, restored,
  state, which ProxyArrayHandler methods ran)."""
  m = mesh((slices, 8 // slices), ('replica', 'data'))
  state = {'w': put(np.arange(256, dtype=np.float32).reshape(16, 16), m, None, 'data'),
           'b': put(np.arange(8, dtype=np.int32), m, 'data')}
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  (tmp_path / 'local').mkdir()
  options = emergency.CheckpointManagerOptions(
      local=emergency.LocalCheckpointOptions(save_interval_steps=1),
      persistent=emergency.PersistentCheckpointOptions(save_interval_steps=2))
  ours = orbax_pathways.installed()
  assert ours is not None
  calls = []
  for name in ('serialize', 'deserialize'):
    original = getattr(ours, name)

    async def spy(*a, _original=original, _name=name, **k):
      calls.append(_name)
      return await _original(*a, **k)
    monkeypatch.setattr(ours, name, spy)
  with emergency.CheckpointManager(tmp_path / 'local', tmp_path / 'persistent', m, abstract,
                                   options=options) as mngr:
    for step in range(3):
      mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    mngr.wait_until_finished()
    steps = list(mngr.all_steps())
    restored = mngr.restore(mngr.latest_step())
  restored = restored['state'] if 'state' in restored else restored
  return steps, restored, state, calls


def _pathways_dirs(root):
  return sorted(os.path.relpath(d, root) for d, _, _ in os.walk(root) if d.endswith('_pathways'))


def _assert_same(restored, state):
  for k, v in state.items():
    np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(v))
    assert restored[k].sharding.is_equivalent_to(v.sharding, v.ndim)


def test_single_slice_emergency_manager_uses_our_handler(tmp_path, monkeypatch):
  steps, restored, state, calls = _run(tmp_path, monkeypatch, slices=1)
  assert steps == [0, 2]
  _assert_same(restored, state)
  assert 'serialize' in calls and 'deserialize' in calls
  assert _pathways_dirs(tmp_path / 'persistent') == ['0/state/_pathways', '2/state/_pathways']


def test_multislice_emergency_manager_uses_orbax_handler_not_ours(tmp_path, monkeypatch):
  steps, restored, state, calls = _run(tmp_path, monkeypatch, slices=2)
  assert steps == [0, 2]
  _assert_same(restored, state)
  assert calls == []  # explicit registries: Orbax's ArrayHandler wrote and read everything
  assert _pathways_dirs(tmp_path) == []
