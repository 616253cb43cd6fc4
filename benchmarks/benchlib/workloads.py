"""The meshes and the states the benchmark saves and restores (see benchmarks/README.md).

Built once per process by ``bench.py`` (and again by each RSS subprocess, from the same seed):

- ``meshes``: ``('data', 'model')`` mesh over all devices, ``(n/2, 2)`` (cpu/gcs: ``(4, 2)`` over
  8 CPU devices), and the half mesh over ``devices[:n/2]`` for the restore onto fewer slices.
- ``build_state``: ``size_gb`` logical bytes as 9 big 2-D arrays (76 % 8-way sharded, 20 % partly
  replicated, 4 % fully replicated), 16 small leaves of 1-64 KiB and a Python int.
- ``tiny_state``: 10 float32 arrays of 1 KiB, for the fixed cost of a save / restore.
"""

from __future__ import annotations

from benchlib import MiB, GiB

# (name, fraction of the logical bytes, dtype, PartitionSpec)
#   8-way sharded P('data', 'model'), partly replicated P('data', None) (2 copies over 'model'),
#   fully replicated P() (one copy per device).
LAYOUT = (
    ('params.layer0.w', 0.16, 'float32', ('data', 'model')),
    ('params.layer1.w', 0.16, 'float32', ('data', 'model')),
    ('params.layer2.w', 0.16, 'float32', ('data', 'model')),
    ('params.embed', 0.14, 'bfloat16', ('data', 'model')),
    ('params.unembed', 0.14, 'bfloat16', ('data', 'model')),
    ('opt.mu.layer0', 0.10, 'float32', ('data', None)),
    ('opt.mu.embed', 0.10, 'bfloat16', ('data', None)),
    ('params.pos_table', 0.02, 'float32', (None, None)),
    ('params.ln_table', 0.02, 'bfloat16', (None, None)),
)  # fractions sum to 1
N_SMALL = 16  # small leaves, 1-64 KiB, mixed layouts
COLS = 4096


