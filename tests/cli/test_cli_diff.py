"""The ``orbax-pathways diff`` command against real CheckpointManager checkpoints
(``tests/cli/conftest.py``): by recorded checksum, by value across chunk grids, and what it
says when nothing can be compared."""

from __future__ import annotations

import numpy as np
import pytest

from orbax_pathways.storage import meta_io
from support import cli_steps as cs
from support.cli_steps import KERNEL, run, run_json


def test_diff(built):
  a, b = built['stock'] / '1', built['stock'] / '2'
  code, doc = run_json('diff', a, b)
  assert code == 1 and not doc['identical']
  for key in ('a', 'b', 'values_compared', 'identical', 'added', 'removed', 'changed',
              'unchanged'):
    assert key in doc
  assert [e['key'] for e in doc['added']] == ['params.dense.scale']
  assert [e['key'] for e in doc['removed']] == ['step']
  changed = {e['key']: e for e in doc['changed']}
  assert set(changed) == {'params.dense.bias', 'opt.mu'}
  assert changed['params.dense.bias']['changes']['dtype'] == ['bfloat16', 'float32']
  assert 'sharding' in changed['opt.mu']['changes']
  code, doc = run_json('diff', a, b, '--values')
  changed = {e['key']: e for e in doc['changed']}
  assert changed[KERNEL]['max_abs_diff'] == pytest.approx(0.5)
  assert changed['params.dense.bias']['max_abs_diff'] == 0.0
  assert changed['opt.mu']['max_abs_diff'] == 0.0
  code, out, _ = run('diff', a, b)
  assert '+ default/params.dense.scale' in out and '- default/step' in out
  assert '~ default/params.dense.bias  dtype: bfloat16 -> float32' in out


def test_diff_identical(built):
  code, doc = run_json('diff', built['stock'] / '1', built['ours'] / '1', '--values')
  assert code == 0 and doc['identical'] and doc['unchanged'] == 4


def test_diff_training_steps_compares_values_by_checksum(saved, tmp_path):
  """Steps of one run have the same tree: diff must say whether values changed, from the
  recorded crc32c alone (the chunk files are deleted here, so nothing can have been read)."""
  root = cs.copy(saved['train'], tmp_path / 'train')
  deleted = 0
  for step in ('10', '20', '30'):
    for f in (root / step / 'default').rglob('*'):
      if f.parent.name in ('params.kernel', 'params.bias', 'step') and f.name[0] != '.':
        f.unlink()  # a chunk file (zarr v2: '0.1'); '.zarray' stays
        deleted += 1
  assert deleted >= 3 * 3
  same = cs.copy(root / '10', tmp_path / 'copy' / '10')
  code, out, _ = run('diff', root / '10', same)
  assert code == 0, out
  assert out.splitlines()[-2:] == [
      'compared: tree, value types, dtypes, shapes, shardings; values of 3 arrays by recorded '
      'crc32c (no data read)', 'identical']
  code, out, _ = run('diff', root / '10', root / '20')  # only the step counter changed
  assert code == 1
  assert out.splitlines()[2:] == [
      '~ default/step  values differ (recorded crc32c of 1 of 1 chunks)',
      'compared: tree, value types, dtypes, shapes, shardings; values of 3 arrays by recorded '
      'crc32c (no data read)', '0 added, 0 removed, 1 changed, 2 unchanged']
  code, out, _ = run('diff', root / '10', root / '30')
  assert code == 1
  rows = 256 // cs.mesh().shape['data']
  n_chunks = (256 // rows) * cs.mesh().shape['model']
  assert (f'~ default/params.kernel  values differ (recorded crc32c of {cs.mesh().shape["model"]} '
          f'of {n_chunks} chunks)') in out
  assert out.splitlines()[-1] == '0 added, 0 removed, 2 changed, 1 unchanged'
  _, doc = run_json('diff', root / '10', root / '30')
  changed = {e['key']: e for e in doc['changed']}
  assert set(changed) == {'params.kernel', 'step'}
  assert changed['params.kernel']['changes'] == {'values': 'differ'}
  assert changed['params.kernel']['values_basis'] == 'crc32c'
  assert doc['compared']['values_by_crc32c'] == 3 and doc['compared']['values_not_compared'] == []
  code, doc = run_json('diff', root / '10', root / '30', '--values')  # the data is gone
  assert code == 1 and 'unreadable' in doc['changed'][0]['changes']['values']


def test_diff_without_checksums_says_values_were_not_compared(built):
  code, out, _ = run('diff', built['stock'] / '1', built['ours'] / '1')
  assert code == 0
  assert 'values of 0 arrays by recorded crc32c' in out
  assert 'values not compared (4): default/opt.mu' in out and '--values reads them' in out
  assert out.splitlines()[-1] == 'no differences found; values of 4 leaves not compared'
  _, doc = run_json('diff', built['stock'] / '1', built['ours'] / '1')
  assert doc['identical'] and len(doc['compared']['values_not_compared']) == 4


def test_diff_of_steps_on_different_chunk_grids_compares_values(tmp_path):
  """Saved with another chunk size (or on another mesh) the recorded checksums cannot be
  compared chunk by chunk: the values are read and compared instead of "not compared"."""
  kernel = np.arange(256 * 128, dtype=np.float32).reshape(256, 128)
  a = cs.save_grid(tmp_path / 'a', 1, kernel)
  b = cs.save_grid(tmp_path / 'b', 1, kernel, max_chunk_bytes=4096)
  changed = kernel.copy()
  changed[200, 100] += 1
  c = cs.save_grid(tmp_path / 'c', 1, changed, max_chunk_bytes=4096)
  chunks = lambda step: meta_io.read_item(step / 'default').arrays()['kernel'].chunk_shape
  assert chunks(a) != chunks(b)
  code, out, _ = run('diff', a, b)
  assert code == 0, out
  assert 'no orbax-pathways checksums' not in out and out.splitlines()[-1] == 'identical'
  assert ('values of 1 array by recorded crc32c, of 1 read and compared (their chunk grids '
          'differ: default/kernel)') in out
  code, doc = run_json('diff', a, c)
  assert code == 1 and doc['compared']['values_read'] == ['default/kernel']
  assert doc['compared']['values_not_compared'] == []
  (entry,) = doc['changed']
  assert entry['key'] == 'kernel' and entry['values_basis'] == 'read'
  assert entry['max_abs_diff'] == 1.0

