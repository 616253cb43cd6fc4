"""The CLI tests' checkpoints, written once per session and copied by each test that changes
them (``built``: stock-looking and our steps, OCDBT and plain; ``saved``: manager-written
steps with the library installed)."""

from __future__ import annotations

import pathlib

import orbax.checkpoint as ocp
import pytest

from orbax_pathways.format import records as records_lib
from support import ckpt
from support import cli_steps as cs


@pytest.fixture(scope='session')
def built(tmp_path_factory) -> dict[str, pathlib.Path]:
  base = tmp_path_factory.mktemp('cli')
  ocdbt = cs.save(base / 'ocdbt', [1, 2])
  plain = cs.save(base / 'plain', [1], handler=ocp.StandardCheckpointHandler(use_ocdbt=False))
  stock = cs.copy(ocdbt, base / 'stock')
  for s in stock.iterdir():
    cs.strip_ours(s)
  ours = cs.copy(stock, base / 'ours')
  cs.with_our_metadata(ours / '1')
  plain_ours = cs.with_our_metadata(cs.copy(plain / '1', base / 'plain_ours' / '1')).parent
  return {'ocdbt': ocdbt, 'plain': plain, 'stock': stock, 'ours': ours,
          'plain_ours': plain_ours, 'base': base}


@pytest.fixture(scope='session')
def saved(tmp_path_factory) -> dict[str, pathlib.Path]:
  """Manager-written steps with the library installed: a training run without OCDBT (chunk
  files we can delete), a two-item step, and a colocated-transport step."""
  base = tmp_path_factory.mktemp('run')
  mesh = cs.mesh()
  with ckpt.options(coalesce_bytes=0):
    with ocp.CheckpointManager(base / 'train', item_handlers=ocp.StandardCheckpointHandler(
        use_ocdbt=False)) as mngr:
      for s in (10, 20, 30):
        mngr.save(s, args=ocp.args.StandardSave(cs.train_state(mesh, s)))
      mngr.wait_until_finished()
    with ocp.CheckpointManager(base / 'two_items') as mngr:
      mngr.save(1, args=ocp.args.Composite(
          model=ocp.args.StandardSave(cs.train_state(mesh, 1)),
          ema=ocp.args.StandardSave(cs.train_state(mesh, 1))))
      mngr.wait_until_finished()
  with ckpt.options(transport='colocated'):
    ckpt.save(base / 'colocated', cs.train_state(mesh, 1), step=1)
  with ocp.CheckpointManager(base / 'host', item_handlers=ocp.PyTreeCheckpointHandler(
      use_compression=False)) as mngr:  # uncompressed: a flipped byte still decodes
    mngr.save(1, args=ocp.args.PyTreeSave(cs.host_state(mesh)))
    mngr.wait_until_finished()
  for step in (base / 'train' / '10', base / 'two_items' / '1', base / 'colocated' / '1',
               base / 'host' / '1'):
    assert list(step.glob('*/' + records_lib.DIRNAME)), f'{step}: the library wrote no records'
  return {'train': base / 'train', 'two_items': base / 'two_items',
          'colocated': base / 'colocated', 'host': base / 'host'}

