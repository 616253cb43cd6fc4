"""A local-only save writes its arrays' zarr metadata and chunk markers to storage in one OCDBT
commit, not one commit per array, and a local-only step holding a zero-size array (or an array
saved with a cast) resumes from the tier like any other.

On gs:// every OCDBT commit rewrites the database's manifest after reading it, about three round
trips, and a local-only save's markers used to be written one array after another: a model of a
few hundred leaves paid hundreds of sequential round trips for a step whose bytes never go to
storage. Real Orbax ``CheckpointManager`` on gs:// (fake-gcs-server behind the project's fault
proxy, whose request log counts the manifest uploads), real node-local tier.
"""

from __future__ import annotations

import os
from urllib.parse import unquote

import pytest

pytestmark = pytest.mark.gcs

N_ARRAYS = 12  # plus one zero-size array and one saved as bfloat16: 14 leaves


def _state(step: int):
  import numpy as np  # pylint: disable=g-import-not-at-top
  out = {f'a{i:02d}': (np.arange(8 * (i + 1) * 4, dtype=np.float32).reshape(8 * (i + 1), 4)
                       + 1000 * step) for i in range(N_ARRAYS)}
  out['empty'] = np.zeros((0, 4), np.float32)
  out['half'] = np.linspace(-2, 2, 64 * 8, dtype=np.float32).reshape(64, 8) + step
  return out


def _process_manifest_uploads(log, step_dir: str) -> list[str]:
  """The uploads of the manifest of a per-process OCDBT database under ``step_dir`` in the
  proxy's log (tensorstore names the object in the upload URL); not the item's merged one."""
  out = []
  for method, target, _ in log:
    t = unquote(target)
    if (method == 'POST' and f'name={step_dir}/' in t and '/ocdbt.process_' in t
        and '/manifest.ocdbt' in t):
      out.append(t)
  return out


def _resumes_exactly_from_the_tiers(open_manager, state, step: int) -> None:
  """A fresh manager from ``open_manager()`` resumes local-only ``step`` (saved as
  ``state + 1000 * step``) onto one device: every value equal, no byte read from storage."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from orbax_pathways import preemption, stats  # pylint: disable=g-import-not-at-top

  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one) for k, v in state.items()}
  with open_manager() as m:
    got_step, got = preemption.resume(m, lambda: None, abstract_state=target)
  assert got_step == step, f'the local-only step {step} was passed over for {got_step}'
  for k, v in state.items():
    np.testing.assert_array_equal(np.asarray(got[k]), v + 1000 * step, err_msg=k)
  assert stats.last_restore().bytes_by_source.get('storage', 0) == 0, stats.last_restore()


def test_a_local_only_save_commits_all_its_arrays_markers_at_once_and_resumes(faulty_gcs,
                                                                             tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax_pathways import preemption, stats  # pylint: disable=g-import-not-at-top

  orbax_pathways.install(orbax_pathways.Options(
      tier_dir=str(tmp_path / 'tier'), local_steps_in='storage', local_save_interval_steps=1, tier_keep=2))
  root = faulty_gcs.path('ckpt')
  options = ocp.CheckpointManagerOptions(save_interval_steps=100)
  save_args = {k: ocp.SaveArgs(dtype=jnp.bfloat16 if k == 'half' else None) for k in _state(0)}
  proxy = faulty_gcs.proxy

  def save(m, step):
    state = {k: jax.device_put(v) for k, v in _state(step).items()}
    m.save(step, args=ocp.args.StandardSave(state, save_args=save_args))
    m.wait_until_finished()

  with ocp.CheckpointManager(root, options=options) as m:
    save(m, 0)  # a storage step
    proxy.reset_stats()
    save(m, 1)  # local-only
    local_log = proxy.log()
  uploads = _process_manifest_uploads(local_log, 'ckpt/.orbax-pathways-local/1')
  # The process's fresh OCDBT database is written once: one commit of every array's metadata
  # and marker (a commit per array's metadata and per marker: 16; the arrays created inside
  # the transaction: 2, the database's creation a commit of its own).
  assert len(uploads) == 1, uploads

  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one)
            for k, v in _state(0).items()}
  with ocp.CheckpointManager(root, options=options) as m:
    step, got = preemption.resume(m, lambda: None, abstract_state=target)
  assert step == 1, 'the local-only step 1 was passed over'
  want = _state(1)
  for k, v in want.items():
    expected = v.astype(jnp.bfloat16).astype(np.float32) if k == 'half' else v
    np.testing.assert_array_equal(np.asarray(got[k]), expected, err_msg=k)
    assert got[k].shape == v.shape and got[k].dtype == np.float32, k
  assert stats.last_restore().bytes_by_source.get('storage', 0) == 0, stats.last_restore()


def test_a_local_only_saves_storage_requests_do_not_grow_with_its_arrays(faulty_gcs, tmp_path):
  """The storage requests of a local-only save are about the same for 2 arrays and for 40:
  nothing of it is sent per array (the arrays' metadata and markers are opened and written all
  at once, in one commit). Before, each array's open read the database on its own, one after
  another: one round trip more per array."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top

  orbax_pathways.install(orbax_pathways.Options(
      tier_dir=str(tmp_path / 'tier'), local_steps_in='storage', local_save_interval_steps=1, tier_keep=1))
  options = ocp.CheckpointManagerOptions(save_interval_steps=100)
  proxy = faulty_gcs.proxy
  requests = {}
  for n in (2, 40):
    state = {f'a{i:02d}': np.full((16, 4), i, np.float32) for i in range(n)}
    with ocp.CheckpointManager(faulty_gcs.path(f'ckpt{n}'), options=options) as m:
      m.save(0, args=ocp.args.StandardSave({k: jax.device_put(v) for k, v in state.items()}))
      m.wait_until_finished()
      proxy.reset_stats()
      m.save(1, args=ocp.args.StandardSave({k: jax.device_put(v) for k, v in state.items()}))
      m.wait_until_finished()
      requests[n] = proxy.stats()['requests']
  assert requests[40] - requests[2] <= 8, requests


