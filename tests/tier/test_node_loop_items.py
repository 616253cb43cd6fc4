"""Node steps with an item only its own handler can save (``multitier/node_loop_items.py``): a
data iterator, whose handler reads the iterator's position as it saves (as grain's does). Its
handler saves it in the training loop's thread; the step's arrays are saved on the background
thread; the step lands in the node alone, with nothing of it in storage. One process, 8 CPU
devices, a real v0 ``CheckpointManager``, Orbax's emergency one (the drop-in) and Orbax v1's
``training.Checkpointer``, real tier directories."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.emergency import checkpoint_manager as em
import pytest

import orbax_pathways
from orbax_pathways import preemption
from support import damage
from support import iterators
from support.arrays import mesh as make_mesh
from support.arrays import put


def _state(m, step):
  return {'w': put(np.arange(1 << 16, dtype=np.float32).reshape(256, 256) + 1000 * step, m,
                   'data')}


def _assert_state(restored, m, step):
  np.testing.assert_array_equal(np.asarray(restored['w']), np.asarray(_state(m, step)['w']))


def _fresh():
  """Restore arguments for a new iterator (a restarted job's)."""
  return iterators.IteratorRestore(iterators.Iterator())


def _item_handlers(step_dir):
  return json.loads((step_dir / '_CHECKPOINT_METADATA').read_text())['item_handlers']


_V0_OPTIONS = ocp.CheckpointManagerOptions(save_interval_steps=10)  # storage every 10 steps


def _save_v0_steps(root, m) -> None:
  """Steps 0..3 of MaxText's ``items`` + ``iter`` through a v0 ``CheckpointManager``: the
  iterator at ``7 * step`` when ``save()`` runs, moved on right after (the next batches are
  drawn while the local-only save runs)."""
  it = iterators.Iterator()
  with ocp.CheckpointManager(root, options=_V0_OPTIONS) as mngr:
    for s in range(4):
      it.pos = 7 * s
      mngr.save(s, args=ocp.args.Composite(items=ocp.args.StandardSave(_state(m, s)),
                                           iter=iterators.IteratorSave(it)))
      it.pos = -1
    mngr.wait_until_finished()


def _v0_restore(abstract, iterator: bool = True):
  """Every item's restore arguments of ``_save_v0_steps``'s steps (the tree alone: not
  ``iterator``)."""
  if not iterator:
    return ocp.args.Composite(items=ocp.args.StandardRestore(abstract))
  return ocp.args.Composite(items=ocp.args.StandardRestore(abstract), iter=_fresh())


@pytest.fixture
def node_steps_installed():
  orbax_pathways.install(orbax_pathways.Options(local_steps_in='nodes'))
  yield
  orbax_pathways.install(orbax_pathways.Options())


def test_emergency_drop_in_saves_a_data_iterator_into_the_node_at_the_save(
    tmp_path, node_steps_installed):
  """Orbax's emergency manager, local every step, persistent every 2, a data iterator beside
  the state: each local-only step is in ``local_directory`` alone, the iterator at the position
  it had when ``save()`` ran (it moves on right after, while the step is still saved), named
  with its own handler as Orbax's persistent step names it; no staging left; restored (and
  resumed by a fresh manager) with the iterator's restore arguments."""
  m = make_mesh((2, 4), ('replica', 'data'))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(m, 0))
  (tmp_path / 'local').mkdir()
  (tmp_path / 'persistent').mkdir()
  options = em.CheckpointManagerOptions(
      local=em.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
      persistent=em.PersistentCheckpointOptions(save_interval_steps=2))
  it = iterators.Iterator()

  def build():
    return em.CheckpointManager(tmp_path / 'local', tmp_path / 'persistent', m, abstract,
                                options=options)

  with build() as mngr:
    for s in range(6):
      it.pos = 10 * s
      mngr.save(s, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(m, s)),
                                           dataset=iterators.IteratorSave(it)))
      it.pos = -1  # the next batches are drawn while the local save runs
    mngr.wait_until_finished()
    got = mngr.restore(5, args=ocp.args.Composite(dataset=_fresh()))
    _assert_state(got['state'], m, 5)
    assert got['dataset'].pos == 50
  # Nothing of the local-only steps in storage (no hidden directory of their records).
  assert sorted(os.listdir(tmp_path / 'persistent')) == ['0', '2', '4']
  (node,) = (tmp_path / 'local' / '.node-steps').iterdir()
  assert sorted(os.listdir(node)) == ['4', '5']  # no staging directory left
  dataset = node / '5' / 'dataset'
  # The files Orbax's save through the iterator's handler wrote for storage step 4.
  assert 'process_0-of-1.json' in os.listdir(dataset)
  stored = tmp_path / 'persistent' / '4' / 'dataset'
  assert sorted(os.listdir(dataset)) == sorted(os.listdir(stored))
  assert json.loads((dataset / 'process_0-of-1.json').read_text()) == {'pos': 50}
  assert (_item_handlers(node / '5')['dataset']
          == _item_handlers(tmp_path / 'persistent' / '4')['dataset'])
  assert 'IteratorHandler' in _item_handlers(node / '5')['dataset']
  with build() as fresh:
    assert fresh.latest_step() == 5
    got = fresh.restore(5, args=ocp.args.Composite(dataset=_fresh()))
    _assert_state(got['state'], m, 5)
    assert got['dataset'].pos == 50
  # Step 5's array damaged: a fresh manager resumes step 4 (its node copy), iterator and all.
  damage.flip_middle_bit(damage.node_data_files(node / '5' / 'state'))
  with build() as fresh:
    assert fresh.latest_step() == 4
    got = fresh.restore(4, args=ocp.args.Composite(dataset=_fresh()))
    _assert_state(got['state'], m, 4)
    assert got['dataset'].pos == 40


