"""A node step restored from this node's own files (``fleet/step_files.py``): node steps are
Orbax checkpoints without OCDBT, a file per chunk in row bands, and the restore maps each chunk
file into the restored array's buffer in place of reading and copying it. One process, 8 CPU
devices, a real v0 ``CheckpointManager``, a real tier directory."""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways import preemption
from orbax_pathways import stats
from support import damage
from support.arrays import mesh

ROWS, COLS = 4096, 1024  # 16 MiB of float32: two shards of 8 MiB, each one chunk of its own


def _state(step: int, m) -> dict:
  sharding = jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec('data'))
  w = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + step
  return {'w': jax.device_put(w, sharding),
          'i': jax.device_put(np.arange(4096, dtype=np.int32) - step, sharding)}


def _abstract(m) -> dict:
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(0, m))


def _mapping_at(address: int) -> str | None:
  """The file mapped at ``address`` in this process (``/proc/self/maps``), or None."""
  with open('/proc/self/maps', encoding='utf-8') as f:
    for line in f:
      fields = line.split(None, 5)
      start, end = (int(x, 16) for x in fields[0].split('-'))
      if start <= address < end:
        return fields[5].strip() if len(fields) == 6 else None
  return None


@pytest.fixture
def saved(tmp_path, caplog):
  """Storage step 0 and node steps 1-3 (the node keeps 2 and 3) of a process of 2 devices."""
  root, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), local_save_interval_steps=1,
                                                tier_keep=2, local_steps_in='nodes'))
  m = mesh((2,), ('data',), devices=jax.devices()[:2])
  caplog.set_level(logging.WARNING)
  with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(
      save_interval_steps=10)) as mngr:
    for step in range(4):
      mngr.save(step, args=ocp.args.StandardSave(_state(step, m)))
    mngr.wait_until_finished()
  # Orbax's warning that a save had no OCDBT trees to merge is not said about node steps.
  assert not [r for r in caplog.records if 'Skipping merge' in r.getMessage()]
  (node,) = (tier / '.node-steps').iterdir()
  yield root, node, m
  orbax_pathways.install(orbax_pathways.Options())


def test_node_steps_are_chunk_files_in_row_bands(saved):
  """Node step 3 on the node: Orbax's format without OCDBT, the float array uncompressed in
  one chunk file per shard (row bands), each the shard's raw bytes; the int array compressed,
  as the package stores integers."""
  _, node, _ = saved
  item = node / '3' / 'default'
  assert not (item / 'manifest.ocdbt').exists()
  meta = json.loads((item / 'w' / '.zarray').read_text())
  assert meta['compressor'] is None and meta['chunks'] == [ROWS // 2, COLS], meta
  chunks = sorted(p.name for p in damage.node_data_files(item / 'w'))
  assert chunks == ['0.0', '1.0'], chunks
  raw = np.frombuffer((item / 'w' / '1.0').read_bytes(), np.float32).reshape(ROWS // 2, COLS)
  np.testing.assert_array_equal(raw, np.asarray(_state(3, saved[2])['w'])[ROWS // 2:])
  assert json.loads((item / 'i' / '.zarray').read_text())['compressor'] is not None


def test_a_node_step_restore_maps_the_nodes_chunk_files(saved):
  """``preemption.resume`` restores node step 3 with the values saved, every byte from the
  node, and each shard of the restored float array lies in its chunk file's pages, mapped
  (no copy of it in this process); the compressed int array is read through tensorstore, checked as before."""
  root, node, m = saved
  with ocp.CheckpointManager(root) as mngr:
    step, got = preemption.resume(mngr, lambda: None, abstract_state=_abstract(m))
  assert step == 3
  for k, want in _state(3, m).items():
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want))
  assert stats.last_restore().bytes_by_source == {'node': (ROWS * COLS + 4096) * 4}
  for shard in got['w'].addressable_shards:  # each shard's buffer is its chunk file's pages
    chunk = node / '3' / 'default' / 'w' / f'{shard.index[0].start // (ROWS // 2)}.0'
    assert _mapping_at(shard.data.unsafe_buffer_pointer()) == str(chunk), shard.index


def test_a_flipped_byte_in_a_mapped_chunk_fails_the_step_and_resume_goes_back(saved, caplog):
  """A bit of node step 3's second chunk flipped: the mapped chunk fails its checksum, so does
  tensorstore's read of the same file, the step is passed over, and the resume restores node
  step 2, exact."""
  root, node, m = saved
  damage.flip_middle_bit([node / '3' / 'default' / 'w' / '1.0'])
  with ocp.CheckpointManager(root) as mngr:
    step, got = preemption.resume(mngr, lambda: None, abstract_state=_abstract(m))
  assert step == 2
  for k, want in _state(2, m).items():
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want))
  assert any('node step 3 cannot be restored' in r.getMessage() for r in caplog.records)


def test_stock_orbax_reads_a_node_step(saved):
  """Orbax's own PyTree handler and ArrayHandler (not the package's) restore node step 3 from
  the node with the shardings it was saved with: a node step is Orbax's format."""
  _, node, m = saved
  abstract = _abstract(m)
  registry = ocp.type_handlers.create_type_handler_registry(
      (jax.Array, ocp.type_handlers.ArrayHandler()))
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry)) as ckptr:
    got = ckptr.restore(node / '3' / 'default', args=ocp.args.PyTreeRestore(
        abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)))
  for k, want in _state(3, m).items():
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want))
