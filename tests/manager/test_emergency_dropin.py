"""Orbax's emergency ``CheckpointManager`` as a drop-in on the multi-tier path
(``multitier/emergency.py``): MaxText's construction, unchanged, with ``orbax_pathways`` imported,
builds one manager over the persistent directory whose declined steps on the local interval
are saved local-only, with ``local_directory`` as each node's tier.

One process (8 CPU devices, 2 slices): what lands where, values back from a local-only step and
a storage step, the dataset at the local cadence, stock Orbax reading the persistent steps, and
options the drop-in does not map keeping Orbax's own class. Several ``jax.distributed`` processes
(``support/workers/emergency_dropin_worker.py``, one process a slice, one local directory per
simulated node): a job stopped after a local-only step resumes from it on fewer slices, reading
nothing from storage, when a partner of another slice kept the lost node's share
(``ORBAX_PATHWAYS_LOCAL_COPIES=2``), and passes it over for the newest storage step when none did.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.emergency import checkpoint_manager as em
import pytest

import orbax_pathways  # pylint: disable=unused-import
from orbax_pathways import stats
from orbax_pathways._compat import orbax_emergency
from orbax_pathways.multitier import emergency as dropin
from support.arrays import mesh as make_mesh
from support.arrays import put
from support import damage
from support import procs
from support.mp_harness import run_processes
from support.workers import emergency_dropin_worker
from support.workers import emergency_import_order_worker

WORKER = emergency_dropin_worker.__file__
P = jax.sharding.PartitionSpec


def _state(m, step):
  return {'w': put(np.arange(1 << 16, dtype=np.float32).reshape(256, 256) + 1000 * step, m,
                   'data'),
          'b': put(np.arange(8, dtype=np.int32) - step, m, None)}


def _options(**local):
  return em.CheckpointManagerOptions(
      local=em.LocalCheckpointOptions(save_interval_steps=1, **local),
      persistent=em.PersistentCheckpointOptions(save_interval_steps=2))


def _build(tmp_path, m, abstract, options=None):
  (tmp_path / 'local').mkdir(exist_ok=True)
  (tmp_path / 'persistent').mkdir(exist_ok=True)
  return em.CheckpointManager(tmp_path / 'local', tmp_path / 'persistent', m, abstract,
                              options=options or _options())


def _saved(tmp_path, steps):
  """Steps ``0..steps-1`` saved through a drop-in manager on 2 slices (local every step,
  persistent every 2), closed; returns (mesh, abstract state)."""
  m = make_mesh((2, 4), ('replica', 'data'))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(m, 0))
  with _build(tmp_path, m, abstract) as mngr:
    for s in range(steps):
      mngr.save(s, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(m, s))))
  return m, abstract


def _assert_step(restored, m, step):
  for k, v in _state(m, step).items():
    np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(v))
    assert restored[k].sharding.is_equivalent_to(v.sharding, v.ndim)


def _files(root):
  return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root)
                for f in fs)


def test_maxtexts_construction_saves_local_every_step_and_persistent_every_two(tmp_path):
  """With local-only steps in storage (``local_steps_in='storage'``): the local step's Orbax
  files and records in the persistent directory, its bytes in the local directory's tier."""
  orbax_pathways.install(orbax_pathways.Options(local_steps_in='storage'))
  m = make_mesh((2, 4), ('replica', 'data'))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(m, 0))
  with _build(tmp_path, m, abstract) as mngr:
    assert type(mngr) is dropin.EmergencyCheckpointManager
    assert isinstance(mngr, orbax_emergency.stock_class())  # isinstance checks still hold
    saved = [mngr.save(s, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(m, s)),
                                                  dataset=ocp.args.JsonSave({'pos': s})))
             for s in range(4)]
    mngr.wait_until_finished()
    assert saved == [True] * 4
    assert list(mngr.all_steps()) == [0, 2, 3] and mngr.latest_step() == 3
    got = mngr.restore(3, args=ocp.args.Composite(dataset=ocp.args.JsonRestore()))
    _assert_step(got['state'], m, 3)  # a local-only step: from the tier
    assert got['dataset'] == {'pos': 3}  # the data iterator at the local cadence
    _assert_step(mngr.restore(2)['state'], m, 2)  # a storage step
  persistent = tmp_path / 'persistent'
  assert sorted(os.listdir(persistent)) == ['.orbax-pathways-local', '0', '2']
  # Step 3's array bytes are in the local directory's tier only: storage holds Orbax's files,
  # our records and an empty chunk marker per array for it, no chunk of 'w' (256 KiB).
  local_step = persistent / '.orbax-pathways-local' / '3'
  files = _files(local_step)
  assert 'state/_pathways/index.msgpack' in files and 'dataset/metadata' in files
  assert sum(os.path.getsize(local_step / f) for f in files) < 16 << 10
  assert sum(os.path.getsize(persistent / '2' / f) for f in _files(persistent / '2')) > 256 << 10
  tier = _files(tmp_path / 'local')
  assert tier and all('persistent' in f for f in tier), tier  # entries of this directory only
  assert oct(os.stat(tmp_path / 'local').st_mode & 0o777) in ('0o700', '0o755')