def test_a_manager_s_handler_settings_hold_for_its_local_only_steps(tmp_path):
  """``item_handlers=StandardCheckpointHandler(use_ocdbt=False)``: the hidden manager saves with
  the manager's own handler, so the local-only step is written like the storage step (a
  directory per array, no OCDBT database; its metadata, no chunk), and it resumes exactly from
  the tier with no storage byte read. Before, the hidden manager took Orbax's default handler
  (OCDBT) whatever the manager's."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top

  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tmp_path / 'tier'),
                                                local_steps_in='storage', local_save_interval_steps=1))
  root = tmp_path / 'ckpt'
  options = ocp.CheckpointManagerOptions(save_interval_steps=100)
  state = {k: v for k, v in _state(0).items() if k != 'empty'}

  def manager():
    return ocp.CheckpointManager(root, options=options,
                                 item_handlers=ocp.StandardCheckpointHandler(use_ocdbt=False))

  with manager() as m:
    for step in (0, 1):  # 0: storage; 1: local-only
      m.save(step, args=ocp.args.StandardSave(
          {k: jax.device_put(v + 1000 * step) for k, v in state.items()}))
    m.wait_until_finished()
  assert (root / '0' / 'default' / 'a00' / '.zarray').is_file()
  local = root / '.orbax-pathways-local' / '1' / 'default'
  assert (local / 'a00' / '.zarray').is_file(), sorted(p.name for p in local.iterdir())
  assert not (local / 'manifest.ocdbt').exists() and not list(local.glob('ocdbt.process_*'))
  assert not [f for f in os.listdir(local / 'a00') if f[0].isdigit()]  # no chunk in storage
  _resumes_exactly_from_the_tiers(manager, state, 1)


def test_a_custom_handler_of_the_manager_saves_its_item_in_local_only_steps(tmp_path, caplog):
  """A handler the manager knows only through its ``handler_registry`` (its arguments have no
  global registration): every local-only save failed ("Unable to find registered
  CheckpointHandler", one warning per step, an ``N.orbax-checkpoint-tmp`` left behind). Now the
  hidden manager holds the manager's handlers: step 1 is committed local-only and restores both
  items, the custom one by its own handler."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax_pathways.multitier import local_steps  # pylint: disable=g-import-not-at-top

  @dataclasses.dataclass
  class NoteSave(ocp.args.CheckpointArgs):
    note: dict

  @dataclasses.dataclass
  class NoteRestore(ocp.args.CheckpointArgs):
    pass

  class NoteHandler(ocp.JsonCheckpointHandler):
    async def async_save(self, directory, args):
      return await super().async_save(directory, args=ocp.args.JsonSave(args.note))

    def save(self, directory, args):
      return super().save(directory, args=ocp.args.JsonSave(args.note))

    def restore(self, directory, args=None):
      return super().restore(directory, args=ocp.args.JsonRestore())

  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tmp_path / 'tier'),
                                                local_steps_in='storage', local_save_interval_steps=1))
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  handler = NoteHandler()
  registry.add('note', NoteSave, handler)
  registry.add('note', NoteRestore, handler)
  root = tmp_path / 'ckpt'
  options = ocp.CheckpointManagerOptions(save_interval_steps=100)
  caplog.set_level(logging.WARNING, logger='orbax_pathways')
  w = np.arange(32, dtype=np.float32)
  with ocp.CheckpointManager(root, options=options, handler_registry=registry) as m:
    for step in (0, 1):  # 0: storage; 1: local-only
      m.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave({'w': jax.device_put(w + step)}),
          note=NoteSave({'step': step})))
    m.wait_until_finished()
    failed = [r.getMessage() for r in caplog.records if 'local-only' in r.getMessage()]
    assert not failed, failed
    listed = os.listdir(root / '.orbax-pathways-local')
    assert [n for n in listed if n[0].isdigit()] == ['1'], listed  # committed, no tmp left
    inner = local_steps.local_manager(m)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    got = inner.restore(1, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(
            {'w': jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=one)}),
        note=NoteRestore()))
  assert got.note == {'step': 1}
  np.testing.assert_array_equal(np.asarray(got.state['w']), w + 1)


