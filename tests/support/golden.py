"""Golden checkpoints written by STOCK orbax-checkpoint (see tests/golden/README.md).

``tests/golden/<variant>/`` is a CheckpointManager directory holding one step (``GOLDEN_STEP``)
with a single StandardSave item (``default``) of the state described by ``LEAVES``.
``tests/golden/expected.npz`` holds the values.

Flat key scheme (used by ``expected.npz``, ``expected_state()`` and ``flatten()``): the
pytree path joined with ``'/'``, e.g. ``'params/dense/kernel'``. Every tree level is a dict with
string keys, so the mapping is one-to-one. In the npz, every value is stored as a numpy array;
bfloat16 is not a native npz dtype, so bfloat16 leaves are stored as float32 (all golden values
are exactly representable) and ``expected_state()`` casts them back from ``LEAVES``' dtype.

Read by the format tests and the CLI tests in the pytest process, by a fresh stock-Orbax
interpreter that restores our checkpoints (``test_format_compat``), and by
``tests/golden/generate.py``. This module must not import orbax_pathways (the goldens are a
stock-orbax reference).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

GOLDEN_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'golden')
EXPECTED_NPZ = os.path.join(GOLDEN_ROOT, 'expected.npz')
GOLDEN_STEP = 3
ITEM = 'default'  # CheckpointManager's item name for a single StandardSave
NUM_DEVICES = 8  # generation ran on 8 forced host CPU devices, device ids 0..7
MESH_SHAPE = (4, 2)
MESH_AXES = ('data', 'model')

# (use_ocdbt, use_zarr3) per variant directory name.
VARIANT_OPTIONS = {
    'ocdbt1_zarr3_0': (True, False),  # stock default
    'ocdbt1_zarr3_1': (True, True),
    'ocdbt0_zarr3_0': (False, False),
    'ocdbt0_zarr3_1': (False, True),
}
VARIANTS = tuple(VARIANT_OPTIONS)
# The item handler that wrote each variant (recorded in <step>/_CHECKPOINT_METADATA). Stock
# StandardCheckpointHandler has no use_zarr3 option in 0.12.8, so the zarr3 variants were
# written with PyTreeCheckpointHandler(use_zarr3=True) + ocp.args.PyTreeSave. The item
# directory layout is the same either way (StandardCheckpointHandler wraps
# PyTreeCheckpointHandler), and StandardRestore reads all four variants.
VARIANT_HANDLER = {
    v: ('PyTreeCheckpointHandler' if zarr3 else 'StandardCheckpointHandler')
    for v, (_, zarr3) in VARIANT_OPTIONS.items()
}


@dataclasses.dataclass(frozen=True)
class Leaf:
  key: str  # flat key, '/'-separated path
  kind: str  # 'jax' (jax.Array), 'numpy' (np.ndarray), 'int' / 'float' (Python scalar)
  dtype: str  # numpy dtype name ('bfloat16' via ml_dtypes)
  shape: tuple[int, ...]
  spec: tuple | None = None  # PartitionSpec entries for 'jax' leaves on the (data, model) mesh


LEAVES: tuple[Leaf, ...] = (
    # 8 distinct shards (4,4), one per device.
    Leaf('params/dense/kernel', 'jax', 'float32', (16, 8), ('data', 'model')),
    # Sharded on 'data', replicated over 'model' (partly replicated).
    Leaf('params/dense/bias', 'jax', 'bfloat16', (8, 4), ('data', None)),
    # Fully replicated.
    Leaf('params/embed/table', 'jax', 'int32', (5,), ()),
    Leaf('params/norm/scale', 'jax', 'float16', (4, 6), (None, 'model')),
    Leaf('buffers/mask', 'jax', 'bool', (8, 2), ('data', None)),
    Leaf('buffers/bytes', 'jax', 'uint8', (8, 4), ('data', 'model')),
    Leaf('buffers/small_ints', 'jax', 'int8', (6,), ()),
    Leaf('buffers/scalar', 'jax', 'float32', (), ()),  # 0-d jax array
    Leaf('host/np_f32', 'numpy', 'float32', (3, 4)),
    Leaf('host/np_i64', 'numpy', 'int64', (5,)),
    Leaf('meta/step', 'int', 'int64', ()),
    Leaf('meta/learning_rate', 'float', 'float64', ()),
)
LEAF_BY_KEY = {leaf.key: leaf for leaf in LEAVES}


def golden_dir(variant: str) -> str:
  """The CheckpointManager directory of ``variant`` (pass to ``ocp.CheckpointManager``)."""
  if variant not in VARIANT_OPTIONS:
    raise ValueError(f'unknown golden variant {variant!r}; known: {VARIANTS}')
  return os.path.join(GOLDEN_ROOT, variant)


def step_dir(variant: str) -> str:
  return os.path.join(golden_dir(variant), str(GOLDEN_STEP))


def _np_dtype(name: str) -> np.dtype:
  if name == 'bfloat16':
    import ml_dtypes  # pylint: disable=g-import-not-at-top

    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


def make_value(leaf: Leaf) -> Any:
  """The deterministic value of a leaf (used by generate.py; tests should use expected.npz)."""
  n = int(np.prod(leaf.shape, dtype=np.int64))
  i = np.arange(n, dtype=np.int64)
  if leaf.kind == 'int':
    return 3
  if leaf.kind == 'float':
    return 0.125
  if leaf.dtype == 'bool':
    v = (i % 3) == 0
  elif leaf.dtype == 'uint8':
    v = (i * 7 + 200) % 256  # crosses 127/255
  elif leaf.dtype == 'int8':
    v = i * 37 - 100  # spans negative and positive, within [-128, 127]
  elif leaf.dtype == 'int32':
    v = i * 1000 - 2
  elif leaf.dtype == 'int64':
    v = i + 2**40  # needs more than 32 bits
  elif leaf.key == 'buffers/scalar':
    v = np.array(-2.75)
  else:  # float32 / float16 / bfloat16: quarters, exact in every one of them
    v = (i - n // 2) * 0.25
  return np.asarray(v).astype(_np_dtype(leaf.dtype)).reshape(leaf.shape)


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
  tree: dict[str, Any] = {}
  for key, value in flat.items():
    node = tree
    *parents, last = key.split('/')
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = value
  return tree


def flatten(tree: dict[str, Any], prefix: str = '') -> dict[str, Any]:
  out: dict[str, Any] = {}
  for k, v in tree.items():
    key = f'{prefix}{k}'
    if isinstance(v, dict):
      out.update(flatten(v, key + '/'))
    else:
      out[key] = v
  return out


def expected_state() -> dict[str, Any]:
  """Flat dict ``key -> value`` read from expected.npz.

  Arrays come back as numpy arrays with the saved dtype (bfloat16 restored from the float32
  npz copy; 0-d arrays as 0-d ndarrays); ``'int'``/``'float'`` leaves as Python int/float.
  Compare a restored tree with ``flatten(restored)``.
  """
  with np.load(EXPECTED_NPZ, allow_pickle=False) as z:
    stored = {k: z[k] for k in z.files}
  if set(stored) != set(LEAF_BY_KEY):
    raise AssertionError(f'expected.npz keys {sorted(stored)} != LEAVES {sorted(LEAF_BY_KEY)}')
  out: dict[str, Any] = {}
  for leaf in LEAVES:
    v = stored[leaf.key]
    if leaf.kind == 'int':
      out[leaf.key] = int(v)
    elif leaf.kind == 'float':
      out[leaf.key] = float(v)
    else:
      out[leaf.key] = v.astype(_np_dtype(leaf.dtype))
  return out


def npz_payload(flat: dict[str, Any]) -> dict[str, np.ndarray]:
  """How generate.py turns a flat state into expected.npz entries (bfloat16 -> float32)."""
  out = {}
  for key, v in flat.items():
    a = np.asarray(v)
    if a.dtype == _np_dtype('bfloat16'):
      a = a.astype(np.float32)
    out[key] = a
  return out


def abstract_target(mesh) -> dict[str, Any]:
  """Nested restore target for ``ocp.args.StandardRestore`` on ``mesh``.

  ``mesh`` must have axis names ``'data'`` and ``'model'`` (any sizes dividing the sharded
  dims: 'data' | 8, 'model' | 2 — e.g. (4, 2), (2, 2), (1, 1), (8, 1) ...). jax leaves become
  ``jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))``; numpy leaves
  a zero ``np.ndarray`` of the right shape/dtype (restored as host numpy); Python scalars ``0`` /
  ``0.0``.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  flat: dict[str, Any] = {}
  for leaf in LEAVES:
    if leaf.kind == 'jax':
      flat[leaf.key] = jax.ShapeDtypeStruct(
          leaf.shape, _np_dtype(leaf.dtype),
          sharding=NamedSharding(mesh, PartitionSpec(*leaf.spec)))
    elif leaf.kind == 'numpy':
      flat[leaf.key] = np.zeros(leaf.shape, _np_dtype(leaf.dtype))
    elif leaf.kind == 'int':
      flat[leaf.key] = 0
    else:
      flat[leaf.key] = 0.0
  return unflatten(flat)
