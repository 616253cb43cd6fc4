"""Writes the golden checkpoints with STOCK orbax-checkpoint (no orbax_pathways import).

    cd /work/main && .venv/bin/python tests/golden/generate.py

Deletes and rewrites tests/golden/<variant>/ for every variant in support.golden.VARIANTS, and
tests/golden/expected.npz. Runs on 8 forced host CPU devices in one process.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

# Must be in place before jax is imported.
_flags = re.sub(r'--xla_force_host_platform_device_count=\S*', '',
                os.environ.get('XLA_FLAGS', '')).strip()
os.environ['XLA_FLAGS'] = f'{_flags} --xla_force_host_platform_device_count=8'.strip()
os.environ['JAX_PLATFORMS'] = 'cpu'

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

from support import golden as gl  # pylint: disable=g-import-not-at-top
from support.arrays import mesh as make_mesh  # pylint: disable=g-import-not-at-top

assert 'orbax_pathways' not in sys.modules, 'goldens must be written by stock orbax only'


def build_state(mesh):
  flat = {}
  for leaf in gl.LEAVES:
    value = gl.make_value(leaf)
    if leaf.kind == 'jax':
      sharding = NamedSharding(mesh, PartitionSpec(*leaf.spec))
      flat[leaf.key] = jax.make_array_from_callback(
          leaf.shape, sharding, lambda idx, v=value: v[idx])
    else:
      flat[leaf.key] = value
  return flat


def main():
  assert jax.device_count() == gl.NUM_DEVICES, jax.devices()
  mesh = make_mesh(gl.MESH_SHAPE, gl.MESH_AXES)
  flat = build_state(mesh)
  state = gl.unflatten(flat)
  for variant, (use_ocdbt, use_zarr3) in gl.VARIANT_OPTIONS.items():
    d = gl.golden_dir(variant)
    shutil.rmtree(d, ignore_errors=True)
    if use_zarr3:
      # StandardCheckpointHandler (0.12.8) has no use_zarr3 option; stock users get Zarr v3
      # through PyTreeCheckpointHandler(use_zarr3=True) + PyTreeSave.
      handler = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt, use_zarr3=True)
      save_args = ocp.args.PyTreeSave(state)
    else:
      handler = ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt)
      save_args = ocp.args.StandardSave(state)
    assert type(handler).__name__ == gl.VARIANT_HANDLER[variant]
    with ocp.CheckpointManager(d, item_handlers=handler) as mngr:
      mngr.save(gl.GOLDEN_STEP, args=save_args)
      mngr.wait_until_finished()
    # Self-check: a fresh default stock manager, StandardRestore with the abstract target.
    with ocp.CheckpointManager(d) as mngr:
      assert mngr.all_steps() == [gl.GOLDEN_STEP], mngr.all_steps()
      restored = gl.flatten(mngr.restore(
          gl.GOLDEN_STEP, args=ocp.args.StandardRestore(gl.abstract_target(mesh))))
    for key, want in flat.items():
      got = restored[key]
      assert type(got) is type(want) or isinstance(got, jax.Array), (key, type(got), type(want))
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=key)
      assert np.asarray(got).dtype == np.asarray(want).dtype, (key, np.asarray(got).dtype)
    print(f'wrote {d}')
  np.savez(gl.EXPECTED_NPZ, **gl.npz_payload(flat))
  exp = gl.expected_state()
  for key, want in flat.items():
    np.testing.assert_array_equal(np.asarray(exp[key]), np.asarray(want), err_msg=key)
    assert np.asarray(exp[key]).dtype == np.asarray(want).dtype, key
  print(f'wrote {gl.EXPECTED_NPZ}; orbax-checkpoint {ocp.__version__}, jax {jax.__version__}')


if __name__ == '__main__':
  main()
