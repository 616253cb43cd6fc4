"""The ``orbax-pathways`` CLI's ``ls``, ``show`` and ``du`` and its user-facing errors, against real
CheckpointManager checkpoints (``tests/cli/conftest.py``), in-process."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from orbax_pathways.format import records as records_lib
from support import cli_steps as cs
from support.cli_steps import KERNEL, run, run_json


def _ls_root(built, tmp_path) -> pathlib.Path:
  root = cs.copy(built['stock'], tmp_path / 'root')
  tmp = cs.copy(root / '1', root / '3.orbax-checkpoint-tmp')  # interrupted save (rename mode)
  (tmp / 'commit_success.txt').unlink()
  corrupt = cs.copy(root / '1', root / '4')  # marked committed, metadata unreadable
  (corrupt / '_CHECKPOINT_METADATA').write_text('{"item_handlers": ')
  unmarked = cs.copy(root / '1', root / '5')  # final name, no marker (commit-file mode, unfinished)
  (unmarked / 'commit_success.txt').unlink()
  meta = json.loads((unmarked / '_CHECKPOINT_METADATA').read_text())
  meta['commit_timestamp_nsecs'] = None
  (unmarked / '_CHECKPOINT_METADATA').write_text(json.dumps(meta))
  (root / 'tensorboard').mkdir()  # not a step: ignored
  return root


def test_ls_states_json(built, tmp_path):
  code, doc = run_json('ls', _ls_root(built, tmp_path))
  assert code == 0
  by_name = {s['name']: s for s in doc['steps']}
  assert set(by_name) == {'1', '2', '3.orbax-checkpoint-tmp', '4', '5'}
  assert [s['name'] for s in doc['steps']] == ['1', '2', '3.orbax-checkpoint-tmp', '4', '5']
  assert {k: s['state'] for k, s in by_name.items()} == {
      '1': 'complete', '2': 'complete', '3.orbax-checkpoint-tmp': 'partial', '4': 'corrupt',
      '5': 'partial'}
  one = by_name['1']
  for key in ('step', 'name', 'path', 'state', 'problems', 'commit_time',
              'commit_timestamp_nsecs', 'bytes', 'arrays', 'slices', 'devices', 'items',
              'transports'):
    assert key in one
  assert one['step'] == 1 and one['arrays'] == 4 and one['items'] == ['default']
  assert one['bytes'] > 100 * 1024 and one['commit_time'].endswith('Z')
  assert one['slices'] is None and one['devices'] is None  # stock: our fields absent
  assert any('_CHECKPOINT_METADATA' in p for p in by_name['4']['problems'])


def test_ls_table_and_our_metadata(built, tmp_path):
  code, out, _ = run('ls', _ls_root(built, tmp_path))
  assert code == 0
  assert out.splitlines()[0].split() == ['STEP', 'STATE', 'COMMITTED', 'SIZE', 'ARRAYS', 'SLICES',
                                         'DEVICES', 'NAME']
  assert 'partial' in out and 'corrupt' in out and 'step 4:' in out
  code, doc = run_json('ls', built['ours'])
  s1 = doc['steps'][0]
  assert (s1['slices'], s1['devices']) == (1, len(jax.devices()))
  assert s1['transports'] == ['test-fixture']


def test_ls_damaged_msgpack_is_corrupt(built, tmp_path):
  root = cs.copy(built['ours'], tmp_path / 'r')
  next((root / '1' / 'default' / '_pathways').glob('*.msgpack')).write_bytes(b'\xc1garbage')
  _, doc = run_json('ls', root)
  assert doc['steps'][0]['state'] == 'corrupt'


def test_show_stock_json(built):
  code, doc = run_json('show', built['stock'] / '1')
  assert code == 0
  for key in ('path', 'step', 'name', 'state', 'commit_time', 'problems', 'items', 'totals'):
    assert key in doc
  (item,) = doc['items']
  assert item['name'] == 'default' and item['ocdbt'] and not item['zarr3']
  assert item['writer'] == 'stock orbax' and item['pathways_metadata'] is False
  leaves = {l['key']: l for l in item['leaves']}
  assert set(leaves) == {KERNEL, 'params.dense.bias', 'opt.mu', 'step'}
  k = leaves[KERNEL]
  assert (k['dtype'], k['shape'], k['bytes']) == ('float32', [256, 128], 256 * 128 * 4)
  mesh = cs.mesh()
  assert k['chunk_shape'] == [256 // mesh.shape['data'], 128 // mesh.shape['model']]
  assert k['sharding']['source'] == 'orbax'
  assert k['sharding']['axis_names'] == ['data', 'model']
  assert k['sharding']['spec'] == ['data', 'model'] and k['pathways'] is None
  assert leaves['params.dense.bias']['dtype'] == 'bfloat16'
  assert leaves['step']['value_type'] == 'scalar' and leaves['step']['shape'] == []
  assert doc['totals']['arrays'] == 4
  assert doc['totals']['bytes'] == 256 * 128 * 4 + 128 * 2 + 64 * 64 * 4 + 8


def test_show_manager_written(built):
  """What the installed library writes: our metadata when the core wrote it, stock otherwise."""
  step = built['ocdbt'] / '1'
  _, doc = run_json('show', step)
  (item,) = doc['items']
  if (step / 'default' / records_lib.DIRNAME).exists():
    assert item['pathways_metadata'] and item['transports'] and item['writer'] != 'stock orbax'
  else:
    assert item['writer'] == 'stock orbax'
  assert {l['key'] for l in item['leaves']} >= {KERNEL, 'opt.mu'}


def test_show_ours_and_step_flag(built):
  code, out, _ = run('show', built['ours'], '--step', '1')
  assert code == 0
  assert 'written by test-fixture (2 writer files)' in out
  assert "P('data', 'model') [pathways]" in out and KERNEL in out
  assert 'total: 4 arrays' in out
  _, doc = run_json('show', built['ours'] / '1')
  k = next(l for l in doc['items'][0]['leaves'] if l['key'] == KERNEL)
  assert k['sharding']['source'] == 'pathways' and k['sharding']['num_slices'] == 1
  assert k['pathways']['chunk_nbytes'] == 256 * 128 * 4


def test_show_stock_table(built, tmp_path):
  step = cs.copy(built['plain'] / '1', tmp_path / '1')
  cs.strip_ours(step)
  code, out, _ = run('show', step)
  assert code == 0
  assert 'stock orbax' in out and '[zarr v2]' in out
  assert "mesh(data=" in out and "P('data', 'model') [orbax]" in out


def test_show_single_checkpoint_and_a_very_long_key(tmp_path):
  """A v1 single checkpoint has no step number: say so, not 'step None'; a 300-character key
  gets its own line instead of padding every row to 300 columns."""
  long_key = 'k' * 300
  save = getattr(ocp.v1, 'save', None) or ocp.v1.save_pytree
  save(tmp_path / 'ckpt', {'w': np.ones((4, 4), np.float32), long_key: np.zeros(3, np.float32)})
  code, out, err = run('show', tmp_path / 'ckpt')
  assert code == 0, err
  head = out.splitlines()[0]
  assert 'step None' not in out and 'single checkpoint (no step number)' in head
  rows = [l for l in out.splitlines() if l.startswith('  ') and long_key not in l]
  assert any(l.split()[:2] == ['KEY', 'TYPE'] for l in rows)
  w = next(l for l in rows if l.split()[0] == 'w')
  assert len(w) < 120 and 'float32' in w and '(4, 4)' in w
  (alone,) = [l for l in out.splitlines() if long_key in l]
  assert alone.strip() == long_key  # the long key on its line, its row continues below it
  after = out.splitlines()[out.splitlines().index(alone) + 1]
  assert after.startswith('  ' + ' ' * len('KEY')) and len(after) < 120
  assert after.split()[1:3] == ['float32', '(3,)'], after
  assert run_json('show', tmp_path / 'ckpt')[1]['step'] is None
  code, out, _ = run('verify', tmp_path / 'ckpt')
  # Orbax v1's numpy leaves carry our checksums (its numpy handler is ours): every value checked
  assert code == 0 and 'step None' not in out and 'single checkpoint' in out
  assert out.splitlines()[-1].startswith('OK: 2 arrays'), out


def test_json_fatal_errors_print_a_json_error(built, tmp_path):
  """With --json, a fatal error still leaves a JSON document on stdout (and its one stderr line)."""
  (tmp_path / 'empty').mkdir()
  cases = [
      (('show', tmp_path / 'missing'), 'does not exist'),
      (('show', built['stock'], '--step', '9'), 'step 9 not found'),
      (('verify', built['stock'] / '9'), 'steps in'),
      (('ls', tmp_path / 'missing'), 'does not exist'),
      (('du', tmp_path / 'empty'), 'not an Orbax checkpoint directory'),
      (('diff', built['stock'] / '1', tmp_path / 'missing'), 'does not exist'),
  ]
  for argv, text in cases:
    code, out, err = run(*argv, '--json')
    assert code == 2, argv
    assert out, f'stdout empty for {argv}; stderr: {err}'
    doc = json.loads(out)
    assert doc['command'] == argv[0] and doc['exit_code'] == 2 and text in doc['error'], doc
    assert err.count('\n') == 1 and text in err and 'Traceback' not in err


def test_du(built):
  code, doc = run_json('du', built['ours'])
  assert code == 0
  assert set(doc) == {'path', 'bytes', 'steps'}
  s1, s2 = doc['steps']
  assert set(s1) == {'step', 'name', 'state', 'bytes', 'items'}
  assert doc['bytes'] == s1['bytes'] + s2['bytes']
  keys1 = {k['key']: k for k in s1['items'][0]['keys']}
  assert keys1['params'] == {'key': 'params', 'bytes': 256 * 128 * 4 + 128 * 2, 'basis': 'chunks'}
  assert keys1['step']['basis'] == 'logical'
  keys2 = {k['key']: k for k in s2['items'][0]['keys']}
  assert keys2['params'] == {'key': 'params', 'bytes': (256 * 128 + 128 + 64) * 4,
                             'basis': 'logical'}
  code, out, _ = run('du', built['stock'] / '1')
  assert code == 0 and 'default/params  (logical)' in out and 'total on disk' in out


def test_user_errors(built, tmp_path):
  (tmp_path / 'empty').mkdir()
  cases = [
      (('ls', tmp_path / 'empty'), 'not an Orbax checkpoint directory'),
      (('ls', tmp_path / 'missing'), 'does not exist'),
      (('ls', built['stock'] / '1'), 'single checkpoint step'),
      (('show', built['stock']), 'pass one step'),
      (('show', built['stock'], '--step', '9'), 'step 9 not found'),
      (('verify', built['stock'] / '9'), 'steps in'),
      (('du', tmp_path / 'empty'), 'not an Orbax checkpoint directory'),
      (('diff', built['stock'] / '1', tmp_path / 'missing'), 'does not exist'),
  ]
  for argv, text in cases:
    code, out, err = run(*argv)
    assert code == 2, argv
    assert out == '' and err.count('\n') == 1 and text in err, (argv, err)
    assert 'Traceback' not in err
  assert run('--help')[0] == 0
  assert run('frobnicate')[0] == 2


def test_du_and_show_accept_an_uncommitted_step(built, tmp_path):
  root = tmp_path / 'root'
  four = cs.copy(built['stock'] / '1', root / '4')  # final name, killed before any step metadata
  (four / 'commit_success.txt').unlink()
  (four / '_CHECKPOINT_METADATA').unlink()
  tmp = cs.copy(four, root / '5.orbax-checkpoint-tmp')
  for step in (four, tmp):
    code, doc = run_json('du', step)
    assert code == 0, step
    (s,) = doc['steps']
    assert s['state'] == 'partial' and s['bytes'] > 100 * 1024
    assert {k['key'] for k in s['items'][0]['keys']} == {'params', 'opt', 'step'}
    assert run_json('show', step)[0] == 0
  code, doc = run_json('du', root)
  assert code == 0 and [s['name'] for s in doc['steps']] == ['4', '5.orbax-checkpoint-tmp']
  runs = cs.copy(root, tmp_path / 'runs' / '7')  # a root that is named like a step
  code, doc = run_json('du', runs)
  assert code == 0 and [s['name'] for s in doc['steps']] == ['4', '5.orbax-checkpoint-tmp']
  code, _, err = run('show', runs)
  assert code == 2 and 'pass one step' in err


def test_empty_path_is_an_error(built):
  for argv in (('ls', ''), ('show', ''), ('verify', ''), ('du', ''), ('ls', ' '),
               ('diff', '', built['stock'] / '1')):
    code, out, err = run(*argv)
    assert code == 2 and out == '', argv
    assert err.startswith('orbax-pathways: error: empty path') and err.count('\n') == 1, err


def test_damaged_json_names_the_file_and_what_to_do(built, tmp_path):
  root = cs.copy(built['stock'], tmp_path / 'root')
  meta = root / '1' / 'default' / '_METADATA'
  meta.write_bytes(b'\x00\xffgarbage{')
  code, out, err = run('show', root / '1')
  assert code == 0 and 'Traceback' not in err
  line = next(l for l in out.splitlines() if l.startswith('! '))
  assert f'{meta} is damaged (not valid JSON' in line
  assert 'Orbax cannot restore this item' in line and 'Restore another step' in line
  code, doc = run_json('verify', root / '1')
  assert code == 1 and any(str(meta) in p['error'] for p in doc['problems'])
  code, out, err = run('diff', root / '1', root / '2')
  assert code == 2 and out == '' and err.count('\n') == 1
  assert f'cannot compare {root / "1"}: {meta} is damaged' in err
  ckpt = root / '2' / '_CHECKPOINT_METADATA'
  ckpt.write_text('{"item_handlers": ')
  code, out, _ = run('ls', root)
  assert code == 0
  assert f'step 2: {ckpt} is damaged (not valid JSON' in out and 'commit time' in out