def test_v0_manager_saves_a_data_iterator_into_the_node_and_resumes_it_with_the_state(tmp_path):
  """A v0 ``CheckpointManager`` (storage every 10 steps, local every step, MaxText's
  ``items`` + ``iter``): the local-only steps are node steps holding the iterator as its
  handler wrote it at the save, and none of their files is in storage; stock Orbax's own
  manager over the node directory restores the step, iterator and all. ``preemption.resume``
  with every item's restore arguments resumes node step 3, iterator and all; with its and step
  2's iterator files lost, storage step 0 with its own."""
  root, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), local_save_interval_steps=1,
                                                tier_keep=2, local_steps_in='nodes'))
  m = make_mesh((8,), ('data',))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(m, 0))

  def resume(iterator=True):
    with ocp.CheckpointManager(root, options=_V0_OPTIONS) as mngr:
      return preemption.resume(mngr, lambda: None, args=_v0_restore(abstract, iterator))

  try:
    _save_v0_steps(root, m)
    assert sorted(os.listdir(root)) == ['0']  # storage step 0 alone: no hidden local directory
    (node,) = (tier / '.node-steps').iterdir()
    assert sorted(os.listdir(node)) == ['2', '3']
    assert json.loads((node / '3' / 'iter' / 'process_0-of-1.json').read_text()) == {'pos': 21}
    with ocp.CheckpointManager(node, options=ocp.CheckpointManagerOptions(
        read_only=True)) as stock:
      got = stock.restore(3, args=_v0_restore(abstract))
    _assert_state(got['items'], m, 3)
    assert got['iter'].pos == 21

    step, got = resume()
    assert step == 3 and isinstance(got, ocp.args.Composite)
    _assert_state(got['items'], m, 3)
    assert got['iter'].pos == 21
    assert sorted(os.listdir(node)) == ['2', '3']
    step, got = resume(iterator=False)  # the tree alone: its item, from the same step
    assert step == 3 and list(got.keys()) == ['items']
    _assert_state(got['items'], m, 3)
    # Every item of a step must restore: with the iterator files of node steps 3 and 2 lost,
    # both are passed over, and storage step 0 comes back with its own.
    os.remove(node / '3' / 'iter' / 'process_0-of-1.json')
    os.remove(node / '2' / 'iter' / 'process_0-of-1.json')
    step, got = resume()
    assert step == 0 and got['iter'].pos == 0
    _assert_state(got['items'], m, 0)
  finally:
    orbax_pathways.install(orbax_pathways.Options())


def test_local_steps_in_storage_resume_a_data_iterator_with_the_state(tmp_path):
  """``local_steps_in='storage'`` (local-only steps' records in storage, their bytes in the
  tier): ``preemption.resume`` with every item's restore arguments resumes local-only step 3,
  iterator and all."""
  root, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), local_save_interval_steps=1,
                                                tier_keep=2, local_steps_in='storage'))
  m = make_mesh((8,), ('data',))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(m, 0))
  try:
    _save_v0_steps(root, m)
    assert '3' in os.listdir(root / '.orbax-pathways-local')
    with ocp.CheckpointManager(root, options=_V0_OPTIONS) as mngr:
      step, got = preemption.resume(mngr, lambda: None, args=_v0_restore(abstract))
  finally:
    orbax_pathways.install(orbax_pathways.Options())
  assert step == 3 and got['iter'].pos == 21
  _assert_state(got['items'], m, 3)


