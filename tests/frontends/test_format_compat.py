"""Checkpoints stay in Orbax's own format: stock reads ours, we read stock (goldens), same tree."""

import os
import re
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from support import ckpt
from support import golden
from support import procs
from support.arrays import mesh
from support.workers import stock_reads_golden_worker

VARIANTS = [pytest.param(v, id=v) for v in golden.VARIANTS]


def _handler(use_ocdbt: bool, use_zarr3: bool):
  return ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)


@pytest.mark.parametrize('variant', VARIANTS)
def test_we_restore_stock_golden_checkpoints(tmp_path, variant):
  src = golden.golden_dir(variant)
  shutil.copytree(src, tmp_path / 'ckpt')  # never touch the committed goldens
  m = mesh(golden.MESH_SHAPE, golden.MESH_AXES)
  expected = golden.expected_state()
  with ocp.CheckpointManager(tmp_path / 'ckpt') as mngr:
    assert mngr.all_steps() == [golden.GOLDEN_STEP]
    restored = mngr.restore(golden.GOLDEN_STEP,
                            args=ocp.args.StandardRestore(golden.abstract_target(m)))
    rst = orbax_pathways.stats.last_restore()
    no_target = mngr.restore(golden.GOLDEN_STEP)
  assert rst is not None and rst.arrays == sum(1 for leaf in golden.LEAVES if leaf.kind == 'jax')
  assert rst.chunks_verified == 0  # stock checkpoints carry no checksums; decode only
  for key, value in golden.flatten(restored).items():
    np.testing.assert_array_equal(np.asarray(value), np.asarray(expected[key]), err_msg=key)
    assert np.asarray(value).dtype == np.asarray(expected[key]).dtype, key
  for key, value in golden.flatten(no_target).items():
    np.testing.assert_array_equal(np.asarray(value), np.asarray(expected[key]), err_msg=key)


def _save_ours(directory, use_ocdbt, use_zarr3):
  m = mesh(golden.MESH_SHAPE, golden.MESH_AXES)
  expected = golden.expected_state()
  state = golden.unflatten({
      k: (jax.device_put(v, _sharding_of(k, m))
          if golden.LEAF_BY_KEY[k].kind == 'jax' else v)
      for k, v in expected.items()})
  with ocp.CheckpointManager(directory, item_handlers=_handler(use_ocdbt, use_zarr3)) as mngr:
    mngr.save(golden.GOLDEN_STEP, args=ocp.args.PyTreeSave(state))
    mngr.wait_until_finished()
  return state


def _sharding_of(key, m):
  flat = golden.flatten(golden.abstract_target(m))
  return flat[key].sharding


@pytest.mark.parametrize('variant', VARIANTS)
def test_stock_orbax_restores_our_checkpoints(tmp_path, variant):
  use_ocdbt, use_zarr3 = golden.VARIANT_OPTIONS[variant]
  _save_ours(tmp_path, use_ocdbt, use_zarr3)
  assert (tmp_path / str(golden.GOLDEN_STEP) / 'default' / '_pathways' / 'p0.msgpack').exists()
  # A fresh interpreter that never imports orbax_pathways.
  procs.run_worker(stock_reads_golden_worker, tmp_path, use_ocdbt, use_zarr3)


def _normalized_tree(root):
  out = set()
  for dirpath, dirnames, filenames in os.walk(root):
    rel = os.path.relpath(dirpath, root)
    if '_pathways' in rel.split(os.sep):
      continue
    for f in filenames:
      if re.fullmatch(r'[0-9a-f]{32}', f):
        f = '<data>'
      if re.fullmatch(r'\d+(\.\d+)*', f) or rel.split(os.sep)[-1] == 'c' or '/c/' in rel:
        f = '<chunk>'
      out.add(os.path.join(re.sub(r'/c(/\d+)*$', '/c', rel), f))
  return out


@pytest.mark.parametrize('variant', VARIANTS)
def test_on_disk_tree_matches_stock(tmp_path, variant):
  use_ocdbt, use_zarr3 = golden.VARIANT_OPTIONS[variant]
  _save_ours(tmp_path / 'ours', use_ocdbt, use_zarr3)
  with ckpt.stock_orbax():
    _save_ours(tmp_path / 'stock', use_ocdbt, use_zarr3)
  ours, stock = _normalized_tree(tmp_path / 'ours'), _normalized_tree(tmp_path / 'stock')
  assert ours == stock, (sorted(ours - stock), sorted(stock - ours))
  added = sorted(os.listdir(tmp_path / 'ours' / str(golden.GOLDEN_STEP) / 'default' / '_pathways'))
  # numpy.<id>, scalar.<id>: the np.ndarray and Python scalar leaves (written by process 0)
  assert [f.split('.')[0] for f in added] == ['index', 'numpy', 'p0', 'scalar'], added
