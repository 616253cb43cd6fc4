"""The ``orbax-pathways`` CLI as a process: ``python -m orbax_pathways`` and the console script
(no jax loaded, no backend initialized, no credentials needed for a local path), stock golden
checkpoints, and ``gs://`` through fake-gcs-server."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

import jax
import pytest

from support import golden
from support import procs
from support.workers import bare_import_worker, cli_no_backend_worker, console_script_worker
from support import cli_steps as cs
from support.cli_steps import run_json, run_subprocess


def test_subprocess_and_gcs_without_credentials(built):
  with tempfile.TemporaryDirectory() as gcloud:
    proc = run_subprocess('ls', 'gs://no-such-bucket-for-tests/ckpt',
                          env=cs.hermetic_env(CLOUDSDK_CONFIG=gcloud), timeout=60)
  assert proc.returncode == 2, proc.stderr
  assert 'credentials' in proc.stderr and 'Traceback' not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith('orbax-pathways: error:')
  proc = run_subprocess('verify', built['ours'] / '1', '--json', env=cs.hermetic_env())
  assert proc.returncode == 3, proc.stderr  # intact; the scalar 'step' has no checksum
  assert json.loads(proc.stdout)['problems'] == []


def test_cli_never_initializes_a_backend(built):
  proc = procs.run_worker(cli_no_backend_worker, built['ours'] / '1', base=cs.hermetic_env(),
                          devices=None, unset=('JAX_PLATFORMS',), timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr


def test_cli_modules_import_no_jax():
  """Every module the CLI imports is jax-free: imported with the package's ``__init__`` skipped
  (it installs the handler, see the next test), nothing loads jax or Orbax."""
  proc = procs.run_worker(bare_import_worker, 'orbax_pathways.cli.main', 'jax,jaxlib,orbax',
                          timeout=120, check=False, fresh=True)
  assert proc.returncode == 0, proc.stderr


def test_the_console_script_loads_no_jax(built):
  """``orbax-pathways`` enters through ``orbax_pathways_cli``, which imports the package without
  installing the handler: jax and Orbax never load (a plain ``import orbax_pathways`` installs,
  which needs both)."""
  proc = procs.run_worker(console_script_worker, built['stock'], base=cs.hermetic_env(),
                          devices=None, timeout=120, check=False, fresh=True)
  assert proc.returncode == 0, proc.stderr
  assert 'complete' in proc.stdout


def test_console_script(built):
  script = pathlib.Path(sys.executable).parent / 'orbax-pathways'
  if not script.exists():
    pytest.skip('console script not installed (pip install -e .)')
  proc = procs.run([script, 'ls', built['stock'], '--json'], base=cs.hermetic_env(), devices=None,
                   timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr
  assert [s['step'] for s in json.loads(proc.stdout)['steps']] == [1, 2]


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


@pytest.mark.gcs
def test_gcs_ls_show_verify(built, fake_gcs):
  bucket = fake_gcs.new_bucket('cli')
  cs.upload_tree(fake_gcs, bucket, built['ours'], 'ckpt')
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