def test_resume_names_what_is_wrong_with_its_arguments(tmp_path):
  """``args=`` without exactly one tree item, or beside ``abstract_state=``: a ``ValueError``
  naming the items and what to pass."""
  with ocp.CheckpointManager(tmp_path / 'ckpt') as mngr:
    with pytest.raises(ValueError, match=r"exactly one tree item .*found 0 among \['iter'\]"):
      preemption.resume(mngr, lambda: None, args=ocp.args.Composite(iter=_fresh()))
    with pytest.raises(ValueError, match='not as well as abstract_state='):
      preemption.resume(mngr, lambda: None, abstract_state={}, args=ocp.args.Composite(
          iter=_fresh()))
    with pytest.raises(ValueError, match='must be an ocp.args.Composite'):
      preemption.resume(mngr, lambda: None, args={'iter': _fresh()})


def test_v1_checkpointer_saves_a_data_iterator_into_the_node_and_stock_v1_reads_it(tmp_path):
  """Orbax v1's ``training.Checkpointer`` (storage every 10 steps, local every step) saving
  the state and a v1 ``StatefulCheckpointable`` data iterator, as MaxText's v1 trainers save
  grain's: the local-only steps are node steps holding the iterator at its position at
  ``save()``, named with v1's handler as storage step 0 names it, and none of their files is
  in storage; stock v1's ``load_checkpointables`` of the node step gives both back, and
  ``preemption.resume`` through a new Checkpointer resumes the newest node step's tree."""
  root, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), local_save_interval_steps=1,
                                                tier_keep=2, local_steps_in='nodes'))
  m = make_mesh((8,), ('data',))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(m, 0))
  policy = ocp.v1.training.save_decision_policies.FixedIntervalPolicy(10)
  it = iterators.V1Iterator()
  try:
    with ocp.v1.training.Checkpointer(root, save_decision_policy=policy) as ckptr:
      for s in range(4):
        it.pos = 7 * s
        ckptr.save_checkpointables(s, {'pytree': _state(m, s), 'iter': it})
        it.pos = -1  # the next batches are drawn while the local-only save runs
      ckptr.wait()
    assert sorted(os.listdir(root)) == ['0']  # storage step 0 alone: no hidden local directory
    (node,) = (tier / '.node-steps').iterdir()
    assert sorted(os.listdir(node)) == ['2', '3']  # no staging directory left
    assert json.loads((node / '3' / 'iter' / 'process_0-of-1.json').read_text()) == {'pos': 21}
    assert sorted(os.listdir(node / '3' / 'iter')) == sorted(os.listdir(root / '0' / 'iter'))
    assert _item_handlers(node / '3')['iter'] == _item_handlers(root / '0')['iter']
    assert 'StatefulCheckpointableHandler' in _item_handlers(node / '3')['iter']
    fresh = iterators.V1Iterator()
    got = ocp.v1.load_checkpointables(node / '3', {'pytree': abstract, 'iter': fresh})
    _assert_state(got['pytree'], m, 3)
    assert fresh.pos == 21
    with ocp.v1.training.Checkpointer(root, save_decision_policy=policy) as ckptr:
      step, state = preemption.resume(ckptr, lambda: None, abstract_state=abstract)
    assert step == 3
    _assert_state(state, m, 3)
    # With every item's arguments, the iterator comes back with the state, from the node...
    fresh = iterators.V1Iterator(-1)
    with ocp.v1.training.Checkpointer(root, save_decision_policy=policy) as ckptr:
      step, got = preemption.resume(ckptr, lambda: None,
                                    args={'pytree': abstract, 'iter': fresh})
    assert step == 3 and sorted(got) == ['iter', 'pytree'] and got['iter'] is fresh
    _assert_state(got['pytree'], m, 3)
    assert fresh.pos == 21
    # ...and from storage once the node is gone (a new node: an empty tier).
    shutil.rmtree(tier / '.node-steps')
    fresh = iterators.V1Iterator(-1)
    with ocp.v1.training.Checkpointer(root, save_decision_policy=policy) as ckptr:
      step, got = preemption.resume(ckptr, lambda: None,
                                    args={'pytree': abstract, 'iter': fresh})
    assert step == 0 and fresh.pos == 0
    _assert_state(got['pytree'], m, 0)
  finally:
    orbax_pathways.install(orbax_pathways.Options())
