"""Unchanged Orbax v1 code (``ocp.v1.save`` / ``load``, ``ocp.v1.training.Checkpointer``, a
``Context`` with ``PathwaysOptions``) goes through the same engine as v0: our records and
checksums on disk (for ``np.ndarray`` and scalar leaves too), elastic restore without a target,
stats and log lines, the CLI, and stock Orbax v1 reading ours (and us reading stock's)."""

import contextlib
import io
import json
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways.sharding import elastic
from orbax_pathways.format import records as records_lib
from orbax_pathways import preemption
from orbax_pathways._compat import orbax_v1_seams as compat_v1
from orbax_pathways.cli import main as cli_main
from orbax_pathways.storage import index as index_lib
from orbax_pathways.storage import meta_io

from support import ckpt
from support import damage
from support import procs
from support.arrays import assert_trees_equal, host_leaf_state, mesh, put, random_state
from support.workers import stock_v1_worker

# An exception nobody could raise (an answer into a closed event loop) or a coroutine never
# awaited fails the test.
pytestmark = [pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning'),
              pytest.mark.filterwarnings('error:coroutine .* was never awaited:RuntimeWarning')]

v1 = ocp.v1


def _arrays_only(state):
  return {k: v for k, v in state.items() if k != 'step'}


def _host_state(seed: int = 0) -> dict:
  return host_leaf_state(seed, with_numpy_scalar=True)


_HOST_LEAVES = ('loader', 'rng', 'step', 'lr', 'ema')


def _assert_host_state_equal(out, state):
  np.testing.assert_array_equal(np.asarray(out['w']), np.asarray(state['w']))
  for name in ('loader', 'rng'):
    assert type(out[name]) is np.ndarray and out[name].dtype == state[name].dtype, name
    np.testing.assert_array_equal(out[name], state[name])
  assert (out['step'], out['lr'], out['ema']) == (7, 0.25, 0.5)
  assert type(out['step']) is int and type(out['lr']) is float


