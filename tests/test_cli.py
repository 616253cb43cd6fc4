"""The ``orbax-pathways`` inspection CLI against real CheckpointManager checkpoints.

Checkpoints are written by ``ocp.CheckpointManager`` on 8 forced CPU devices. Once the core is
installed (``import orbax_pathways``), those saves carry our ``_pathways`` metadata; tests that
need a stock checkpoint strip it, and ``_with_our_metadata`` writes our metadata itself (crc32c
computed here from the in-memory arrays) so the checksum path is exercised either way.
Most tests call ``main(argv)`` in-process; a few run ``python -m orbax_pathways``.
"""

from __future__ import annotations

import os

if 'jax' not in __import__('sys').modules:
  os.environ['XLA_FLAGS'] = (
      os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  ).strip()
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import contextlib
import http.client
import io
import itertools
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import urllib.parse

import google_crc32c
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import orbax_pathways
import pytest

from orbax_pathways import metadata as pw_metadata
from orbax_pathways.cli import steps as cli_steps
from orbax_pathways.cli import main as cli_main
from orbax_pathways.storage import meta_io

REPO = pathlib.Path(__file__).resolve().parent.parent
TESTS = REPO / 'tests'
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
  return subprocess.run(
      [sys.executable, '-m', 'orbax_pathways', *[str(a) for a in argv]],
      capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO,
  )


