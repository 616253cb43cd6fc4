"""Leaves saved with a dtype cast: v0 ``SaveArgs(dtype=...)``, v1
``ArrayOptions.Saving.StorageOptions(dtype=...)`` and v1's ``scoped_storage_options_creator``.

Orbax casts through tensorstore's ``cast`` driver, so what lands on disk is tensorstore's
conversion of the values. Each checkpoint here is saved by us and by stock Orbax in the same
test, restored without a target, with a target in the stored dtype and with a target of another
dtype, and every leaf must come back bit for bit as stock returns it; ``orbax-pathways verify``
must pass every chunk. The values are the ones where numpy's ``astype`` and tensorstore's
conversion differ (NaN payloads, float64 -> bfloat16 rounding, bfloat16 -> integers), where a
checksum of anything but the stored bytes fails.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

import orbax_pathways
from orbax_pathways.cli import main as cli_main
from orbax_pathways.storage import cast as cast_lib
from orbax_pathways.storage import meta_io
from orbax_pathways.tier import store as tier_store
from support import ckpt
from support.arrays import mesh, put

v1 = ocp.v1
BF16 = np.dtype(ml_dtypes.bfloat16)

# Values where numpy's astype and tensorstore's conversion disagree (see storage/cast.py).
F32_EDGES = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e10, -1e10, 3.7, -3.7,
                      2.5, -2.5, 0.5, 65535.9, -0.9, 1e-40, 70000.5, 1.0], np.float32)
BF16_EDGES = np.array([1.5, -2.5, np.nan, np.inf, -np.inf, 3e38, -3e38, 300.,
                       -300., 0.5, -1., 255., 256., -129., 2.**31, 7.], BF16)
F64_EDGES = np.array([1 + 2**-8 + 2**-30, np.nan, np.inf, 1e300, 1e-300, 3.14159265358979,
                      -1e10, 65504.5, 70000.0, 1.00390625, -2.5, 0.1], np.float64).reshape(3, 4)

# name -> (value builder, save dtype, restore dtype other than the stored one)
_JAX = {
    'w_bf16': (lambda: put(F32_EDGES, mesh(), ('data', 'model')), BF16, np.dtype(np.int32)),
    'w_i16': (lambda: put(F32_EDGES, mesh(), 'data'), np.dtype(np.int16), np.dtype(np.float32)),
    'b_u8': (lambda: put(BF16_EDGES, mesh(), 'data'), np.dtype(np.uint8), np.dtype(np.float32)),
    'i_f32': (lambda: put(np.arange(16, dtype=np.int32) * 1_000_003 + 2**24 + 1, mesh()),
              np.dtype(np.float32), np.dtype(np.int32)),
}
_NUMPY = {
    'n_bf16': (lambda: F64_EDGES.copy(), BF16, np.dtype(np.uint16)),
    'n_i16': (lambda: (np.arange(24, dtype=np.float32).reshape(4, 6) - 12) * 3000.7,
              np.dtype(np.int16), np.dtype(np.float64)),
    'n_f32': (lambda: np.arange(8, dtype=np.int64) * 123456789 + 2**24 + 1,
              np.dtype(np.float32), np.dtype(np.int32)),
}
_SCALARS = {  # Python scalars: Orbax saves them as 0-d int64 / float64 arrays
    's_int': (lambda: 16_777_217, np.dtype(np.float32), np.dtype(np.int64)),
    's_float': (lambda: 0.25, np.dtype(np.int32), np.dtype(np.float64)),
    's_round': (lambda: 1 + 2**-8 + 2**-30, BF16, np.dtype(np.float32)),
}
_ALL = {**_JAX, **_NUMPY, **_SCALARS}


def _state() -> dict:
  return {name: build() for name, (build, _, _) in _ALL.items()}


def _save_dtypes() -> dict:
  return {name: save for name, (_, save, _) in _ALL.items()}


def _other_dtypes() -> dict:
  return {name: other for name, (_, _, other) in _ALL.items()}


def _leaf_bits(x) -> tuple:
  """What a user compares: the type, and for arrays the dtype, shape and bytes (NaN payloads
  included); for Python scalars their value's bytes."""
  if isinstance(x, (int, float)):
    return type(x).__name__, np.asarray(x).tobytes()
  a = np.asarray(x)
  return type(x).__name__, a.dtype.name, a.shape, a.tobytes()


