"""The ``orbax-pathways`` inspection CLI against real CheckpointManager checkpoints.

Checkpoints are written by ``ocp.CheckpointManager`` on 8 forced CPU devices. Once the core is
installed (``import orbax_pathways``), those saves carry our ``_pathways`` metadata; tests that
need a stock checkpoint strip it, and ``_with_our_metadata`` writes our metadata itself (crc32c
computed here from the in-memory arrays) so the checksum path is exercised either way.
Most tests call ``main(argv)`` in-process; a few run ``python -m orbax_pathways``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import io
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import urllib.parse

import google_crc32c
import jax
from jax.sharding import Mesh
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from orbax_pathways.format import records as records_lib
from orbax_pathways.cli import steps as cli_steps
from orbax_pathways.cli import main as cli_main
from orbax_pathways.storage import meta_io
from support import ckpt
from support import damage
from support import golden
from support import procs
from support.workers import bare_import_worker, cli_no_backend_worker, console_script_worker
from support.arrays import mesh as make_mesh
from support.arrays import put

KERNEL = 'params.dense.kernel'


# ----------------------------------------------------------------------------------------------
# Helpers.


def run(*argv) -> tuple[int, str, str]:
  """In-process CLI: (exit code, stdout, stderr)."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli_main.main([str(a) for a in argv])
  return code, out.getvalue(), err.getvalue()


def run_json(*argv) -> tuple[int, dict]:
  code, out, err = run(*argv, '--json')
  assert out, f'no JSON on stdout (exit {code}); stderr: {err}'
  return code, json.loads(out)


def run_subprocess(*argv, env=None, timeout=120) -> subprocess.CompletedProcess:
  """``python -m orbax_pathways argv...`` with ``env`` (a whole environment, e.g.
  ``_hermetic_env()``) as the child's base, no device-count flag."""
  return procs.run_cli(*argv, base=env, devices=None, timeout=timeout)


def _mesh() -> Mesh:
  return make_mesh((2, 4))


def _state(mesh: Mesh, step: int):
  """A train-state-like tree; step 2 changes values, a dtype, a sharding, adds and drops keys."""
  rng = np.random.default_rng(0)
  kernel = rng.standard_normal((256, 128), dtype=np.float32)  # 16 KiB chunks: out-of-line in OCDBT
  bias = (np.arange(128) / 4).astype(ml_dtypes.bfloat16)
  mu = np.zeros((64, 64), np.float32)
  if step == 1:
    tree = {'params': {'dense': {'kernel': put(kernel, mesh, 'data', 'model'),
                                 'bias': put(bias, mesh)}},
            'opt': {'mu': put(mu, mesh, 'data', None)}, 'step': 7}
  else:
    tree = {'params': {'dense': {'kernel': put(kernel + 0.5, mesh, 'data', 'model'),
                                 'bias': put(bias.astype(np.float32), mesh),
                                 'scale': put(np.ones(64, np.float32), mesh)}},
            'opt': {'mu': put(mu, mesh, None, 'model')}}
  return tree


def _save(root: pathlib.Path, steps, handler=None) -> pathlib.Path:
  """Saves with one chunk per shard (coalescing off), the grid stock Orbax writes, so the
  stripped copies below are laid out exactly like stock checkpoints."""
  mesh = _mesh()
  with ckpt.options(coalesce_bytes=0), ocp.CheckpointManager(root, item_handlers=handler) as mngr:
    for s in steps:
      mngr.save(s, args=ocp.args.StandardSave(_state(mesh, s)))
    mngr.wait_until_finished()
  return root


def _strip_ours(step_dir: pathlib.Path) -> None:
  for d in step_dir.glob('*/' + records_lib.DIRNAME):
    shutil.rmtree(d)


def _sharding_record(s) -> records_lib.ShardingRecord:
  mesh = s.mesh
  return records_lib.ShardingRecord(
      kind='named', mesh_shape=tuple(mesh.devices.shape), axis_names=tuple(mesh.axis_names),
      device_ids=tuple(int(d.id) for d in mesh.devices.flat),
      device_slices=(0,) * mesh.devices.size, spec=tuple(s.spec), num_slices=1,
  )