@pytest.mark.parametrize('handlers', ['dict', 'single'])
def test_item_handlers_without_a_state_handler_keep_the_state_s_own(tmp_path, handlers):
  """MaxText passes ``item_handlers`` for the data iterator only (Orbax gives them to its
  non-replicated manager): a dict without 'state', or one handler (the dataset's). The state's
  handler still comes from its args; both items come back, a local-only step and a storage
  step alike."""
  m = make_mesh((2, 4), ('replica', 'data'))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(m, 0))
  given = ({'dataset': ocp.JsonCheckpointHandler()} if handlers == 'dict'
           else ocp.JsonCheckpointHandler())
  (tmp_path / 'local').mkdir()
  (tmp_path / 'persistent').mkdir()
  with em.CheckpointManager(tmp_path / 'local', tmp_path / 'persistent', m, abstract,
                            options=_options(), item_handlers=given) as mngr:
    assert type(mngr) is dropin.EmergencyCheckpointManager
    for s in range(4):
      assert mngr.save(s, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(m, s)),
                                                  dataset=ocp.args.JsonSave({'pos': s})))
    mngr.wait_until_finished()
    for step in (3, 2):  # local-only, then storage
      got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(),
                                                       dataset=ocp.args.JsonRestore()))
      _assert_step(got['state'], m, step)
      assert got['dataset'] == {'pos': step}


def test_a_fresh_manager_resumes_from_the_newest_local_only_step(tmp_path):
  m, abstract = _saved(tmp_path, 4)
  with _build(tmp_path, m, abstract) as fresh:
    step = fresh.latest_step()
    assert step == 3
    _assert_step(fresh.restore(step)['state'], m, 3)


def test_a_damaged_local_only_step_is_passed_over_for_the_newest_storage_step(tmp_path, caplog):
  """Every tier chunk of step 3 flipped: the fresh manager's ``latest_step()`` tries it, passes
  it over with one warning naming it, answers 2, and restores 2 exactly; asking for 3 itself
  raises naming the step (local-only steps in storage, ``local_steps_in='storage'``)."""
  orbax_pathways.install(orbax_pathways.Options(local_steps_in='storage'))
  m, abstract = _saved(tmp_path, 4)
  flipped = 0
  for d, _, fs in os.walk(tmp_path / 'local'):
    for f in fs:
      path = os.path.join(d, f)
      if '3' in os.path.relpath(path, tmp_path / 'local').split(os.sep)[1] and not f.endswith(
          ('.msgpack', '.json', '.committed')) and os.path.getsize(path) > 0:
        data = bytearray(open(path, 'rb').read())
        data[0] ^= 0xFF
        open(path, 'wb').write(bytes(data))
        flipped += 1
  assert flipped > 0
  with caplog.at_level(logging.WARNING, logger='orbax_pathways'):
    with _build(tmp_path, m, abstract) as fresh:
      assert fresh.latest_step() == 2
      _assert_step(fresh.restore(2)['state'], m, 2)
      assert list(fresh.all_steps()) == [0, 2]  # step 3 deleted: never resumed from later
      # Training goes on from step 2 (a rollback): step 3 is saved again, and it is the new one.
      assert fresh.save(3, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(m, 33))))
      fresh.wait_until_finished()
      assert fresh.latest_step() == 3
      _assert_step(fresh.restore(3)['state'], m, 33)
  assert 'local-only step 3 cannot be restored' in caplog.text, caplog.text


@pytest.fixture
def node_steps_installed():
  """The package installed with ``local_steps_in='nodes'`` for the test; its defaults after."""
  orbax_pathways.install(orbax_pathways.Options(local_steps_in='nodes'))
  yield
  orbax_pathways.install(orbax_pathways.Options())