def _assert_same_as_stock(got: dict, expected: dict, what: str) -> None:
  assert set(got) == set(expected), what
  bad = {k: (got[k], expected[k]) for k in expected if _leaf_bits(got[k]) != _leaf_bits(expected[k])}
  assert not bad, f'{what}: differs from stock Orbax: {bad}'


def _verify(step_dir: pathlib.Path) -> dict:
  """``orbax-pathways verify --json`` in this process; asserts exit 0."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    code = cli_main.main(['verify', str(step_dir), '--json'])
  doc = json.loads(out.getvalue())
  assert code == 0 and doc['ok'], doc['problems']
  assert doc['chunks_checksummed'] == doc['chunks'] > 0, doc
  return doc


def _assert_records_are_the_stored_dtypes(item: pathlib.Path) -> None:
  arrays = meta_io.read_item(item).arrays()
  assert set(arrays) == set(_ALL)
  assert {n: a.dtype for n, a in arrays.items()} == {n: d.name for n, d in _save_dtypes().items()}


# ---- the conversion itself -----------------------------------------------------------------------

@pytest.mark.parametrize('src', [F32_EDGES, BF16_EDGES, F64_EDGES.reshape(-1),
                                 np.array([2**63 - 1, -2**63, 2**53 + 1, 70000, -1, 256], np.int64),
                                 np.array([2**31 - 1, -2**31, 2**24 + 1, -1, 256], np.int32),
                                 np.array([32767, -32768, 2049, -1], np.int16),
                                 np.array([127, -128, -1], np.int8),
                                 np.array([255, 0, 128], np.uint8),
                                 np.array([True, False])], ids=lambda a: a.dtype.name)
def test_convert_is_what_the_cast_driver_stores(tmp_path, src):
  """``storage/cast.convert`` gives the bytes tensorstore's ``cast`` driver (Orbax's cast
  write) stores, for every target dtype Orbax can save, also where it takes numpy's astype
  (``numpy_is_exact``: integer widening, bfloat16 -> float32)."""
  for target in ('int8', 'int16', 'int32', 'int64', 'uint8', 'uint16', 'uint32', 'uint64',
                 'float16', 'bfloat16', 'float32', 'float64', 'bool', 'float8_e4m3fn', 'int4'):
    base = {'driver': 'zarr', 'kvstore': {'driver': 'file', 'path': str(tmp_path / target)},
            'dtype': target, 'metadata': {'shape': list(src.shape), 'chunks': list(src.shape),
                                          'compressor': None}}
    with np.errstate(all='ignore'):
      t = ts.open({'driver': 'cast', 'dtype': src.dtype.name, 'base': base}, create=True).result()
      t.write(src).result()
      stored = ts.open(base).result().read().result()
      mine = cast_lib.convert(src, np.dtype(stored.dtype))
    assert (mine.dtype, mine.tobytes()) == (stored.dtype, stored.tobytes()), target


@pytest.mark.parametrize('kind', ['jax.Array', 'numpy', 'scalar'])
def test_a_cast_tensorstore_cannot_do_fails_at_save_and_is_never_committed(tmp_path, kind):
  """tensorstore has no ``uint4``: the cast raises from ``save()`` naming the leaf and both
  dtypes (stock fails it later, in the background commit), step 0 is never committed, and the
  manager saves the next step."""
  value = {'jax.Array': lambda: put(np.arange(16, dtype=np.float32), mesh(), 'data'),
           'numpy': lambda: np.arange(16, dtype=np.float32), 'scalar': lambda: 3.0}[kind]()
  leaf = 'host leaf' if kind != 'jax.Array' else 'array'
  with ocp.CheckpointManager(tmp_path, item_handlers=_v0_handler(True)) as mngr:
    with pytest.raises(ValueError, match=rf"Cannot cast {leaf} 'x' from float(32|64) to uint4: "
                                         r'tensorstore.*has no such conversion.*'
                                         r'Save it without this dtype \(SaveArgs.dtype'):
      mngr.save(0, args=ocp.args.PyTreeSave(
          {'x': value}, save_args={'x': ocp.SaveArgs(dtype=np.dtype('uint4'))}))
    mngr.save(1, args=ocp.args.PyTreeSave({'x': value}))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1]
  assert '0' not in {p.name for p in tmp_path.iterdir()}  # (Orbax's temporary one may stay)
  _verify(tmp_path / '1')


# ---- Orbax v0: SaveArgs(dtype=...) -----------------------------------------------------------------

def _v0_handler(use_ocdbt: bool):
  return ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt)


def _v0_save(directory, state, use_ocdbt: bool) -> pathlib.Path:
  save_args = {name: ocp.SaveArgs(dtype=dtype) for name, dtype in _save_dtypes().items()}
  with ocp.CheckpointManager(directory, item_handlers=_v0_handler(use_ocdbt)) as mngr:
    mngr.save(0, args=ocp.args.PyTreeSave(state, save_args=save_args))
    mngr.wait_until_finished()
  return pathlib.Path(directory) / '0'


def _v0_restore_args(state, dtypes: dict | None) -> dict:
  """Restore args of ``state``'s leaves: jax.Array at its sharding, numpy as numpy, scalars as
  their Python type; in ``dtypes`` (None: the stored dtype)."""
  out = {}
  for name, value in state.items():
    dtype = dtypes[name] if dtypes else None
    if isinstance(value, jax.Array):
      out[name] = ocp.ArrayRestoreArgs(sharding=value.sharding, dtype=dtype)
    else:
      out[name] = ocp.RestoreArgs(restore_type=type(value), dtype=dtype)
  return out


def _v0_restores(directory, state, use_ocdbt: bool) -> dict[str, dict]:
  """Restored trees: without a target, with a target in the stored dtypes, in other dtypes."""
  out = {}
  with ocp.CheckpointManager(directory, item_handlers=_v0_handler(use_ocdbt)) as mngr:
    out['no target'] = mngr.restore(0)
    for what, dtypes in (('stored dtypes', _save_dtypes()), ('other dtypes', _other_dtypes())):
      out[what] = mngr.restore(0, args=ocp.args.PyTreeRestore(
          item=state, restore_args=_v0_restore_args(state, dtypes)))
  return out


@pytest.mark.parametrize('use_ocdbt,transport', [(True, 'in_process'), (False, 'in_process'),
                                                 (True, 'colocated')],
                         ids=['ocdbt', 'zarr', 'colocated'])
def test_v0_save_args_dtype_restores_as_stock_and_verifies(tmp_path, use_ocdbt, transport):
  """The colocated transport's workers checksum and read their shares with the same code."""
  state = _state()
  with ckpt.options(transport=transport):
    step = _v0_save(tmp_path / 'ours', state, use_ocdbt)
    got = _v0_restores(tmp_path / 'ours', state, use_ocdbt)
    assert orbax_pathways.stats.last_restore().chunks_verified > 0  # read by us, verified
    assert orbax_pathways.stats.last_restore().transport == transport
  _assert_records_are_the_stored_dtypes(step / 'default')
  with ckpt.stock_orbax():
    _v0_save(tmp_path / 'stock', state, use_ocdbt)
    expected = _v0_restores(tmp_path / 'stock', state, use_ocdbt)
    stock_reads_ours = _v0_restores(tmp_path / 'ours', state, use_ocdbt)
  for what in expected:
    _assert_same_as_stock(got[what], expected[what], f'ours, restored with {what}')
    _assert_same_as_stock(stock_reads_ours[what], expected[what], f'stock reading ours, {what}')
  _verify(step)