def _with_our_metadata(step_dir: pathlib.Path) -> pathlib.Path:
  """Replaces ``_pathways`` with two writer files whose crc32c are computed here from the arrays
  that were saved (not read back), split chunk by chunk between the writers."""
  _strip_ours(step_dir)
  tree = _state(_mesh(), int(step_dir.name))
  arrays = {KERNEL: tree['params']['dense']['kernel'],
            'params.dense.bias': tree['params']['dense']['bias'], 'opt.mu': tree['opt']['mu']}
  leaves = {l.key: l for l in cli_steps.read_step(step_dir, open_arrays=True).items[0].leaves}
  per_writer = ([], [])
  for name, arr in arrays.items():
    value, chunk = np.asarray(arr), leaves[name].chunk_shape
    chunks = ([], [])
    grid = itertools.product(*[range(0, n, c) for n, c in zip(value.shape, chunk)])
    for i, origin in enumerate(grid):
      region = np.ascontiguousarray(value[tuple(slice(o, o + c) for o, c in zip(origin, chunk))])
      chunks[i % 2].append(
          records_lib.ChunkRecord(origin, google_crc32c.value(region.tobytes()), region.nbytes))
    for w in (0, 1):
      per_writer[w].append(records_lib.ArrayRecord(
          name=name, dtype=str(value.dtype), shape=value.shape, chunk_shape=chunk,
          chunks=tuple(chunks[w]), sharding=_sharding_record(arr.sharding) if w == 0 else None))
  for w in (0, 1):
    meta_io.write_record(step_dir / 'default', records_lib.WriterRecord(
        writer=f'process_{w}', transport='test-fixture', arrays=tuple(per_writer[w]),
        library_version='test'))
  return step_dir


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
  shutil.copytree(src, dst)
  return dst


def _largest_data_file(item: pathlib.Path) -> pathlib.Path:
  """The OCDBT data file (``.../d/<hash>``) that holds the big kernel chunks."""
  files = [p for p in item.rglob('*') if p.is_file() and p.parent.name == 'd']
  return max(files, key=lambda p: p.stat().st_size)


def _flip(path: pathlib.Path, offset: int | None = None) -> None:
  data = bytearray(path.read_bytes())
  i = len(data) // 2 if offset is None else offset
  data[i] ^= 0xFF
  path.write_bytes(bytes(data))


def _truncate(path: pathlib.Path) -> None:
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _kinds(report: dict) -> set[str]:
  return {p['kind'] for p in report['problems']}


def _bad_arrays(report: dict) -> set[str]:
  return {p['array'] for p in report['problems']}


# ----------------------------------------------------------------------------------------------
# Fixtures: written once per module, copied per test.


@pytest.fixture(scope='module')
def built(tmp_path_factory) -> dict[str, pathlib.Path]:
  base = tmp_path_factory.mktemp('cli')
  ocdbt = _save(base / 'ocdbt', [1, 2])
  plain = _save(base / 'plain', [1], handler=ocp.StandardCheckpointHandler(use_ocdbt=False))
  stock = _copy(ocdbt, base / 'stock')
  for s in stock.iterdir():
    _strip_ours(s)
  ours = _copy(stock, base / 'ours')
  _with_our_metadata(ours / '1')
  plain_ours = _with_our_metadata(_copy(plain / '1', base / 'plain_ours' / '1')).parent
  return {'ocdbt': ocdbt, 'plain': plain, 'stock': stock, 'ours': ours,
          'plain_ours': plain_ours, 'base': base}


# ----------------------------------------------------------------------------------------------
# ls


def _ls_root(built, tmp_path) -> pathlib.Path:
  root = _copy(built['stock'], tmp_path / 'root')
  tmp = _copy(root / '1', root / '3.orbax-checkpoint-tmp')  # interrupted save (rename mode)
  (tmp / 'commit_success.txt').unlink()
  corrupt = _copy(root / '1', root / '4')  # marked committed, metadata unreadable
  (corrupt / '_CHECKPOINT_METADATA').write_text('{"item_handlers": ')
  unmarked = _copy(root / '1', root / '5')  # final name, no marker (commit-file mode, unfinished)
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
  root = _copy(built['ours'], tmp_path / 'r')
  next((root / '1' / 'default' / '_pathways').glob('*.msgpack')).write_bytes(b'\xc1garbage')
  _, doc = run_json('ls', root)
  assert doc['steps'][0]['state'] == 'corrupt'


# ----------------------------------------------------------------------------------------------
# show


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
  mesh = _mesh()
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
  step = _copy(built['plain'] / '1', tmp_path / '1')
  _strip_ours(step)
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


# ----------------------------------------------------------------------------------------------
# verify