def test_with_node_steps_local_steps_live_in_the_local_directory_alone(tmp_path,
                                                                    node_steps_installed):
  """``local_steps_in='nodes'``: MaxText's construction, unchanged, saves its local steps (the
  state and the data iterator's JSON) into ``local_directory`` alone, in Orbax's format, nothing
  of them in the persistent directory; it lists and restores them as before, and a fresh
  manager resumes the newest (a damaged one passed over for the one before)."""
  m = make_mesh((2, 4), ('replica', 'data'))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(m, 0))
  with _build(tmp_path, m, abstract) as mngr:
    for s in range(6):
      mngr.save(s, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(m, s)),
                                           dataset=ocp.args.JsonSave({'pos': s})))
      if s == 4:  # a storage step on the local interval: in the node too, as Orbax's class
        mngr.wait_until_finished()  # keeps it in its local directory
        (node,) = [p for p in (tmp_path / 'local' / '.node-steps').iterdir()]
        assert sorted(n for n in os.listdir(node) if n.isdigit()) == ['3', '4']
    mngr.wait_until_finished()
    assert list(mngr.all_steps()) == [0, 2, 4, 5] and mngr.latest_step() == 5
    got = mngr.restore(5, args=ocp.args.Composite(dataset=ocp.args.JsonRestore()))
    _assert_step(got['state'], m, 5)
    assert got['dataset'] == {'pos': 5}
  assert sorted(os.listdir(tmp_path / 'persistent')) == ['0', '2', '4']  # no local-only step
  (node,) = [p for p in (tmp_path / 'local' / '.node-steps').iterdir()]
  # local.max_to_keep is Orbax's default, 1, as the listing says; the node also holds the step
  # before (a step commits on each process at its own moment).
  assert sorted(os.listdir(node)) == ['4', '5']
  assert {'_CHECKPOINT_METADATA', 'dataset', 'state'} <= set(os.listdir(node / '5'))
  with _build(tmp_path, m, abstract) as fresh:
    assert fresh.latest_step() == 5
    _assert_step(fresh.restore(5)['state'], m, 5)
  # Every data file of step 5 damaged.
  damage.flip_middle_bit(damage.node_data_files(node / '5' / 'state'))
  with _build(tmp_path, m, abstract) as fresh:
    assert fresh.latest_step() == 4  # 5 passed over: storage's newest
    _assert_step(fresh.restore(4)['state'], m, 4)


def test_with_node_steps_a_storage_step_is_restored_from_the_nodes_first(tmp_path,
                                                                    node_steps_installed):
  """A storage step on the local interval is a node step too: ``restore`` reads it from the
  nodes, as Orbax's class restores from its slices' local copies first, so it comes back with
  its persistent directory emptied (Orbax's ``test_local_restore_by_broadcast``); where the
  node lacks it, it is read from storage."""
  m = make_mesh((2, 4), ('replica', 'data'))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(m, 0))
  with _build(tmp_path, m, abstract) as mngr:
    for s in range(5):
      mngr.save(s, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(m, s))))
    mngr.wait_until_finished()
    (node,) = [p for p in (tmp_path / 'local' / '.node-steps').iterdir()]
    assert sorted(n for n in os.listdir(node) if n.isdigit()) == ['3', '4']
    for name in os.listdir(tmp_path / 'persistent'):  # storage emptied under the manager
      path = tmp_path / 'persistent' / name
      shutil.rmtree(path) if path.is_dir() else path.unlink()
    _assert_step(mngr.restore(4)['state'], m, 4)
    assert stats.last_restore().bytes_by_source.get('storage', 0) == 0
    with pytest.raises(Exception, match='2'):  # not on the nodes: storage, which lost it
      mngr.restore(2)
  (tmp_path / 'again').mkdir()
  _, abstract = _saved(tmp_path / 'again', 5)  # and with storage whole: the node step
  with _build(tmp_path / 'again', m, abstract) as fresh:
    assert fresh.latest_step() == 4
    _assert_step(fresh.restore(4)['state'], m, 4)
    assert stats.last_restore().bytes_by_source.get('storage', 0) == 0
    _assert_step(fresh.restore(2)['state'], m, 2)  # no node step 2 any more: from storage
    assert stats.last_restore().bytes_by_source.get('storage', 0) > 0


def test_stock_orbax_reads_the_persistent_steps(tmp_path):
  m, abstract = _saved(tmp_path, 3)
  # Orbax's own PyTree handler and ArrayHandler, not ours: stock bytes read stock's way.
  registry = ocp.type_handlers.create_type_handler_registry(
      (jax.Array, ocp.type_handlers.ArrayHandler()))
  handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
  with ocp.CheckpointManager(tmp_path / 'persistent',
                             item_handlers={'state': handler}) as stock:
    assert list(stock.all_steps()) == [0, 2]
    got = stock.restore(2, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))))
  _assert_step(got['state'], m, 2)


