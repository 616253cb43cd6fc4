"""Meshes, sharded states and tree comparisons on the test process's 8 virtual CPU devices.

The one set of builders the tests share (imports jax): ``mesh`` / ``put`` build arrays,
``random_state`` is the suite's standard train-state-like tree, ``abstract`` its restore target;
``assert_trees_equal`` / ``assert_bit_identical`` compare what a user would compare after a
restore (tree, dtypes, shapes, bytes; shardings for the latter).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def mesh(shape=(4, 2), axes=('data', 'model'), devices=None) -> Mesh:
  """A mesh of ``shape`` over the first devices (or over ``devices``), row-major by device id."""
  devices = devices if devices is not None else jax.devices()[: int(np.prod(shape))]
  return Mesh(np.asarray(devices).reshape(shape), axes)


def put(value, m: Mesh, *spec) -> jax.Array:
  """``value`` placed on ``m`` with ``PartitionSpec(*spec)`` (no spec: replicated)."""
  return jax.device_put(value, NamedSharding(m, P(*spec)))


def random_state(m: Mesh, seed: int = 0) -> dict:
  """A small train state on a (data, model) mesh: sharded, partly replicated and replicated
  float32 / bfloat16 arrays plus a Python int."""
  rng = np.random.default_rng(seed)
  return {
      'params': {
          'w': put(rng.standard_normal((64, 32), dtype=np.float32), m, 'data', 'model'),
          'b': put(rng.standard_normal((32,)).astype(jnp.bfloat16), m, None),
          'e': put(rng.standard_normal((16, 8), dtype=np.float32), m, None, 'model'),
      },
      'opt': {'mu': put(rng.standard_normal((64, 32), dtype=np.float32), m, 'data', None)},
      'step': 7,
  }


def host_leaf_state(seed: int = 0, *, with_numpy_scalar: bool = False) -> dict:
  """A training state as MaxText keeps one after ``jax.device_get`` of part of it: one
  jax.Array, numpy leaves (data loader, RNG state) and scalars (a Python int and float; with
  ``with_numpy_scalar``, a numpy float64, which Orbax v1 saves as a float)."""
  rng = np.random.default_rng(seed)
  state = {
      'w': put(rng.standard_normal((64, 32), dtype=np.float32), mesh(), 'data', 'model'),
      'loader': rng.standard_normal((128, 16), dtype=np.float32),
      'rng': np.arange(4, dtype=np.uint32) + 1000,
      'step': 7,
      'lr': 0.25,
  }
  if with_numpy_scalar:
    state['ema'] = np.float64(0.5)
  return state


def abstract(tree):
  """Restore target of ``tree``: each jax.Array as a ShapeDtypeStruct with its sharding, every
  other leaf as it is."""
  def leaf(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x
  return jax.tree.map(leaf, tree)


def host(x):
  """``x`` as a numpy array (PRNG keys as their key data)."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def assert_trees_equal(a, b):
  """Same tree structure; every leaf the same dtype, shape and values."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb, f'tree structure differs: {ta} vs {tb}'
  for x, y in zip(la, lb):
    hx, hy = host(x), host(y)
    assert hx.dtype == hy.dtype, (hx.dtype, hy.dtype)
    assert hx.shape == hy.shape, (hx.shape, hy.shape)
    np.testing.assert_array_equal(hx, hy)


def assert_bit_identical(restored, expected, *, same_sharding=True):
  """``assert_trees_equal``, and every jax.Array leaf byte for byte the same (PRNG keys: same
  implementation and key data), on an equivalent sharding unless ``same_sharding`` is False."""
  assert_trees_equal(restored, expected)
  for (kp, r), e in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(expected)):
    name = jax.tree_util.keystr(kp)
    if isinstance(e, jax.Array):
      if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
        assert jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key), name
        assert jax.random.key_impl(r) == jax.random.key_impl(e), name
        r, e = jax.random.key_data(r), jax.random.key_data(e)
      else:
        assert r.dtype == e.dtype, name
      assert np.asarray(r).tobytes() == np.asarray(e).tobytes(), name
      if same_sharding:
        assert r.sharding.is_equivalent_to(e.sharding, e.ndim), name