def test_verify_clean_stock_and_ours(built):
  # Stock Orbax: intact, but nothing could be checked by checksum: not "OK", exit 3.
  code, doc = run_json('verify', built['stock'] / '1')
  assert code == 3 and not doc['ok'] and doc['verdict'] == 'unchecked'
  assert doc['modes'] == {'default': 'decode'} and doc['problems'] == []
  for key in ('path', 'step', 'state', 'ok', 'verdict', 'modes', 'arrays', 'chunks',
              'chunks_checksummed', 'bytes_read', 'seconds', 'problems', 'unchecked'):
    assert key in doc
  assert doc['arrays'] == 4 and doc['bytes_read'] == 256 * 128 * 4 + 128 * 2 + 64 * 64 * 4 + 8
  assert sorted(u['key'] for u in doc['unchecked']) == [
      'opt.mu', 'params.dense.bias', KERNEL, 'step']
  assert {u['reason'] for u in doc['unchecked']} == {
      'no orbax-pathways checksums (written by stock Orbax)'}
  code, out, _ = run('verify', built['stock'] / '1')
  assert code == 3 and out.splitlines()[-1].startswith(
      'UNCHECKED: no damage found, but 4 values without a checksum (decoded only); 4 arrays')
  assert f'unchecked      default {KERNEL}: no orbax-pathways checksums' in out
  # Ours (records written by the fixture for the arrays only): the Python int 'step' has no
  # checksum, as when Orbax's own handler saved it; the verdict says so.
  code, doc = run_json('verify', built['ours'] / '1')
  assert code == 3 and doc['modes'] == {'default': 'checksum'} and doc['problems'] == []
  assert not doc['ok'] and doc['verdict'] == 'unchecked'
  assert doc['chunks_checksummed'] == doc['chunks'] - 1  # all but the scalar 'step'
  assert doc['unchecked'] == [{'item': 'default', 'key': 'step', 'reason': (
      "scalar leaf saved by Orbax's own handler (Orbax v1, or an orbax-pathways version that "
      'did not record numpy and scalar leaves)')}]
  code, out, _ = run('verify', built['ours'] / '1')
  assert out.splitlines()[-1].startswith('UNCHECKED: no damage found, but 1 value without')
  code, doc = run_json('verify', built['plain_ours'] / '1')
  assert code == 3 and doc['chunks_checksummed'] == doc['chunks'] - 1, doc['problems']


def test_verify_a_host_leaf_record_lost_beside_other_host_records_is_a_problem(saved, tmp_path):
  """Host leaves recorded (a numpy record exists) but one scalar's record is gone: restore
  raises MissingChecksumError, so verify fails it too."""
  step = _copy(saved['host'] / '1', tmp_path / '1')
  assert run_json('verify', step)[0] == 0
  pw = step / 'default' / records_lib.DIRNAME
  (pw / 'index.msgpack').unlink()
  (scalar,) = pw.glob('scalar.*.msgpack')
  scalar.unlink()
  code, doc = run_json('verify', step)
  assert code == 1 and _kinds(doc) == {'missing_record'} and _bad_arrays(doc) == {'count', 'lr'}


def test_verify_manager_written(built):
  """Whatever the installed library wrote verifies clean (checksums when the core wrote them)."""
  step = built['ocdbt'] / '1'
  code, doc = run_json('verify', step)
  assert code == 0, doc['problems']
  if (step / 'default' / records_lib.DIRNAME).exists():
    assert doc['modes'] == {'default': 'checksum'} and doc['chunks_checksummed'] > 0


def test_verify_flipped_byte_ocdbt(built, tmp_path):
  step = _copy(built['ours'] / '1', tmp_path / '1')
  _flip(_largest_data_file(step / 'default'))
  code, doc = run_json('verify', step)
  assert code == 1 and not doc['ok']
  assert _kinds(doc) & {'crc_mismatch', 'read_error'} and KERNEL in _bad_arrays(doc)
  bad = next(p for p in doc['problems'] if p['array'] == KERNEL)
  assert bad['origin'] is not None and 'ocdbt key params.dense.kernel/' in bad['path']
  if bad['kind'] == 'crc_mismatch':
    assert bad['expected_crc32c'] != bad['found_crc32c']


def test_verify_flipped_byte_plain(built, tmp_path):
  step = _copy(built['plain_ours'] / '1', tmp_path / '1')
  chunk_file = step / 'default' / KERNEL / '0.0'
  _flip(chunk_file)
  code, out, _ = run('verify', step)
  assert code == 1 and 'FAILED' in out
  assert f'{KERNEL} chunk (0, 0)' in out and str(chunk_file) in out
  _, doc = run_json('verify', step)
  (bad,) = doc['problems']
  assert bad['kind'] in ('crc_mismatch', 'read_error') and bad['origin'] == [0, 0]
  assert bad['path'] == str(chunk_file)


