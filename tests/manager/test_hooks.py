"""The manager hooks (``manager/hooks.py``): what is registered, in which order Orbax's calls reach
them, and what an answer or an exception of a hook does to a real CheckpointManager on disk."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from orbax_pathways._compat import orbax_manager as om
from orbax_pathways.manager import hooks as hooks_lib


@pytest.fixture
def swap():
  """Registers hook objects in place of the installed ones (by name); puts those back after."""
  before = om.registered()

  def put(*objs):
    for h in objs:
      om.register(h)
  yield put
  for h in om.registered():
    if h.name not in {b.name for b in before}:
      om.unregister(h)
  for h in before:
    om.register(h)
  assert [h.name for h in om.registered()] == [h.name for h in before]


def _recorder(name: str, calls: list):
  class Recorder(hooks_lib.ManagerHooks):
    def manager_init(self, mngr):
      calls.append(('manager_init', self.name))

    def before_save(self, mngr, step):
      calls.append(('before_save', self.name, step))

    def after_save(self, mngr, step, saved):
      calls.append(('after_save', self.name, step, saved))

    def after_commit(self, mngr, step, commit_s):
      calls.append(('after_commit', self.name, step))

    def close(self, mngr):
      calls.append(('close', self.name))
  Recorder.name = name
  return Recorder()


def test_import_registers_every_concern_in_order():
  assert [h.name for h in om.registered()] == list(hooks_lib.ORDER)
  assert all(isinstance(h, hooks_lib.ManagerHooks) for h in om.registered())


def test_calls_reach_every_hook_in_order_on_a_real_save(tmp_path, swap):
  calls: list = []
  # Registered in reverse: the order is ORDER's, not the registration's.
  swap(*[_recorder(n, calls) for n in reversed(hooks_lib.ORDER)])
  mngr = ocp.CheckpointManager(tmp_path / 'ckpt')
  mngr.save(3, args=ocp.args.StandardSave({'x': jnp.arange(8.0)}))
  mngr.wait_until_finished()
  mngr.close()
  names = list(hooks_lib.ORDER)
  assert calls == ([('manager_init', n) for n in names]
                   + [('before_save', n, 3) for n in names]
                   + [('after_save', n, 3, True) for n in names]
                   + [('after_commit', n, 3) for n in names]
                   + [('close', n) for n in names])
  assert ocp.CheckpointManager(tmp_path / 'ckpt').all_steps() == [3]


def test_a_hook_that_raises_before_save_refuses_it_with_nothing_written(tmp_path, swap):
  class Refuse(hooks_lib.ManagerHooks):
    name = 'checks'

    def before_save(self, mngr, step):
      raise RuntimeError(f'step {step} refused')

  swap(Refuse())
  mngr = ocp.CheckpointManager(tmp_path / 'ckpt')
  with pytest.raises(RuntimeError, match='step 1 refused'):
    mngr.save(1, args=ocp.args.StandardSave({'x': jnp.arange(4.0)}))
  mngr.close()
  assert not (tmp_path / 'ckpt').exists() or list((tmp_path / 'ckpt').iterdir()) == []
  assert ocp.CheckpointManager(tmp_path / 'ckpt').all_steps() == []


def test_reached_preemption_first_answer_wins_then_stock(tmp_path, swap):
  answers = {'checks': None, 'lease': None}

  class Answer(hooks_lib.ManagerHooks):
    def __init__(self, name):
      self._name = name

    @property
    def name(self):  # type: ignore[override]
      return self._name

    def reached_preemption(self, mngr, step, stock, participants):
      return answers[self._name]

  class NoPreemption(hooks_lib.ManagerHooks):
    name = 'preemption'  # the installed preemption hooks would answer first otherwise

  swap(Answer('checks'), Answer('lease'), NoPreemption())
  mngr = ocp.CheckpointManager(tmp_path / 'ckpt')
  assert mngr.reached_preemption(5) is False  # nobody answers: Orbax's own (no notice)
  answers['lease'] = True
  assert mngr.reached_preemption(6) is True
  answers['checks'] = False  # earlier in ORDER: its answer stands
  assert mngr.reached_preemption(7) is False
  mngr.close()


def test_a_hook_hides_a_step_from_listings_and_restores(tmp_path, swap):
  mngr = ocp.CheckpointManager(tmp_path / 'ckpt')
  for step in (1, 2):
    mngr.save(step, args=ocp.args.StandardSave({'x': np.full(4, step, np.float32)}))
  mngr.wait_until_finished()
  mngr.close()

  class HideTwo(hooks_lib.ManagerHooks):
    name = 'checks'

    def step_complete(self, step_path):
      return False if step_path.name == '2' else None  # None: retention still judges step 1

  swap(HideTwo())
  reader = ocp.CheckpointManager(tmp_path / 'ckpt')
  assert reader.all_steps() == [1] and reader.latest_step() == 1


def test_a_saves_step_metadata_registration_ends_however_the_save_ends(tmp_path):
  """``manager/step_metadata.py`` remembers a save's ``_CHECKPOINT_METADATA`` only while that
  save runs: nothing stays registered after a committed save, a declined one, one Orbax's
  ``save`` raised for, or a close."""
  from orbax_pathways._compat import orbax_step_metadata as osm  # pylint: disable=g-import-not-at-top
  options = ocp.CheckpointManagerOptions(save_interval_steps=2)
  with ocp.CheckpointManager(tmp_path / 'ckpt', options=options) as m:
    assert m.save(0, args=ocp.args.StandardSave({'w': jnp.arange(8.0)}))
    m.wait_until_finished()
    assert osm.registered() == []  # committed
    assert not m.save(1, args=ocp.args.StandardSave({'w': jnp.arange(8.0)}))
    assert osm.registered() == []  # declined by Orbax's policy
    with pytest.raises(Exception):
      m.save(2, args=ocp.args.StandardSave({'w': object()}))
    assert osm.registered() == []  # Orbax's save raised
    assert m.save(4, args=ocp.args.StandardSave({'w': jnp.arange(8.0)}))
  assert osm.registered() == []  # closed
  np.testing.assert_array_equal(
      ocp.CheckpointManager(tmp_path / 'ckpt').restore(4)['w'], np.arange(8.0))