# ---- Orbax v1: StorageOptions(dtype=...) and scoped_storage_options_creator ----------------------

def _v1_context(use_ocdbt: bool) -> v1.Context:
  """Each leaf's dtype from the per-leaf callback, except 'i_f32', 'n_f32' and 's_int', for
  which it returns None: they fall back to the Context's global ``StorageOptions(dtype=float32)``."""
  storage_options = v1.options.ArrayOptions.Saving.StorageOptions
  dtypes = _save_dtypes()
  fallback = {'i_f32', 'n_f32', 's_int'}
  assert {dtypes[n] for n in fallback} == {np.dtype(np.float32)}

  def per_leaf(keypath, value):
    del value
    name = keypath[-1].key
    return None if name in fallback else storage_options(dtype=dtypes[name])

  ctx = v1.Context()
  ctx.array.saving.use_ocdbt = use_ocdbt
  ctx.array.saving.storage_options.dtype = np.float32
  ctx.array.saving.scoped_storage_options_creator = per_leaf
  return ctx


def _v1_abstract(state, dtypes: dict) -> dict:
  out = {}
  for name, value in state.items():
    if isinstance(value, jax.Array):
      out[name] = jax.ShapeDtypeStruct(value.shape, dtypes[name], sharding=value.sharding)
    elif isinstance(value, np.ndarray):
      out[name] = np.empty(value.shape, dtypes[name])
    else:
      out[name] = type(value)
  return out


