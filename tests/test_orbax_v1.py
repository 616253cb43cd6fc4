"""Unchanged Orbax v1 code (``ocp.v1.save`` / ``load``, ``ocp.v1.training.Checkpointer``, a
``Context`` with ``PathwaysOptions``) goes through the same engine as v0: our records and
checksums on disk, elastic restore without a target, stats and log lines, the CLI, and stock
Orbax v1 reading ours (and us reading stock's)."""

import json
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways import elastic
from orbax_pathways import preemption
from orbax_pathways.storage import meta_io

from support import REPO, damage
from support.arrays import assert_trees_equal, mesh, put, random_state
from support.procs import run_python

v1 = ocp.v1


def _arrays_only(state):
  return {k: v for k, v in state.items() if k != 'step'}


def test_save_and_load_go_through_our_engine(tmp_path):
  state = random_state(mesh())
  v1.save(tmp_path / 'a', state)
  st = orbax_pathways.stats.last_save()
  assert st.transport == 'local' and st.arrays == 4 and st.step_dir == str(tmp_path / 'a')
  item = tmp_path / 'a' / 'state'
  md = meta_io.read_item(item)
  assert md is not None and md.transports() == {'local'}
  assert {c.crc32c for a in md.arrays().values() for c in a.chunks}  # every chunk checksummed
  loaded = v1.load(tmp_path / 'a')
  assert_trees_equal(loaded, state)
  rst = orbax_pathways.stats.last_restore()
  assert rst.arrays == 4 and rst.chunks_verified >= 4


def test_uninstall_gives_v1_back_to_stock(tmp_path):
  orbax_pathways.uninstall()
  try:
    state = random_state(mesh())
    v1.save(tmp_path / 'a', state)
    assert not (tmp_path / 'a' / 'state' / '_pathways').exists()
  finally:
    orbax_pathways.install()
  v1.save(tmp_path / 'b', random_state(mesh()))
  assert (tmp_path / 'b' / 'state' / '_pathways').exists()


def test_flipped_byte_is_caught_through_v1(tmp_path):
  m = mesh()
  value = np.random.default_rng(0).standard_normal((256, 64), dtype=np.float32)
  v1.save(tmp_path / 'a', {'w': put(value, m, 'data', 'model')})
  item = tmp_path / 'a' / 'state'
  needle = np.ascontiguousarray(value[:32, :32]).tobytes()[:64]
  files = sorted(item.glob('ocdbt.process_0/d/*'), key=lambda p: -p.stat().st_size)
  damage.flip_bit_in(files, needle, what='chunk of w (v1 writes zarr3; floats uncompressed)')
  with pytest.raises(orbax_pathways.ChecksumMismatchError, match=r"Checksum mismatch in array 'w'"):
    v1.load(tmp_path / 'a')


@pytest.mark.parametrize('m', [2, 1])
def test_no_target_load_onto_fewer_slices(tmp_path, m):
  state = {'w': put(np.arange(24 * 8, dtype=np.float32).reshape(24, 8), mesh(), 'data', 'model'),
           'b': put(np.arange(12, dtype=np.int32), mesh(), 'data')}
  orbax_pathways.install(orbax_pathways.Options(num_slices=4))
  v1.save(tmp_path / 'a', state)
  orbax_pathways.install(orbax_pathways.Options.from_env())
  with elastic.topology(jax.devices()[: 2 * m], num_slices=m):
    loaded = v1.load(tmp_path / 'a')
  assert_trees_equal(loaded, state)
  assert loaded['w'].sharding.mesh.shape == {'data': m, 'model': 2}
  assert loaded['w'].sharding.device_set <= set(jax.devices()[: 2 * m])


