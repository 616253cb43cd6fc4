"""Every pytree stock Orbax saves and restores, the package saves and restores the same way:
hypothesis draws the trees (bare arrays, sharded, replicated or numpy; top-level lists; nested
dicts, lists and tuples; empty containers; ``None`` leaves; key names with dots, spaces,
non-ASCII, digits only or 120+ characters; 0-d arrays; odd shard shapes and partly replicated
arrays; every dtype jax has on the CPU; Python scalars and strings).

Each tree is saved through v0 (``PyTreeCheckpointer``) or v1 (``ocp.v1.save_pytree``) by stock
Orbax and by the package, and read back with no target: ours by the package and by stock Orbax,
stock's by the package. Each read must equal what stock reading stock gives: the same tree, leaf
types, dtypes, shapes, bytes and shardings. A tree stock refuses to save may be refused by the
package too; a step the package commits must restore.

The bare array as the whole tree is the case this file was written for: the package committed
it with its array metadata under ``/.zarray`` instead of ``.zarray``, and no reader, ours or
stock, could open it. JAX cannot place an array whose dimension its mesh axis does not divide,
so "uneven" shards here are odd shard shapes (3 or 5 rows, 6 columns) and arrays sharded over
one mesh axis and replicated over the other.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from hypothesis import HealthCheck, example, given, settings, strategies as st
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from support import ckpt

DTYPES = ('bool', 'int4', 'int8', 'int16', 'int32', 'int64', 'uint8', 'uint16', 'uint32',
          'uint64', 'float16', 'bfloat16', 'float8_e4m3fn', 'float8_e5m2', 'float32', 'float64',
          'complex64')
SPECS = (P(), P('a'), P('b'), P('a', 'b'), P(None, 'a'), P(('a', 'b')))
AXIS = {'a': 4, 'b': 2}
NAMES = ('w', 'a.b', 'with space', 'ñandú', '权重', '0', '123', 'x' * 130, 'layer.0.kernel',
         '_private', 'CamelCase')
EXAMPLES = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ('a', 'b'))


def _divides(spec: P, shape: tuple[int, ...]) -> bool:
  if len(spec) > len(shape):
    return False
  for axes, dim in zip(spec, shape):
    names = axes if isinstance(axes, tuple) else (axes,) if axes else ()
    if dim % int(np.prod([AXIS[n] for n in names], dtype=np.int64)):
      return False
  return True


# ---- what hypothesis draws: plain data, built into arrays inside the test -------------------

def _array_leaf(kind: str):
  shapes = st.lists(st.sampled_from((1, 2, 3, 4, 5, 6, 8, 12)), min_size=0, max_size=3)
  return st.tuples(st.just(kind), st.sampled_from(DTYPES), shapes.map(tuple),
                   st.integers(0, len(SPECS) - 1), st.integers(0, 2**16))


LEAVES = st.one_of(
    _array_leaf('jax'),
    _array_leaf('numpy'),
    st.tuples(st.just('int'), st.integers(-2**31, 2**31 - 1)),
    st.tuples(st.just('float'), st.floats(allow_nan=False, width=32)),
    st.tuples(st.just('str'), st.text(max_size=12)),
    st.tuples(st.just('none')),
)
KEYS = st.one_of(st.sampled_from(NAMES), st.text(min_size=1, max_size=8).filter(
    lambda k: '/' not in k))
TREES = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.dictionaries(KEYS, children, max_size=4).map(lambda d: ('dict', d)),
        st.lists(children, max_size=3).map(lambda xs: ('list', xs)),
        st.lists(children, max_size=3).map(lambda xs: ('tuple', xs))),
    max_leaves=10)

BARE_SHARDED = ('jax', 'float32', (8, 6), SPECS.index(P('a', 'b')), 1)
BARE_REPLICATED = ('jax', 'bfloat16', (5, 3), SPECS.index(P()), 2)
BARE_NUMPY = ('numpy', 'int32', (4, 3), 0, 3)
MANY_LEAVES = ('dict', {f'p{i:03d}': ('jax', DTYPES[i % len(DTYPES)], (8,), 1, i)
                        for i in range(150)})


def _values(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if dtype == np.bool_:
    return rng.integers(0, 2, shape).astype(dtype)
  if dtype == ml_dtypes.int4:
    return rng.integers(-8, 7, shape, endpoint=True).astype(dtype)
  if dtype.kind in 'iu':
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
  if dtype.kind == 'c':
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
  return rng.standard_normal(shape).astype(dtype)


def _build(spec: Any, mesh: Mesh) -> Any:
  kind = spec[0]
  if kind in ('jax', 'numpy'):
    _, dtype, shape, spec_index, seed = spec
    values = _values(np.dtype(getattr(ml_dtypes, dtype, dtype)), shape, seed)
    if kind == 'numpy':
      return values
    fits = [s for s in SPECS if _divides(s, shape)]
    return jax.device_put(values, NamedSharding(mesh, fits[spec_index % len(fits)]))
  if kind in ('int', 'float', 'str'):
    return spec[1]
  if kind == 'none':
    return None
  if kind == 'dict':
    return {k: _build(v, mesh) for k, v in spec[1].items()}
  items = [_build(v, mesh) for v in spec[1]]
  return items if kind == 'list' else tuple(items)


# ---- saving and reading, stock and ours ----------------------------------------------------

def _save(api: str, path: str, tree: Any) -> BaseException | None:
  try:
    if api == 'v0':
      ocp.PyTreeCheckpointer().save(path, tree)
    else:
      ocp.v1.save_pytree(path, tree)
  except Exception as e:  # pylint: disable=broad-except
    return e
  return None


def _load(api: str, path: str) -> Any:
  if api == 'v0':
    return ocp.PyTreeCheckpointer().restore(path)
  return ocp.v1.load_pytree(path)


def _leaf_view(x: Any) -> Any:
  """What a user compares of one leaf."""
  if isinstance(x, jax.Array):
    host = np.asarray(x)
    return ('jax.Array', host.dtype.name, host.shape, host.tobytes(), x.sharding)
  if isinstance(x, np.ndarray):
    return ('ndarray', x.dtype.name, x.shape, x.tobytes())
  if isinstance(x, np.generic):
    return (type(x).__name__, x.tobytes())
  return (type(x).__name__, x)


def _assert_same(got: Any, want: Any, what: str) -> None:
  got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got, is_leaf=lambda x: x is None)
  want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want,
                                                               is_leaf=lambda x: x is None)
  assert got_def == want_def, f'{what}: tree {got_def} != {want_def}'
  for (path, g), (_, w) in zip(got_leaves, want_leaves):
    name = jax.tree_util.keystr(path)
    gv, wv = _leaf_view(g), _leaf_view(w)
    if gv[0] == 'jax.Array' and wv[0] == 'jax.Array':
      assert gv[:4] == wv[:4], f'{what}: leaf {name}: {gv[:3]} != {wv[:3]} or bytes differ'
      assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (
          f'{what}: leaf {name}: sharding {g.sharding} != {w.sharding}')
    else:
      assert gv == wv, f'{what}: leaf {name}: {gv!r:.200} != {wv!r:.200}'


def _check(api: str, spec: Any) -> None:
  mesh = _mesh()
  root = tempfile.mkdtemp(prefix='tree-props-')
  try:
    with jax.enable_x64(True):
      tree = _build(spec, mesh)
      ours, stock = os.path.join(root, 'ours'), os.path.join(root, 'stock')
      with ckpt.stock_orbax():
        stock_error = _save(api, stock, tree)
        want = _load(api, stock) if stock_error is None else None
      ours_error = _save(api, ours, tree)
      if stock_error is not None:
        if ours_error is None:  # accepted where stock refuses: what commits must restore
          _load(api, ours)
        return
      assert ours_error is None, f'stock saves this tree, the package raised {ours_error!r}'
      _assert_same(_load(api, ours), want, 'the package reading its own')
      _assert_same(_load(api, stock), want, 'the package reading stock\'s')
      with ckpt.stock_orbax():
        _assert_same(_load(api, ours), want, 'stock reading the package\'s')
  finally:
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize('api', ['v0', 'v1'])
@EXAMPLES
@given(spec=TREES)
@example(spec=BARE_SHARDED)
@example(spec=BARE_REPLICATED)
@example(spec=BARE_NUMPY)
@example(spec=('list', [BARE_SHARDED, ('int', 3), ('str', 'x')]))
@example(spec=('dict', {}))
@example(spec=MANY_LEAVES)
def test_a_tree_reads_back_as_stock_reads_stock(api, spec):
  _check(api, spec)