def _v1_loads(path, state) -> dict[str, dict]:
  out = {'no target': v1.load(path)}
  for what, dtypes in (('stored dtypes', _save_dtypes()), ('other dtypes', _other_dtypes())):
    out[what] = v1.load(path, _v1_abstract(state, dtypes))
  return out


@pytest.mark.parametrize('use_ocdbt', [True, False], ids=['ocdbt', 'zarr'])
def test_v1_storage_options_and_per_leaf_callback_restore_as_stock_and_verify(tmp_path, use_ocdbt):
  state = _state()
  with _v1_context(use_ocdbt):
    v1.save(tmp_path / 'ours', state)
  _assert_records_are_the_stored_dtypes(tmp_path / 'ours' / 'state')
  with ckpt.stock_orbax():
    with _v1_context(use_ocdbt):
      v1.save(tmp_path / 'stock', state)
    expected = _v1_loads(tmp_path / 'stock', state)
    stock_reads_ours = _v1_loads(tmp_path / 'ours', state)
  got = _v1_loads(tmp_path / 'ours', state)
  assert orbax_pathways.stats.last_restore().chunks_verified > 0  # read by us, verified
  for what in expected:
    _assert_same_as_stock(got[what], expected[what], f'ours, loaded with {what}')
    _assert_same_as_stock(stock_reads_ours[what], expected[what], f'stock reading ours, {what}')
  _verify(tmp_path / 'ours')


# ---- the node-local tier holds the stored bytes ------------------------------------------------

def test_a_cast_leafs_tier_copy_is_the_stored_bytes_and_serves_the_restore(tmp_path):
  """The tier copy of a cast jax.Array is what storage holds (its crc32c is the committed
  one), so a same-topology restore reads all of it from the tier, none from storage."""
  state = {name: _JAX[name][0]() for name in _JAX}
  save_args = {name: ocp.SaveArgs(dtype=_JAX[name][1]) for name in _JAX}
  restore_args = _v0_restore_args(state, {name: _JAX[name][1] for name in _JAX})
  args = ocp.args.PyTreeRestore(item=state, restore_args=restore_args)
  with ckpt.options(tier_dir=str(tmp_path / 'tier')):
    with ocp.CheckpointManager(tmp_path / 'ckpt', item_handlers=_v0_handler(True)) as mngr:
      mngr.save(0, args=ocp.args.PyTreeSave(state, save_args=save_args))
      mngr.wait_until_finished()
    tier_store.flush()  # the tier copy lands in the background, after the commit
    with ocp.CheckpointManager(tmp_path / 'ckpt', item_handlers=_v0_handler(True)) as mngr:
      got = mngr.restore(0, args=args)
    st = orbax_pathways.stats.last_restore()
  with ckpt.stock_orbax():
    with ocp.CheckpointManager(tmp_path / 'ckpt', item_handlers=_v0_handler(True)) as mngr:
      expected = mngr.restore(0, args=args)
  _assert_same_as_stock(got, expected, 'restored from the tier')
  stored = sum(np.asarray(v).nbytes for v in expected.values())
  assert st.bytes_by_source == {'local': stored, 'storage': 0}, st.bytes_by_source