def meshes(mode: str):
  """(full mesh, half mesh or None). cpu/gcs: (4,2) over 8 CPU devices, (2,2) over devices[:4]."""
  del mode  # the same rule for every mode: jax.devices() is what set_platform_env made it
  import jax
  import numpy as np
  from jax.sharding import Mesh
  devs = jax.devices()
  n = len(devs)
  if n >= 2 and n % 2 == 0:
    full = Mesh(np.asarray(devs).reshape(n // 2, 2), ('data', 'model'))
  else:
    full = Mesh(np.asarray(devs).reshape(n, 1), ('data', 'model'))
  half = None
  if n >= 4 and n % 4 == 0:
    half = Mesh(np.asarray(devs[: n // 2]).reshape(n // 4, 2), ('data', 'model'))
  elif n == 2:
    half = Mesh(np.asarray(devs[:1]).reshape(1, 1), ('data', 'model'))
  return full, half


def _fill(rng, n: int, dtype):
  """n random N(0,1)-distributed values: a 16 MiB pool of fresh normals per array, rotated by a
  random offset and scaled by a random factor per block (4x faster than fresh normals, and
  bitwise different in every block so chunk compression sees realistic float data)."""
  import numpy as np
  pool_n = min(n, 4 * MiB)
  pool = rng.standard_normal(pool_n, dtype=np.float32)
  out = np.empty(n, dtype=dtype)
  for i in range(0, n, pool_n):
    j = min(n, i + pool_n)
    blk = np.roll(pool, int(rng.integers(pool_n)))[: j - i]
    blk *= np.float32(rng.uniform(0.02, 2.0))
    out[i:j] = blk.astype(dtype, copy=False)
  return out


def build_state(mesh, size_gb: float, seed: int = 0):
  """The benchmark state: a nested dict of jax.Arrays (+ one python int)."""
  import jax
  import ml_dtypes
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  dtypes = {'float32': np.float32, 'bfloat16': ml_dtypes.bfloat16}
  total = size_gb * GiB
  rows_mult = 8 * int(np.prod(mesh.devices.shape))
  state: dict = {}

  def put(path, value):
    d = state
    parts = path.split('.')
    for p in parts[:-1]:
      d = d.setdefault(p, {})
    d[parts[-1]] = value

  for k, (name, frac, dt, spec) in enumerate(LAYOUT):
    dtype = dtypes[dt]
    itemsize = np.dtype(dtype).itemsize
    rows = max(rows_mult, round(total * frac / (COLS * itemsize) / rows_mult) * rows_mult)
    host = _fill(np.random.default_rng([seed, k]), rows * COLS, dtype).reshape(rows, COLS)
    put(name, jax.device_put(host, NamedSharding(mesh, P(*spec))))
    del host
  rng = np.random.default_rng([seed, 999])
  specs = [('data', 'model'), ('data', None), (None, 'model'), (None, None)]
  for i in range(N_SMALL):
    nbytes = int(2 ** rng.integers(10, 17))  # 1 KiB .. 64 KiB
    dtype = dtypes['float32' if i % 2 == 0 else 'bfloat16']
    n = nbytes // np.dtype(dtype).itemsize
    shape = (64, n // 64)
    put(f'small.s{i:02d}', jax.device_put(_fill(rng, n, dtype).reshape(shape),
                                          NamedSharding(mesh, P(*specs[i % 4]))))
  state['step'] = 7
  jax.block_until_ready(state)
  return state


def abstract_state(mesh, size_gb: float, seed: int = 0):
  """``build_state``'s tree as ShapeDtypeStructs (with their shardings on ``mesh``), built
  without its values: what a restarted job restores into, with no memory of its own touched."""
  import jax
  import ml_dtypes
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  dtypes = {'float32': np.float32, 'bfloat16': ml_dtypes.bfloat16}
  total = size_gb * GiB
  rows_mult = 8 * int(np.prod(mesh.devices.shape))
  state: dict = {}

  def put(path, value):
    d = state
    parts = path.split('.')
    for p in parts[:-1]:
      d = d.setdefault(p, {})
    d[parts[-1]] = value

  for name, frac, dt, spec in LAYOUT:
    dtype = dtypes[dt]
    itemsize = np.dtype(dtype).itemsize
    rows = max(rows_mult, round(total * frac / (COLS * itemsize) / rows_mult) * rows_mult)
    put(name, jax.ShapeDtypeStruct((rows, COLS), dtype, sharding=NamedSharding(mesh, P(*spec))))
  rng = np.random.default_rng([seed, 999])
  specs = [('data', 'model'), ('data', None), (None, 'model'), (None, None)]
  for i in range(N_SMALL):
    nbytes = int(2 ** rng.integers(10, 17))  # as build_state draws them
    dtype = dtypes['float32' if i % 2 == 0 else 'bfloat16']
    n = nbytes // np.dtype(dtype).itemsize
    _fill(rng, n, dtype)  # the same draws as build_state, so the next leaf's size matches
    put(f'small.s{i:02d}', jax.ShapeDtypeStruct((64, n // 64), dtype,
                                                sharding=NamedSharding(mesh, P(*specs[i % 4]))))
  state['step'] = 7
  return state


def tiny_state(mesh, seed: int = 0):
  """10 float32 arrays of 1 KiB (256 elements), 8-way sharded."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  n = int(np.prod(mesh.devices.shape))
  spec = P(('data', 'model')) if 256 % n == 0 else P()
  rng = np.random.default_rng([seed, 7])
  return {f't{i}': jax.device_put(rng.standard_normal(256, dtype=np.float32),
                                  NamedSharding(mesh, spec)) for i in range(10)}


def jax_leaves(tree):
  import jax
  return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def logical_bytes(tree) -> int:
  """Unique bytes: each array counted once, however many devices hold it."""
  return sum(x.nbytes for x in jax_leaves(tree))


def device_bytes(tree) -> int:
  """Every addressable shard's bytes: replicas count once per device (on CPU: host RAM)."""
  return sum(s.data.nbytes for x in jax_leaves(tree) for s in x.addressable_shards)


def abstract(tree, mesh=None):
  """ShapeDtypeStructs with the same PartitionSpecs, on `mesh` (default: the arrays' own)."""
  import jax
  from jax.sharding import NamedSharding

  def f(x):
    if not isinstance(x, jax.Array):
      return x
    sh = x.sharding if mesh is None else NamedSharding(mesh, x.sharding.spec)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
  return jax.tree.map(f, tree)