def _verify(path) -> tuple[int, str]:
  """``orbax-pathways verify`` in this process (the CLI's ``main``): (exit code, stdout)."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    code = cli_main.main(['verify', str(path)])
  return code, out.getvalue()


def _uncompressed():
  """A v1 Context that stores arrays uncompressed, so that a flipped byte still decodes."""
  from orbax.checkpoint.experimental.v1._src.context import options as v1_options  # pylint: disable=g-import-not-at-top
  return v1.Context(array_options=v1_options.ArrayOptions(
      saving=v1_options.ArrayOptions.Saving(use_compression=False)))


def _data_files(item: pathlib.Path) -> list[pathlib.Path]:
  return sorted((p for p in item.rglob('*') if p.is_file() and '_pathways' not in p.parts),
                key=lambda p: -p.stat().st_size)


def test_save_and_load_go_through_our_engine(tmp_path):
  state = random_state(mesh())
  v1.save(tmp_path / 'a', state)
  st = orbax_pathways.stats.last_save()
  assert st.transport == 'in_process' and st.arrays == 4 and st.step_dir == str(tmp_path / 'a')
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


def test_numpy_and_scalar_leaves_are_recorded_and_verified(tmp_path):
  """Orbax v1 writes numpy and scalar leaves through its own leaf handlers; they get the
  crc32c records they get under v0 (beside Orbax's unchanged files), loads verify them, and the
  CLI finds every value checksummed."""
  assert compat_v1.hooked_host_kinds() == ('numpy', 'scalar')
  state = _host_state()
  v1.save(tmp_path / 'a', state)
  item = tmp_path / 'a' / 'state'
  arrays = meta_io.read_item(item).arrays()
  assert set(arrays) == {'w', *_HOST_LEAVES}
  for name in _HOST_LEAVES:
    assert arrays[name].chunks and all(c.crc32c is not None for c in arrays[name].chunks), name
  writers = sorted(p.name for p in (item / records_lib.DIRNAME).iterdir())
  assert any(w.startswith('numpy.') for w in writers), writers
  assert any(w.startswith('scalar.') for w in writers), writers
  _assert_host_state_equal(v1.load(tmp_path / 'a'), state)
  code, out = _verify(tmp_path / 'a')
  assert code == 0 and out.splitlines()[-1].startswith('OK: 6 arrays'), out


def test_flipped_byte_in_a_numpy_leaf_is_caught_through_v1(tmp_path):
  state = _host_state()
  with _uncompressed():
    v1.save(tmp_path / 'a', state)
  item = tmp_path / 'a' / 'state'
  damage.flip_bit_in(_data_files(item), state['loader'].tobytes()[:64], what='loader bytes')
  with pytest.raises(orbax_pathways.ChecksumMismatchError,
                     match=r"Checksum mismatch in array 'loader', chunk at \[0, 0\] .*a/state/"
                           r"loader: recorded crc32c"):
    v1.load(tmp_path / 'a')
  code, out = _verify(tmp_path / 'a')
  assert code == 1 and 'loader' in out and 'FAILED' in out, out


def test_a_lost_numpy_record_is_an_error_through_v1(tmp_path):
  """Host leaves recorded (scalar records there) but the numpy leaves' record gone: an error
  naming the leaf, as under v0, not an unchecked read."""
  v1.save(tmp_path / 'a', _host_state())
  item = tmp_path / 'a' / 'state'
  for f in (item / records_lib.DIRNAME).glob('*.msgpack'):
    if f.name.startswith(('numpy.', 'index.')):
      f.unlink()
  index_lib.merge_item(item)
  meta_io.clear_cache()
  with pytest.raises(orbax_pathways.errors.MissingChecksumError, match=r"Array '(loader|rng)'"):
    v1.load(tmp_path / 'a')
  code, _ = _verify(tmp_path / 'a')
  assert code == 1


def test_host_leaves_saved_by_orbaxs_v1_handlers_load_unchecked(tmp_path):
  """A v1 checkpoint whose numpy and scalar leaves have no records (saved by an orbax-pathways
  that left them to Orbax's v1 handlers, or with this Orbax's seams missing): loads as before,
  the jax.Array still verified; the CLI says UNCHECKED (exit 3)."""
  state = _host_state()
  v1.save(tmp_path / 'a', state)
  item = tmp_path / 'a' / 'state'
  ckpt.drop_host_leaf_records(item)
  assert set(meta_io.read_item(item).arrays()) == {'w'}
  _assert_host_state_equal(v1.load(tmp_path / 'a'), state)
  assert orbax_pathways.stats.last_restore().chunks_verified > 0
  code, out = _verify(tmp_path / 'a')
  assert code == 3 and 'UNCHECKED' in out and "loader: np.ndarray leaf saved by Orbax's" in out


def test_without_the_v1_host_seams_host_leaves_stay_orbaxs(tmp_path, monkeypatch):
  """An Orbax without v1's numpy/scalar handler factories (``HOST_SEAMS`` empty): install works,
  v1 saves those leaves with Orbax's own handlers (no records, as before), loads and verifies
  (exit 3), with no error. Our np.ndarray handler in v0's registry does not reach v1."""
  from orbax_pathways._compat import orbax as compat  # pylint: disable=g-import-not-at-top
  orbax_pathways.uninstall()
  try:
    with monkeypatch.context() as patched:
      patched.setattr(compat_v1, 'HOST_SEAMS', ())
      orbax_pathways.install()
      assert compat_v1.hooked_host_kinds() == ()
      assert type(compat.registered_handler(np.ndarray)).__name__ == 'ProxyNumpyHandler'
      state = _host_state()
      v1.save(tmp_path / 'a', state)
      assert set(meta_io.read_item(tmp_path / 'a' / 'state').arrays()) == {'w'}
      _assert_host_state_equal(v1.load(tmp_path / 'a'), state)
      assert _verify(tmp_path / 'a')[0] == 3
  finally:
    orbax_pathways.uninstall()  # the fixture installs again, with the seams


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
  state = random_state(mesh())  # with its Python int 'step': checksummed too, so verify says OK
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
  proc = procs.run_cli('verify', tmp_path / 'run' / '13', '--json', timeout=120)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert json.loads(proc.stdout)['ok'] is True


def test_training_checkpointer_records_and_verifies_numpy_and_scalar_leaves(tmp_path):
  state = _host_state()
  ckpt = v1.training.Checkpointer(tmp_path / 'run', context=_uncompressed())
  ckpt.save(1, state)
  ckpt.wait()
  item = next(p for p in (tmp_path / 'run' / '1').iterdir() if (p / records_lib.DIRNAME).is_dir())
  assert set(meta_io.read_item(item).arrays()) == {'w', *_HOST_LEAVES}
  _assert_host_state_equal(ckpt.load(1), state)
  assert _verify(tmp_path / 'run' / '1')[0] == 0
  ckpt.close()
  damage.flip_bit_in(_data_files(item), state['loader'].tobytes()[:64], what='loader bytes')
  with pytest.raises(Exception) as caught:  # Orbax 0.12.8 wraps it in its NoEntryError
    v1.training.Checkpointer(tmp_path / 'run').load(1)
  chain = [caught.value]
  while chain[-1].__cause__ is not None:
    chain.append(chain[-1].__cause__)
  mismatch = [e for e in chain if isinstance(e, orbax_pathways.ChecksumMismatchError)]
  assert mismatch and "array 'loader'" in str(mismatch[0]), chain


def test_pathways_options_choose_the_transport(tmp_path, monkeypatch):
  """Under Pathways (simulated: colocated Python runs in-process on CPU), the v1 Context's
  ``checkpointing_impl`` picks our transport; unset keeps our default."""
  monkeypatch.setenv('ORBAX_PATHWAYS_RUNTIME', 'pathways')
  state = _arrays_only(random_state(mesh()))
  impl = ocp.pathways.CheckpointingImpl if hasattr(ocp, 'pathways') else None
  from orbax.checkpoint.experimental.v1._src.context import options as v1_options  # pylint: disable=g-import-not-at-top
  for name, expected in (('NO_DISPATCHER', 'in_process'), ('COLOCATED_PYTHON', 'colocated')):
    ctx = v1.Context(pathways_options=v1_options.PathwaysOptions(
        checkpointing_impl=getattr(impl, name)))
    with ctx:
      v1.save(tmp_path / name, state)
      assert orbax_pathways.stats.last_save().transport == expected
      assert_trees_equal(v1.load(tmp_path / name), state)


def test_stock_v1_reads_ours_and_we_read_stock_v1(tmp_path):
  """Our records are additive: stock Orbax v1 loads our jax.Array, numpy and scalar leaves; a
  stock v1 checkpoint loads through us unchecked, as before (the CLI: UNCHECKED, exit 3)."""
  state = _host_state()
  v1.save(tmp_path / 'ours', state)
  procs.run_worker(stock_v1_worker, tmp_path / 'ours', tmp_path / 'ours.npz',
                   tmp_path / 'scalars.json', tmp_path / 'stock', env={'ORBAX_PATHWAYS_DISABLE': '1'})
  saved = np.load(tmp_path / 'ours.npz')
  for name in ('w', 'loader', 'rng'):
    np.testing.assert_array_equal(saved[name], np.asarray(state[name]))
  assert json.loads((tmp_path / 'scalars.json').read_text()) == {'step': 7, 'lr': 0.25, 'ema': 0.5}
  out = v1.load(tmp_path / 'stock')
  assert out['x'].tolist() == list(np.arange(10.0)) and (out['step'], out['lr']) == (3, 0.5)
  code, text = _verify(tmp_path / 'stock')
  assert code == 3 and 'UNCHECKED' in text and 'written by stock Orbax' in text


def test_load_and_broadcast_is_left_to_orbax_and_said_once(tmp_path, caplog, monkeypatch):
  """A Context asking for ``use_load_and_broadcast`` is served by Orbax's own handler (we have
  no broadcast restore): the values read back equal, our engine did not serve it, and the log
  says so once per process however many loads."""
  from orbax.checkpoint.experimental.v1._src.context import options as v1_options  # pylint: disable=g-import-not-at-top
  from orbax_pathways._util import said  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(said, '_said', set())
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
