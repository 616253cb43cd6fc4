"""Small builders shared by the tests: meshes, states and comparisons on 8 CPU devices."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mesh(shape=(4, 2), axes=('data', 'model'), devices=None) -> Mesh:
  devices = devices if devices is not None else jax.devices()[: int(np.prod(shape))]
  return Mesh(np.asarray(devices).reshape(shape), axes)


def put(value, m: Mesh, *spec) -> jax.Array:
  return jax.device_put(value, NamedSharding(m, P(*spec)))


def host(x):
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def assert_trees_equal(a, b):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb, f'tree structure differs: {ta} vs {tb}'
  for x, y in zip(la, lb):
    hx, hy = host(x), host(y)
    assert hx.dtype == hy.dtype, (hx.dtype, hy.dtype)
    assert hx.shape == hy.shape, (hx.shape, hy.shape)
    np.testing.assert_array_equal(hx, hy)


def run_python(code: str, *, env=None, timeout=180) -> subprocess.CompletedProcess:
  """Runs ``code`` in a fresh interpreter (8 CPU devices) and fails with its output on error."""
  full_env = dict(os.environ)
  full_env.update(env or {})
  proc = subprocess.run([sys.executable, '-c', textwrap.dedent(code)], env=full_env, cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, f'subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'
  return proc


def assert_stock_reads_same(dir_a, dir_b, step: int = 0) -> None:
  """Stock Orbax, in a fresh interpreter that never imports orbax_pathways, restores ``step``
  of both checkpoint directories to identical leaves."""
  run_python(f"""
      import numpy as np, orbax.checkpoint as ocp, sys, jax
      a = ocp.CheckpointManager({str(dir_a)!r}).restore({step})
      b = ocp.CheckpointManager({str(dir_b)!r}).restore({step})
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
      assert 'orbax_pathways' not in sys.modules
  """)


def random_state(m: Mesh, seed: int = 0) -> dict:
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


def save_with_options(directory, state, step: int = 0, **options) -> None:
  """Saves ``state`` with unchanged CheckpointManager code under ``Options(**options)``, then
  puts the default options back."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  orbax_pathways.install(orbax_pathways.Options(**options))
  try:
    with ocp.CheckpointManager(directory) as mngr:
      mngr.save(step, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()
  finally:
    orbax_pathways.install(orbax_pathways.Options.from_env())