def test_a_v1_context_without_ocdbt_saves_and_resumes_a_local_only_step(tmp_path):
  """Orbax v1's ``Context`` with ``use_ocdbt=False`` goes with the background local-only save:
  no database to commit markers into, so each array is created in storage as tensorstore does
  (its zarr metadata, no chunk), and the step resumes exactly from the tier with no storage
  byte read."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top

  v1 = ocp.v1
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tmp_path / 'tier'),
                                                local_steps_in='storage', local_save_interval_steps=2))
  root = tmp_path / 'ckpt'
  context = v1.Context(array_options=v1.options.ArrayOptions(
      saving=v1.options.ArrayOptions.Saving(use_ocdbt=False)))
  state = {k: v for k, v in _state(0).items() if k not in ('empty', 'half')}
  policy = v1.training.save_decision_policies.FixedIntervalPolicy(10)
  with v1.training.Checkpointer(root, context=context, save_decision_policy=policy) as ckptr:
    for step in range(3):  # 0: storage; 2: local-only
      ckptr.save(step, {k: jax.device_put(v + 1000 * step) for k, v in state.items()})
    ckptr.wait()
  (item,) = [p for p in (root / '.orbax-pathways-local' / '2').iterdir() if p.is_dir()]
  assert (item / 'a00' / '.zarray').is_file() or (item / 'a00' / 'zarr.json').is_file(), (
      sorted(p.name for p in item.iterdir()))
  assert not (item / 'manifest.ocdbt').exists()
  assert not [f for f in os.listdir(item / 'a00') if f[0].isdigit() or f == 'c']  # no chunk
  _resumes_exactly_from_the_tiers(lambda: v1.training.Checkpointer(root, context=context),
                                  state, 2)


def test_orbax_s_clean_up_at_a_restart_on_gcs_keeps_the_local_only_steps(faulty_gcs, tmp_path):
  """A job restarted with ``CheckpointManagerOptions(cleanup_tmp_directories=True)`` on gs://:
  Orbax's clean-up removes every directory under the manager's without ``commit_success.txt``,
  and ``.orbax-pathways-local`` is one, so every local-only step was gone before the resume
  (it took storage's step 0). Now the clean-up leaves it, and the resume takes step 1."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax_pathways import preemption  # pylint: disable=g-import-not-at-top

  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tmp_path / 'tier'),
                                                local_steps_in='storage', local_save_interval_steps=1))
  root = faulty_gcs.path('ckpt')
  x = np.arange(64, dtype=np.float32)
  with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(
      save_interval_steps=100)) as m:
    for step in (0, 1):  # 0: storage; 1: local-only
      m.save(step, args=ocp.args.StandardSave({'x': jax.device_put(x + step)}))
    m.wait_until_finished()
  # An unfinished storage step of the run that died (no commit_success.txt): Orbax's to remove.
  (epath.Path(root) / '2' / 'default').mkdir(parents=True)
  restart = ocp.CheckpointManagerOptions(save_interval_steps=100, cleanup_tmp_directories=True)
  with ocp.CheckpointManager(root, options=restart) as m:
    step, got = preemption.resume(m, lambda: None)
  names = sorted(p.name for p in epath.Path(root).iterdir())
  assert names == ['.orbax-pathways-local', '0'], names
  assert step == 1, 'the local-only step was removed by the clean-up'
  np.testing.assert_array_equal(np.asarray(got['x']), x + 1)