def _mesh() -> Mesh:
  devs = np.asarray(jax.devices())
  shape = (2, len(devs) // 2) if len(devs) % 2 == 0 else (1, len(devs))
  return Mesh(devs.reshape(shape), ('data', 'model'))


def _state(mesh: Mesh, step: int):
  """A train-state-like tree; step 2 changes values, a dtype, a sharding, adds and drops keys."""
  rng = np.random.default_rng(0)
  kernel = rng.standard_normal((256, 128), dtype=np.float32)  # 16 KiB chunks: out-of-line in OCDBT
  bias = (np.arange(128) / 4).astype(ml_dtypes.bfloat16)
  mu = np.zeros((64, 64), np.float32)
  put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
  if step == 1:
    tree = {'params': {'dense': {'kernel': put(kernel, P('data', 'model')),
                                 'bias': put(bias, P())}},
            'opt': {'mu': put(mu, P('data', None))}, 'step': 7}
  else:
    tree = {'params': {'dense': {'kernel': put(kernel + 0.5, P('data', 'model')),
                                 'bias': put(bias.astype(np.float32), P()),
                                 'scale': put(np.ones(64, np.float32), P())}},
            'opt': {'mu': put(mu, P(None, 'model'))}}
  return tree


def _save(root: pathlib.Path, steps, handler=None) -> pathlib.Path:
  """Saves with one chunk per shard (coalescing off), the grid stock Orbax writes, so the
  stripped copies below are laid out exactly like stock checkpoints."""
  mesh = _mesh()
  orbax_pathways.install(orbax_pathways.Options(coalesce_bytes=0))
  try:
    mngr = ocp.CheckpointManager(root, item_handlers=handler)
    for s in steps:
      mngr.save(s, args=ocp.args.StandardSave(_state(mesh, s)))
    mngr.wait_until_finished()
    mngr.close()
  finally:
    orbax_pathways.install(orbax_pathways.Options.from_env())
  return root


def _strip_ours(step_dir: pathlib.Path) -> None:
  for d in step_dir.glob('*/' + pw_metadata.DIRNAME):
    shutil.rmtree(d)


def _sharding_record(s) -> pw_metadata.ShardingRecord:
  mesh = s.mesh
  return pw_metadata.ShardingRecord(
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
          pw_metadata.ChunkRecord(origin, google_crc32c.value(region.tobytes()), region.nbytes))
    for w in (0, 1):
      per_writer[w].append(pw_metadata.ArrayRecord(
          name=name, dtype=str(value.dtype), shape=value.shape, chunk_shape=chunk,
          chunks=tuple(chunks[w]), sharding=_sharding_record(arr.sharding) if w == 0 else None))
  for w in (0, 1):
    meta_io.write_record(step_dir / 'default', pw_metadata.WriterRecord(
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
  if (step / 'default' / pw_metadata.DIRNAME).exists():
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


# ----------------------------------------------------------------------------------------------
# verify


def test_verify_clean_stock_and_ours(built):
  code, doc = run_json('verify', built['stock'] / '1')
  assert code == 0 and doc['ok'] and doc['modes'] == {'default': 'decode'}
  for key in ('path', 'step', 'state', 'ok', 'modes', 'arrays', 'chunks', 'chunks_checksummed',
              'bytes_read', 'seconds', 'problems'):
    assert key in doc
  assert doc['arrays'] == 4 and doc['bytes_read'] == 256 * 128 * 4 + 128 * 2 + 64 * 64 * 4 + 8
  code, doc = run_json('verify', built['ours'] / '1')
  assert code == 0 and doc['modes'] == {'default': 'checksum'}, doc['problems']
  assert doc['chunks_checksummed'] == doc['chunks'] - 1  # all but the scalar 'step'
  code, doc = run_json('verify', built['plain_ours'] / '1')
  assert code == 0 and doc['chunks_checksummed'] > 0, doc['problems']


def test_verify_manager_written(built):
  """Whatever the installed library wrote verifies clean (checksums when the core wrote them)."""
  step = built['ocdbt'] / '1'
  code, doc = run_json('verify', step)
  assert code == 0, doc['problems']
  if (step / 'default' / pw_metadata.DIRNAME).exists():
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
  assert code == 0 and 'verify [' in err and '/s' in err and 'chunks' in err


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
  assert proc.returncode == 0, proc.stderr
  assert json.loads(proc.stdout)['ok']


def test_cli_never_initializes_a_backend(built):
  code = (
      'import sys\n'
      'from orbax_pathways.cli import main\n'
      f'assert main.main(["show", {str(built["ours"] / "1")!r}, "--json"]) == 0\n'
      f'assert main.main(["verify", {str(built["ours"] / "1")!r}]) == 0\n'
      'xb = sys.modules.get("jax._src.xla_bridge")\n'
      'assert xb is None or not xb.backends_are_initialized(), "a jax backend was initialized"\n'
  )
  env = _hermetic_env()
  env.pop('JAX_PLATFORMS')
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env,
                        cwd=REPO, timeout=120)
  assert proc.returncode == 0, proc.stderr


def test_console_script(built):
  script = pathlib.Path(sys.executable).parent / 'orbax-pathways'
  if not script.exists():
    pytest.skip('console script not installed (pip install -e .)')
  proc = subprocess.run([str(script), 'ls', built['stock'], '--json'], capture_output=True,
                        text=True, env=_hermetic_env(), timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert [s['step'] for s in json.loads(proc.stdout)['steps']] == [1, 2]


# ----------------------------------------------------------------------------------------------
# Golden stock checkpoints (tests/golden, written by stock orbax-checkpoint).

try:
  sys.path.insert(0, str(TESTS))
  import golden_lib  # pylint: disable=g-import-not-at-top
except ImportError:
  golden_lib = None
finally:
  sys.path.remove(str(TESTS))


@pytest.mark.skipif(golden_lib is None or not (TESTS / 'golden').is_dir(),
                    reason='tests/golden not generated')
@pytest.mark.parametrize('variant', golden_lib.VARIANTS if golden_lib else ())
def test_golden(variant):
  ocdbt, zarr3 = golden_lib.VARIANT_OPTIONS[variant]
  code, doc = run_json('show', golden_lib.step_dir(variant))
  assert code == 0 and doc['state'] == 'complete'
  (item,) = doc['items']
  assert (item['ocdbt'], item['zarr3'], item['writer']) == (ocdbt, zarr3, 'stock orbax')
  leaves = {l['key']: l for l in item['leaves']}
  assert set(leaves) == {l.key.replace('/', '.') for l in golden_lib.LEAVES}
  for gl in golden_lib.LEAVES:
    got = leaves[gl.key.replace('/', '.')]
    assert got['dtype'] == gl.dtype and tuple(got['shape']) == gl.shape, gl.key
    if gl.kind == 'jax':
      assert got['sharding']['mesh_shape'] == list(golden_lib.MESH_SHAPE)
      assert tuple(got['sharding']['spec']) == tuple(gl.spec) or gl.spec == ()
  code, doc = run_json('verify', golden_lib.step_dir(variant))
  assert code == 0 and doc['ok'] and doc['arrays'] == len(golden_lib.LEAVES), doc['problems']


# ----------------------------------------------------------------------------------------------
# gs:// through fake-gcs-server (tests/gcs_server.py).

try:
  sys.path.insert(0, str(TESTS))
  import gcs_server  # pylint: disable=g-import-not-at-top
except ImportError:
  gcs_server = None
finally:
  sys.path.remove(str(TESTS))


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
@pytest.mark.skipif(gcs_server is None, reason='tests/gcs_server.py not present')
def test_gcs_ls_show_verify(built):
  try:
    gcs = gcs_server.FakeGcs().start()
  except Exception as e:  # pylint: disable=broad-except
    pytest.skip(f'fake-gcs-server unavailable: {e}')
  try:
    bucket = gcs.new_bucket('cli')
    _upload_tree(gcs, bucket, built['ours'], 'ckpt')
    env = {k: v for k, v in os.environ.items() if k not in gcs.unset_keys()}
    env.update(gcs.env(), JAX_PLATFORMS='cpu', XLA_FLAGS='')
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
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report['ok'] and report['chunks_checksummed'] > 0
  finally:
    gcs.stop()