def test_listing_and_argument_checks_are_orbaxs(tmp_path):
  """Orbax's own test_save case: local every 3 (2 kept), persistent every 5 (3 kept), steps
  0..16 list [5, 10, 12, 15] (Orbax's local manager counts step 15, also a persistent step,
  among its 2); and Orbax's argument errors."""
  m = make_mesh((2, 4), ('replica', 'data'))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(m, 0))
  options = em.CheckpointManagerOptions(
      local=em.LocalCheckpointOptions(save_interval_steps=3, max_to_keep=2),
      persistent=em.PersistentCheckpointOptions(save_interval_steps=5, max_to_keep=3))
  state = _state(m, 0)
  with _build(tmp_path, m, abstract, options) as mngr:
    for s in range(17):
      mngr.save(s, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [5, 10, 12, 15]
    with pytest.raises(ValueError, match='process_metadata is a reserved key'):
      mngr.save(18, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                            process_metadata=ocp.args.JsonSave({})))
    with pytest.raises(ValueError, match='state is a required key'):
      mngr.save(18, args=ocp.args.Composite(other=ocp.args.PyTreeSave(state)))
    with pytest.raises(ValueError, match='must be a Composite'):
      mngr.save(18, args=ocp.args.PyTreeSave(state))


def test_options_the_drop_in_does_not_map_keep_orbaxs_own_class(tmp_path):
  m = make_mesh((1, 8), ('replica', 'data'))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(m, 0))
  options = _options(should_save_fn=lambda step, last: step % 3 == 0)
  assert dropin.unsupported(options) == ['local.should_save_fn']
  with _build(tmp_path, m, abstract, options) as mngr:
    assert type(mngr) is orbax_emergency.stock_class()


# ----------------------------------------------------------------------------------------------
# Several processes, one slice each.


def _save(tmp_path, copies, dataset='json'):
  env = {'ORBAX_PATHWAYS_LOCAL_COPIES': str(copies), 'DATASET': dataset}
  res = run_processes(WORKER, 4, 2, args=['save'], shared_dir=str(tmp_path), timeout=300,
                      env=env)
  for r in res:
    (out,) = r.results
    assert out['class'] == 'EmergencyCheckpointManager'
    assert out['saved'] == [True] * 7 and out['steps'] == [0, 4, 6], out


def _restart(tmp_path, nodes, copies, dataset='json'):
  env = {'ORBAX_PATHWAYS_LOCAL_COPIES': str(copies), 'ORBAX_PATHWAYS_TIER_PEER_TIMEOUT_S': '5',
         'DATASET': dataset}
  res = run_processes(WORKER, len(nodes), 2, args=['restart'], shared_dir=str(tmp_path),
                      timeout=300, env=env, per_process_env=[{'NODE': str(n)} for n in nodes])
  return [(r.results[0], r.stderr_tail) for r in res]


@pytest.mark.multiprocess
def test_a_lost_node_resumes_the_local_only_step_on_fewer_slices_from_partner_copies(tmp_path):
  """Saved on 4 slices with partner copies; node 3 and its local directory gone; restarted on
  3 slices: every process resumes step 6 (a local-only step) exactly, the dataset with it,
  with no byte read from storage (node 3's quarter of 'w' from node 0's partner copy)."""
  _save(tmp_path, copies=2)
  for out, tail in _restart(tmp_path, [0, 1, 2], copies=2):
    assert out['step'] == 6 and out['exact'], (out, tail[-2000:])
    assert out['dataset'] == {'step': 6}
    assert out['bytes_by_source'].get('storage', 0) == 0, out['bytes_by_source']
    assert sum(out['bytes_by_source'].values()) > 0