def test_verify_truncated_files(built, tmp_path):
  step = _copy(built['plain'] / '1', tmp_path / 'plain')
  _strip_ours(step)
  _truncate(step / 'default' / KERNEL / '1.0')
  code, doc = run_json('verify', step)
  assert code == 1 and _kinds(doc) == {'read_error'}
  (bad,) = doc['problems']
  assert bad['origin'] == [256 // _mesh().shape['data'], 0] and bad['path'].endswith('/1.0')
  step = _copy(built['ours'] / '1', tmp_path / 'ocdbt')
  _truncate(_largest_data_file(step / 'default'))
  code, doc = run_json('verify', step)
  assert code == 1 and KERNEL in _bad_arrays(doc)


def test_verify_deleted_chunk_files(built, tmp_path):
  step = _copy(built['plain'] / '1', tmp_path / 'plain')  # stock: decode-only still catches it
  _strip_ours(step)
  (step / 'default' / KERNEL / '0.1').unlink()
  code, doc = run_json('verify', step)
  assert code == 1
  (bad,) = doc['problems']
  assert (bad['kind'], bad['array'], bad['origin']) == (
      'read_error', KERNEL, [0, 128 // _mesh().shape['model']])
  assert 'missing' in bad['error'] or 'NOT_FOUND' in bad['error']
  step = _copy(built['stock'] / '1', tmp_path / 'ocdbt')
  _largest_data_file(step / 'default').unlink()
  code, doc = run_json('verify', step)
  assert code == 1 and KERNEL in _bad_arrays(doc)


def test_verify_damaged_metadata(built, tmp_path):
  step = _copy(built['ours'] / '1', tmp_path / 'msgpack')
  damaged = step / 'default' / '_pathways' / 'process_1.msgpack'
  damaged.write_bytes(damaged.read_bytes()[:20])
  code, doc = run_json('verify', step)
  assert code == 1 and 'metadata' in _kinds(doc)
  assert any(str(damaged) in (p['error'] or '') for p in doc['problems'])

  step = _copy(built['ours'] / '1', tmp_path / 'writer_missing')
  (step / 'default' / '_pathways' / 'process_1.msgpack').unlink()
  code, doc = run_json('verify', step)
  assert code == 1 and _kinds(doc) == {'missing_record'}

  step = _copy(built['stock'] / '1', tmp_path / 'orbax_meta')
  (step / 'default' / '_METADATA').write_text('{"tree_metadata": {')
  code, doc = run_json('verify', step)
  assert code == 1 and 'metadata' in _kinds(doc)

  step = _copy(built['plain'] / '1', tmp_path / 'zarray')
  (step / 'default' / KERNEL / '.zarray').write_text('not json')
  code, doc = run_json('verify', step)
  assert code == 1 and 'open_error' in _kinds(doc) and KERNEL in _bad_arrays(doc)


def test_verify_partial_step_fails(built, tmp_path):
  step = _copy(built['stock'] / '1', tmp_path / '1.orbax-checkpoint-tmp')
  code, doc = run_json('verify', step)
  assert code == 1 and _kinds(doc) == {'not_committed'}


def test_verify_progress_bar(built):
  code, _, err = run('verify', built['ours'] / '1', '--progress')
  assert code == 3 and 'verify [' in err and '/s' in err and 'chunks' in err


# ----------------------------------------------------------------------------------------------
# diff and du


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


# ----------------------------------------------------------------------------------------------
# Errors


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


def _hermetic_env(**extra) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith(('GOOGLE_', 'STORAGE_EMU'))}
  env.update({'NO_GCE_CHECK': 'true', 'GCE_METADATA_HOST': '127.0.0.1:1',
              'GCE_METADATA_IP': '127.0.0.1:1', 'GCE_METADATA_ROOT': '127.0.0.1:1',
              'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': ''}, **extra)
  return env


def test_subprocess_and_gcs_without_credentials(built):
  with tempfile.TemporaryDirectory() as gcloud:
    proc = run_subprocess('ls', 'gs://no-such-bucket-for-tests/ckpt',
                          env=_hermetic_env(CLOUDSDK_CONFIG=gcloud), timeout=60)
  assert proc.returncode == 2, proc.stderr
  assert 'credentials' in proc.stderr and 'Traceback' not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith('orbax-pathways: error:')
  proc = run_subprocess('verify', built['ours'] / '1', '--json', env=_hermetic_env())
  assert proc.returncode == 3, proc.stderr  # intact; the scalar 'step' has no checksum
  assert json.loads(proc.stdout)['problems'] == []


def test_cli_never_initializes_a_backend(built):
  proc = procs.run_worker(cli_no_backend_worker, built['ours'] / '1', base=_hermetic_env(),
                          devices=None, unset=('JAX_PLATFORMS',), timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr


def test_cli_modules_import_no_jax():
  """Every module the CLI imports is jax-free: imported with the package's ``__init__`` skipped
  (it installs the handler, see the next test), nothing loads jax or Orbax."""
  proc = procs.run_worker(bare_import_worker, 'orbax_pathways.cli.main', 'jax,jaxlib,orbax',
                          timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr


def test_the_console_script_loads_no_jax(built):
  """``orbax-pathways`` enters through ``orbax_pathways_cli``, which imports the package without
  installing the handler: jax and Orbax never load (a plain ``import orbax_pathways`` installs,
  which needs both)."""
  proc = procs.run_worker(console_script_worker, built['stock'], base=_hermetic_env(),
                          devices=None, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr
  assert 'complete' in proc.stdout


def test_console_script(built):
  script = pathlib.Path(sys.executable).parent / 'orbax-pathways'
  if not script.exists():
    pytest.skip('console script not installed (pip install -e .)')
  proc = procs.run([script, 'ls', built['stock'], '--json'], base=_hermetic_env(), devices=None,
                   timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr
  assert [s['step'] for s in json.loads(proc.stdout)['steps']] == [1, 2]


# ----------------------------------------------------------------------------------------------
# Golden stock checkpoints (tests/golden, written by stock orbax-checkpoint).


@pytest.mark.parametrize('variant', golden.VARIANTS)
def test_golden(variant):
  ocdbt, zarr3 = golden.VARIANT_OPTIONS[variant]
  code, doc = run_json('show', golden.step_dir(variant))
  assert code == 0 and doc['state'] == 'complete'
  (item,) = doc['items']
  assert (item['ocdbt'], item['zarr3'], item['writer']) == (ocdbt, zarr3, 'stock orbax')
  leaves = {l['key']: l for l in item['leaves']}
  assert set(leaves) == {l.key.replace('/', '.') for l in golden.LEAVES}
  for gl in golden.LEAVES:
    got = leaves[gl.key.replace('/', '.')]
    assert got['dtype'] == gl.dtype and tuple(got['shape']) == gl.shape, gl.key
    if gl.kind == 'jax':
      assert got['sharding']['mesh_shape'] == list(golden.MESH_SHAPE)
      assert tuple(got['sharding']['spec']) == tuple(gl.spec) or gl.spec == ()
  code, doc = run_json('verify', golden.step_dir(variant))  # stock: decoded, not checksummed
  assert code == 3 and doc['verdict'] == 'unchecked' and doc['problems'] == []
  assert doc['arrays'] == len(golden.LEAVES) == len(doc['unchecked'])


# ----------------------------------------------------------------------------------------------
# gs:// through fake-gcs-server (the session's server, tests/support/gcs_fixtures.py).


def _upload_tree(gcs, bucket: str, local: pathlib.Path, prefix: str) -> None:
  for p in sorted(local.rglob('*')):
    if p.is_file():
      name = urllib.parse.quote(f'{prefix}/{p.relative_to(local).as_posix()}', safe='')
      conn = http.client.HTTPConnection(gcs.host, gcs.port, timeout=10)
      conn.request('POST', f'/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}',
                   body=p.read_bytes(), headers={'Content-Type': 'application/octet-stream'})
      assert conn.getresponse().status == 200
      conn.close()


@pytest.mark.gcs
def test_gcs_ls_show_verify(built, fake_gcs):
  bucket = fake_gcs.new_bucket('cli')
  _upload_tree(fake_gcs, bucket, built['ours'], 'ckpt')
  env = {k: v for k, v in os.environ.items() if k not in fake_gcs.unset_keys()}
  env.update(fake_gcs.env(), JAX_PLATFORMS='cpu', XLA_FLAGS='')
  root = f'gs://{bucket}/ckpt'
  proc = run_subprocess('ls', root, '--json', env=env)
  assert proc.returncode == 0, proc.stderr
  steps = json.loads(proc.stdout)['steps']
  assert [(s['step'], s['state']) for s in steps] == [(1, 'complete'), (2, 'complete')]
  assert steps[0]['devices'] == len(jax.devices()) and steps[0]['bytes'] > 0
  proc = run_subprocess('show', f'{root}/1', '--json', env=env)
  assert proc.returncode == 0, proc.stderr
  item = json.loads(proc.stdout)['items'][0]
  assert item['transports'] == ['test-fixture'] and item['ocdbt']
  proc = run_subprocess('verify', f'{root}/1', '--json', env=env)
  assert proc.returncode == 3, proc.stderr  # the scalar 'step' has no checksum
  report = json.loads(proc.stdout)
  assert report['problems'] == [] and report['chunks_checksummed'] > 0
  assert [u['key'] for u in report['unchecked']] == ['step']


# ----------------------------------------------------------------------------------------------
# Records lost, uncommitted steps, empty paths, damaged JSON, diff across a training run.


def _train_state(mesh: Mesh, step: int):
  """Every leaf a jax.Array (as in a real train state), so every value carries checksums. Step 30
  changes the kernel's first row block; otherwise only the step counter changes."""
  kernel = np.arange(256 * 128, dtype=np.float32).reshape(256, 128)
  if step >= 30:
    kernel = kernel.copy()
    kernel[:8] += 1.0
  return {'params': {'kernel': put(kernel, mesh, 'data', 'model'),
                     'bias': put(np.ones(128, np.float32), mesh)},
          'step': put(np.int32(step), mesh)}


def _host_state(mesh: Mesh):
  """A state after ``jax.device_get`` of part of it: numpy and scalar leaves beside an array."""
  return {'params': {'kernel': put(np.arange(64 * 64, dtype=np.float32).reshape(64, 64), mesh,
                                   'data', 'model')},
          'loader': np.linspace(0, 1, 64 * 64, dtype=np.float32).reshape(64, 64),
          'count': 5, 'lr': 0.125}


@pytest.fixture(scope='module')
def saved(tmp_path_factory) -> dict[str, pathlib.Path]:
  """Manager-written steps with the library installed: a training run without OCDBT (chunk
  files we can delete), a two-item step, and a colocated-transport step."""
  base = tmp_path_factory.mktemp('run')
  mesh = _mesh()
  with ckpt.options(coalesce_bytes=0):
    with ocp.CheckpointManager(base / 'train', item_handlers=ocp.StandardCheckpointHandler(
        use_ocdbt=False)) as mngr:
      for s in (10, 20, 30):
        mngr.save(s, args=ocp.args.StandardSave(_train_state(mesh, s)))
      mngr.wait_until_finished()
    with ocp.CheckpointManager(base / 'two_items') as mngr:
      mngr.save(1, args=ocp.args.Composite(
          model=ocp.args.StandardSave(_train_state(mesh, 1)),
          ema=ocp.args.StandardSave(_train_state(mesh, 1))))
      mngr.wait_until_finished()
  with ckpt.options(transport='colocated'):
    ckpt.save(base / 'colocated', _train_state(mesh, 1), step=1)
  with ocp.CheckpointManager(base / 'host', item_handlers=ocp.PyTreeCheckpointHandler(
      use_compression=False)) as mngr:  # uncompressed: a flipped byte still decodes
    mngr.save(1, args=ocp.args.PyTreeSave(_host_state(mesh)))
    mngr.wait_until_finished()
  for step in (base / 'train' / '10', base / 'two_items' / '1', base / 'colocated' / '1',
               base / 'host' / '1'):
    assert list(step.glob('*/' + records_lib.DIRNAME)), f'{step}: the library wrote no records'
  return {'train': base / 'train', 'two_items': base / 'two_items',
          'colocated': base / 'colocated', 'host': base / 'host'}


def test_verify_fails_when_pathways_dir_deleted_and_a_sibling_item_has_records(saved, tmp_path):
  step = _copy(saved['two_items'] / '1', tmp_path / '1')
  assert run_json('verify', step)[0] == 0
  shutil.rmtree(step / 'ema' / records_lib.DIRNAME)
  code, out, _ = run('verify', step)
  assert code == 1 and 'FAILED: 1 problem' in out
  assert f'missing_record {"ema"}  {step / "ema" / "_pathways"}' in out
  assert 'model of the same save have orbax-pathways records' in out
  _, doc = run_json('verify', step)
  (bad,) = doc['problems']
  assert (bad['kind'], bad['item'], bad['origin']) == ('missing_record', 'ema', None)
  assert doc['modes'] == {'model': 'checksum', 'ema': 'decode'}


def test_verify_fails_when_colocated_records_deleted(saved, tmp_path):
  step = _copy(saved['colocated'] / '1', tmp_path / '1')
  assert run_json('verify', step)[0] == 0
  shutil.rmtree(step / 'default' / records_lib.DIRNAME)
  code, doc = run_json('verify', step)
  assert code == 1 and _kinds(doc) == {'missing_record'}
  (bad,) = doc['problems']
  assert 'ocdbt.process_w' in bad['error'] and 'colocated transport' in bad['error']
  assert doc['chunks'] > 0 and doc['chunks_checksummed'] == 0  # still decoded, nothing checked


def test_verify_stock_looking_step_without_records_passes(saved, tmp_path):
  """With the local transport and a single item nothing that survives says who wrote the step
  (no marker exists without a format change); verify cannot tell it from stock Orbax: decodes."""
  step = _copy(saved['train'] / '10', tmp_path / '10')
  shutil.rmtree(step / 'default' / records_lib.DIRNAME)
  code, doc = run_json('verify', step)
  assert code == 3 and doc['modes'] == {'default': 'decode'} and doc['verdict'] == 'unchecked'
  assert doc['problems'] == [] and len(doc['unchecked']) == doc['arrays']


def _rewrite_records(item: pathlib.Path, keep) -> None:
  """Rewrites every writer file of ``item`` with ``keep(array_record)`` (None drops it)."""
  for f in sorted((item / records_lib.DIRNAME).glob('*.msgpack')):
    rec = records_lib.decode(f.read_bytes())
    arrays = tuple(a for a in (keep(a) for a in rec.arrays) if a is not None)
    f.write_bytes(records_lib.encode(dataclasses.replace(rec, arrays=arrays)))


def test_verify_names_every_chunk_of_an_array_without_records(built, tmp_path):
  step = _copy(built['ours'] / '1', tmp_path / '1')
  _rewrite_records(step / 'default', lambda a: None if a.name == 'opt.mu' else a)
  code, doc = run_json('verify', step)
  assert code == 1 and _kinds(doc) == {'missing_record'} and _bad_arrays(doc) == {'opt.mu'}
  mesh = _mesh()
  rows = 64 // mesh.shape['data']
  assert sorted(tuple(p['origin']) for p in doc['problems']) == [
      (r, 0) for r in range(0, 64, rows)]
  assert {p['path'] for p in doc['problems']} == {
      f'{step / "default"} (ocdbt key opt.mu/{r // rows}.0)' for r in range(0, 64, rows)}
  # The unrecorded chunks were still read and decoded.
  assert doc['chunks'] == run_json('verify', built['ours'] / '1')[1]['chunks']


def test_verify_names_chunks_a_deleted_writer_file_recorded(built, tmp_path):
  step = _copy(built['plain_ours'] / '1', tmp_path / '1')
  (step / 'default' / '_pathways' / 'process_1.msgpack').unlink()
  code, out, _ = run('verify', step)
  assert code == 1
  _, doc = run_json('verify', step)
  assert _kinds(doc) == {'missing_record'}
  kernel = [p for p in doc['problems'] if p['array'] == KERNEL]
  assert kernel and all(p['path'].startswith(str(step / 'default' / KERNEL) + '/')
                        for p in kernel)
  assert all(pathlib.Path(p['path']).exists() for p in kernel)  # present in storage
  assert f'{KERNEL} chunk ({kernel[0]["origin"][0]}, {kernel[0]["origin"][1]})' in out


def test_verify_persistence_records_without_checksums_decode(built, tmp_path):
  """The persistence transport records shardings but no chunk checksums: decode, no failure."""
  step = _copy(built['ours'] / '1', tmp_path / '1')
  item = step / 'default'
  _rewrite_records(item, lambda a: dataclasses.replace(a, chunks=()))
  for f in (item / records_lib.DIRNAME).glob('*.msgpack'):
    rec = records_lib.decode(f.read_bytes())
    f.write_bytes(records_lib.encode(dataclasses.replace(rec, transport='persistence')))
  code, doc = run_json('verify', step)
  assert code == 3 and doc['problems'] == [], doc['problems']
  assert doc['modes'] == {'default': 'decode'} and doc['chunks_checksummed'] == 0
  assert {u['key'] for u in doc['unchecked']
          if u['reason'] == 'written by the persistence transport, which records no checksums'
          } == {KERNEL, 'params.dense.bias', 'opt.mu'}


def test_du_and_show_accept_an_uncommitted_step(built, tmp_path):
  root = tmp_path / 'root'
  four = _copy(built['stock'] / '1', root / '4')  # final name, killed before any step metadata
  (four / 'commit_success.txt').unlink()
  (four / '_CHECKPOINT_METADATA').unlink()
  tmp = _copy(four, root / '5.orbax-checkpoint-tmp')
  for step in (four, tmp):
    code, doc = run_json('du', step)
    assert code == 0, step
    (s,) = doc['steps']
    assert s['state'] == 'partial' and s['bytes'] > 100 * 1024
    assert {k['key'] for k in s['items'][0]['keys']} == {'params', 'opt', 'step'}
    assert run_json('show', step)[0] == 0
  code, doc = run_json('du', root)
  assert code == 0 and [s['name'] for s in doc['steps']] == ['4', '5.orbax-checkpoint-tmp']
  runs = _copy(root, tmp_path / 'runs' / '7')  # a root that is named like a step
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
  root = _copy(built['stock'], tmp_path / 'root')
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


def test_diff_training_steps_compares_values_by_checksum(saved, tmp_path):
  """Steps of one run have the same tree: diff must say whether values changed, from the
  recorded crc32c alone (the chunk files are deleted here, so nothing can have been read)."""
  root = _copy(saved['train'], tmp_path / 'train')
  deleted = 0
  for step in ('10', '20', '30'):
    for f in (root / step / 'default').rglob('*'):
      if f.parent.name in ('params.kernel', 'params.bias', 'step') and f.name[0] != '.':
        f.unlink()  # a chunk file (zarr v2: '0.1'); '.zarray' stays
        deleted += 1
  assert deleted >= 3 * 3
  same = _copy(root / '10', tmp_path / 'copy' / '10')
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
  rows = 256 // _mesh().shape['data']
  n_chunks = (256 // rows) * _mesh().shape['model']
  assert (f'~ default/params.kernel  values differ (recorded crc32c of {_mesh().shape["model"]} '
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


# ----------------------------------------------------------------------------------------------
# Host leaves, a damaged index, steps on different chunk grids.


def test_verify_checks_numpy_and_scalar_leaves(saved, tmp_path):
  step = _copy(saved['host'] / '1', tmp_path / '1')
  code, doc = run_json('verify', step)
  assert code == 0 and doc['verdict'] == 'ok', doc
  assert doc['arrays'] == 4 and doc['chunks_checksummed'] == doc['chunks']
  loader = _host_state(_mesh())['loader']
  data = [p for p in (step / 'default').rglob('*') if p.is_file() and p.parent.name == 'd']
  damage.flip_bit_in(data, loader.tobytes()[:64], what='loader bytes')
  code, doc = run_json('verify', step)
  assert code == 1 and _kinds(doc) == {'crc_mismatch'} and _bad_arrays(doc) == {'loader'}


def test_verify_damaged_index_checks_the_records_beside_it(saved, tmp_path):
  step = _copy(saved['host'] / '1', tmp_path / '1')
  index = step / 'default' / records_lib.DIRNAME / records_lib.INDEX_FILENAME
  index.write_bytes(b'\x00garbage')
  meta_io.clear_cache()
  code, doc = run_json('verify', step)
  assert code == 1 and _kinds(doc) == {'metadata'}, doc['problems']
  (bad,) = doc['problems']
  assert bad['path'] == str(index) and 'is damaged' in bad['error']
  assert 'writer record(s) beside it are intact: the chunks were checked against them' in (
      bad['error'])
  assert doc['modes'] == {'default': 'checksum'} and doc['chunks_checksummed'] == doc['chunks']
  for f in index.parent.glob('*.msgpack'):  # and without records nothing can be checked
    if f != index:
      f.unlink()
  code, doc = run_json('verify', step)
  assert code == 1 and 'No writer record is beside it' in doc['problems'][0]['error']


def _save_grid(root: pathlib.Path, step: int, kernel: np.ndarray, **options) -> pathlib.Path:
  with ckpt.options(coalesce_bytes=0, **options), ocp.CheckpointManager(root) as mngr:
    mngr.save(step, args=ocp.args.StandardSave(
        {'kernel': put(kernel, _mesh(), 'data', 'model'), 'step': step}))
    mngr.wait_until_finished()
  return root / str(step)


def test_diff_of_steps_on_different_chunk_grids_compares_values(tmp_path):
  """Saved with another chunk size (or on another mesh) the recorded checksums cannot be
  compared chunk by chunk: the values are read and compared instead of "not compared"."""
  kernel = np.arange(256 * 128, dtype=np.float32).reshape(256, 128)
  a = _save_grid(tmp_path / 'a', 1, kernel)
  b = _save_grid(tmp_path / 'b', 1, kernel, max_chunk_bytes=4096)
  changed = kernel.copy()
  changed[200, 100] += 1
  c = _save_grid(tmp_path / 'c', 1, changed, max_chunk_bytes=4096)
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