def test_training_checkpointer_saves_on_preemption_and_the_cli_reads_it(tmp_path):
  state = _arrays_only(random_state(mesh()))
  policies = v1.training.save_decision_policies
  policy = policies.AnySavePolicy([policies.FixedIntervalPolicy(10),
                                   policies.PreemptionCheckpointingPolicy()])
  ckpt = v1.training.Checkpointer(tmp_path / 'run', save_decision_policy=policy)
  saved = []
  try:
    for step in range(1, 16):
      if step == 13:
        preemption.notify_preemption('test')
      if ckpt.should_save(step):
        ckpt.save(step, state)
        saved.append(step)
    ckpt.wait()
  finally:
    preemption.clear_notice()
  # Step 10 by the interval; 13 on the notice (stock answers False on a single controller).
  assert saved[:2] == [10, 13], saved
  assert [c.step for c in ckpt.checkpoints] == saved
  assert_trees_equal(ckpt.load(13), state)
  assert orbax_pathways.stats.saves_for_step(13, str(tmp_path / 'run'))[-1].commit_s > 0
  proc = subprocess.run([sys.executable, '-m', 'orbax_pathways', 'verify', str(tmp_path / 'run' / '13'),
                         '--json'], capture_output=True, text=True, cwd=REPO, timeout=120)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert json.loads(proc.stdout)['ok'] is True


def test_pathways_options_choose_the_transport(tmp_path, monkeypatch):
  """Under Pathways (simulated: colocated Python runs in-process on CPU), the v1 Context's
  ``checkpointing_impl`` picks our transport; unset keeps our default."""
  monkeypatch.setenv('ORBAX_PATHWAYS_RUNTIME', 'pathways')
  state = _arrays_only(random_state(mesh()))
  impl = ocp.pathways.CheckpointingImpl if hasattr(ocp, 'pathways') else None
  from orbax.checkpoint.experimental.v1._src.context import options as v1_options  # pylint: disable=g-import-not-at-top
  for name, expected in (('NO_DISPATCHER', 'local'), ('COLOCATED_PYTHON', 'colocated')):
    ctx = v1.Context(pathways_options=v1_options.PathwaysOptions(
        checkpointing_impl=getattr(impl, name)))
    with ctx:
      v1.save(tmp_path / name, state)
      assert orbax_pathways.stats.last_save().transport == expected
      assert_trees_equal(v1.load(tmp_path / name), state)


def test_stock_v1_reads_ours_and_we_read_stock_v1(tmp_path):
  state = _arrays_only(random_state(mesh()))
  v1.save(tmp_path / 'ours', state)
  run_python(f"""
      import numpy as np, orbax.checkpoint as ocp, sys
      out = ocp.v1.load({str(tmp_path / 'ours')!r})
      assert 'orbax_pathways' not in sys.modules
      np.save({str(tmp_path / 'w.npy')!r}, np.asarray(out['params']['w']))
      ocp.v1.save({str(tmp_path / 'stock')!r}, {{'x': np.arange(10.0)}})
  """, env={'ORBAX_PATHWAYS_DISABLE': '1'})
  np.testing.assert_array_equal(np.load(tmp_path / 'w.npy'), np.asarray(state['params']['w']))
  assert v1.load(tmp_path / 'stock')['x'].tolist() == list(np.arange(10.0))


def test_load_and_broadcast_is_left_to_orbax_and_said_once(tmp_path, caplog, monkeypatch):
  """A Context asking for ``use_load_and_broadcast`` is served by Orbax's own handler (we have
  no broadcast restore): the values read back equal, our engine did not serve it, and the log
  says so once per process however many loads."""
  from orbax.checkpoint.experimental.v1._src.context import options as v1_options  # pylint: disable=g-import-not-at-top
  from orbax_pathways import _said  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(_said, '_said', set())
  m = mesh()
  x = put(np.arange(64, dtype=np.float32).reshape(8, 8), m, None, 'model')
  v1.save_pytree(tmp_path / 'ckpt', {'x': x})
  ours_before = orbax_pathways.stats.last_restore()
  ctx = v1.Context(array_options=v1_options.ArrayOptions(
      loading=v1_options.ArrayOptions.Loading(use_load_and_broadcast=True)))
  target = {'x': jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)}
  with caplog.at_level('INFO', logger='orbax_pathways'), ctx:
    for _ in range(2):
      out = v1.load_pytree(tmp_path / 'ckpt', target)
      np.testing.assert_array_equal(np.asarray(out['x']), np.asarray(x))
      assert out['x'].sharding == x.sharding
  assert orbax_pathways.stats.last_restore() is ours_before
  said = [r.getMessage() for r in caplog.records if 'use_load_and_broadcast' in r.getMessage()]
  assert len(said) == 1, said
  assert 'not checksummed' in said[0]