@pytest.mark.multiprocess
def test_a_data_iterator_is_saved_by_each_process_into_its_node_and_resumed_with_the_step(
    tmp_path):
  """The dataset a data iterator its own handler saves (as grain's), 4 slices: each process
  saves its position at ``save()`` into its own node (the iterator moves on right after),
  nothing of the local-only steps reaches the persistent directory, and a restart on the same
  nodes resumes step 6 with each process's own position and no byte from storage."""
  _save(tmp_path, copies=2, dataset='iterator')
  assert sorted(p for p in os.listdir(tmp_path / 'persistent')
                if not p.startswith('orbax-pathways-lease')) == ['0', '4']
  for i in range(4):
    (node,) = [p for p in (tmp_path / 'local' / str(i) / '.node-steps').iterdir()
               if p.name.isalnum()]
    got = (node / '6' / 'dataset' / f'process_{i}-of-4.json').read_text()
    assert json.loads(got) == {'pos': 600 + i}
    # Its partner (the next slice's node) keeps a copy of it, iterator and all.
    copy = (tmp_path / 'local' / str((i + 1) % 4) / '.node-steps' / f'{node.name}.copies'
            / f'p{i}' / '6' / 'dataset' / f'process_{i}-of-4.json')
    assert copy.read_text() == got
  for i, (out, tail) in enumerate(_restart(tmp_path, [0, 1, 2, 3], copies=2,
                                           dataset='iterator')):
    assert out['step'] == 6 and out['exact'], (out, tail[-2000:])
    assert out['dataset'] == {'pos': 600 + i}
    assert out['bytes_by_source'].get('storage', 0) == 0, out['bytes_by_source']


@pytest.mark.multiprocess
def test_without_a_partner_copy_a_lost_node_passes_the_local_step_over(tmp_path):
  """The same with one copy: node 3's part of node step 6 is on no live node, and the
  processes' devices need it ('w' is sharded over every slice); every process passes step 6
  over (one log line naming it and the missing part) and resumes from storage's step 4,
  exactly."""
  _save(tmp_path, copies=1)
  outs = _restart(tmp_path, [0, 1, 2], copies=1)
  for out, _ in outs:
    assert out['step'] == 4 and out['exact'] and out['dataset'] == {'step': 4}, out
    assert out['steps'] == [0, 4]  # the step that could not be completed is deleted
  # Node 3's quarter of step 4 comes from storage (the others from the survivors' tiers).
  assert sum(out['bytes_by_source'].get('storage', 0) for out, _ in outs) > 0
  logs = ''.join(tail for _, tail in outs)
  assert 'node step 6 cannot be restored' in logs and 'processes [3]' in logs, logs[-3000:]


@pytest.mark.parametrize('order', ['orbax_first', 'package_first'])
def test_the_drop_in_holds_whatever_the_import_order(tmp_path, order):
  """MaxText binds Orbax's class to a name of its own when its module is imported, which may
  be before ``import orbax_pathways``: building through that name gives the drop-in either way
  (local-only step 3 listed, a node step in the local directory, nothing of it in the
  persistent directory), still an instance of the name's class."""
  out = procs.worker_json(emergency_import_order_worker, order, tmp_path, timeout=240, fresh=True)
  persistent = ['0', '2', 'orbax-pathways-lease.json']
  assert out == {'class': 'EmergencyCheckpointManager', 'is_orbax_class': True,
                 'steps': [0, 2, 3], 'persistent': persistent}, out


def test_on_one_slice_it_saves_and_lists_what_orbaxs_class_does(tmp_path):
  """Orbax's single-slice test case (local every 3, 2 kept; persistent every 5, 3 kept; steps
  0..16) through the drop-in and through Orbax's own class: the same ``save`` answers, the same
  steps listed ([5, 10, 15]: Orbax's class on one slice saves to storage only), the same step
  directories, no local-only step; and the newest step restores."""
  m = make_mesh((1, 8), ('replica', 'data'))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(m, 0))
  options = em.CheckpointManagerOptions(
      local=em.LocalCheckpointOptions(save_interval_steps=3, max_to_keep=2),
      persistent=em.PersistentCheckpointOptions(save_interval_steps=5, max_to_keep=3))
  seen = {}
  for name in ('ours', 'orbax'):
    root = tmp_path / name
    (root / 'local').mkdir(parents=True)
    build = em.CheckpointManager if name == 'ours' else orbax_emergency.build_stock
    with build(root / 'local', root / 'persistent', m, abstract, options=options) as mngr:
      assert (type(mngr) is dropin.EmergencyCheckpointManager) == (name == 'ours')
      should = [mngr.should_save(s) for s in range(17)]
      saved = [mngr.save(s, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(m, s))))
               for s in range(17)]
      mngr.wait_until_finished()
      seen[name] = (should, saved, list(mngr.all_steps()), mngr.latest_step())
      _assert_step(mngr.restore(15)['state'], m, 15)
    steps = sorted(p for p in os.listdir(root / 'persistent') if p.isdigit())
    seen[name] += (steps,)
  assert seen['ours'] == seen['orbax'], seen
  assert seen['ours'][2] == [5, 10, 15]
  assert not (tmp_path / 'ours' / 'persistent' / '.orbax-pathways-local').exists()
