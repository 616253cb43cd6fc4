"""Checkpoints, damage and in-process runs for the CLI tests (``tests/cli/``): steps written by
``ocp.CheckpointManager`` on 8 forced CPU devices, copies with our metadata stripped or
written here (crc32c computed from the in-memory arrays, so the checksum path is exercised
either way), byte flips and truncations, and ``main(argv)`` run in-process."""

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
import urllib.parse

import google_crc32c
from jax.sharding import Mesh
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from orbax_pathways.format import records as records_lib
from orbax_pathways.cli import steps as cli_steps
from orbax_pathways.cli import main as cli_main
from orbax_pathways.storage import meta_io
from support import ckpt
from support import procs
from support.arrays import mesh as make_mesh
from support.arrays import put


KERNEL = 'params.dense.kernel'


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
  ``hermetic_env()``) as the child's base, no device-count flag."""
  return procs.run_cli(*argv, base=env, devices=None, timeout=timeout)


def mesh() -> Mesh:
  return make_mesh((2, 4))


def state(mesh: Mesh, step: int):
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


def save(root: pathlib.Path, steps, handler=None) -> pathlib.Path:
  """Saves with one chunk per shard (coalescing off), the grid stock Orbax writes, so the
  stripped copies below are laid out exactly like stock checkpoints."""
  m = mesh()
  with ckpt.options(coalesce_bytes=0), ocp.CheckpointManager(root, item_handlers=handler) as mngr:
    for s in steps:
      mngr.save(s, args=ocp.args.StandardSave(state(m, s)))
    mngr.wait_until_finished()
  return root


def strip_ours(step_dir: pathlib.Path) -> None:
  for d in step_dir.glob('*/' + records_lib.DIRNAME):
    shutil.rmtree(d)


def sharding_record(s) -> records_lib.ShardingRecord:
  mesh = s.mesh
  return records_lib.ShardingRecord(
      kind='named', mesh_shape=tuple(mesh.devices.shape), axis_names=tuple(mesh.axis_names),
      device_ids=tuple(int(d.id) for d in mesh.devices.flat),
      device_slices=(0,) * mesh.devices.size, spec=tuple(s.spec), num_slices=1,
  )


def with_our_metadata(step_dir: pathlib.Path) -> pathlib.Path:
  """Replaces ``_pathways`` with two writer files whose crc32c are computed here from the arrays
  that were saved (not read back), split chunk by chunk between the writers."""
  strip_ours(step_dir)
  tree = state(mesh(), int(step_dir.name))
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
          chunks=tuple(chunks[w]), sharding=sharding_record(arr.sharding) if w == 0 else None))
  for w in (0, 1):
    meta_io.write_record(step_dir / 'default', records_lib.WriterRecord(
        writer=f'process_{w}', transport='test-fixture', arrays=tuple(per_writer[w]),
        library_version='test'))
  return step_dir


def copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
  shutil.copytree(src, dst)
  return dst


def largest_data_file(item: pathlib.Path) -> pathlib.Path:
  """The OCDBT data file (``.../d/<hash>``) that holds the big kernel chunks."""
  files = [p for p in item.rglob('*') if p.is_file() and p.parent.name == 'd']
  return max(files, key=lambda p: p.stat().st_size)


def flip(path: pathlib.Path, offset: int | None = None) -> None:
  data = bytearray(path.read_bytes())
  i = len(data) // 2 if offset is None else offset
  data[i] ^= 0xFF
  path.write_bytes(bytes(data))


def truncate(path: pathlib.Path) -> None:
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def kinds(report: dict) -> set[str]:
  return {p['kind'] for p in report['problems']}


def bad_arrays(report: dict) -> set[str]:
  return {p['array'] for p in report['problems']}


def hermetic_env(**extra) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith(('GOOGLE_', 'STORAGE_EMU'))}
  env.update({'NO_GCE_CHECK': 'true', 'GCE_METADATA_HOST': '127.0.0.1:1',
              'GCE_METADATA_IP': '127.0.0.1:1', 'GCE_METADATA_ROOT': '127.0.0.1:1',
              'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': ''}, **extra)
  return env


def upload_tree(gcs, bucket: str, local: pathlib.Path, prefix: str) -> None:
  for p in sorted(local.rglob('*')):
    if p.is_file():
      name = urllib.parse.quote(f'{prefix}/{p.relative_to(local).as_posix()}', safe='')
      conn = http.client.HTTPConnection(gcs.host, gcs.port, timeout=10)
      conn.request('POST', f'/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}',
                   body=p.read_bytes(), headers={'Content-Type': 'application/octet-stream'})
      assert conn.getresponse().status == 200
      conn.close()


def train_state(mesh: Mesh, step: int):
  """Every leaf a jax.Array (as in a real train state), so every value carries checksums. Step 30
  changes the kernel's first row block; otherwise only the step counter changes."""
  kernel = np.arange(256 * 128, dtype=np.float32).reshape(256, 128)
  if step >= 30:
    kernel = kernel.copy()
    kernel[:8] += 1.0
  return {'params': {'kernel': put(kernel, mesh, 'data', 'model'),
                     'bias': put(np.ones(128, np.float32), mesh)},
          'step': put(np.int32(step), mesh)}


def host_state(mesh: Mesh):
  """A state after ``jax.device_get`` of part of it: numpy and scalar leaves beside an array."""
  return {'params': {'kernel': put(np.arange(64 * 64, dtype=np.float32).reshape(64, 64), mesh,
                                   'data', 'model')},
          'loader': np.linspace(0, 1, 64 * 64, dtype=np.float32).reshape(64, 64),
          'count': 5, 'lr': 0.125}


def rewrite_records(item: pathlib.Path, keep) -> None:
  """Rewrites every writer file of ``item`` with ``keep(array_record)`` (None drops it)."""
  for f in sorted((item / records_lib.DIRNAME).glob('*.msgpack')):
    rec = records_lib.decode(f.read_bytes())
    arrays = tuple(a for a in (keep(a) for a in rec.arrays) if a is not None)
    f.write_bytes(records_lib.encode(dataclasses.replace(rec, arrays=arrays)))


def save_grid(root: pathlib.Path, step: int, kernel: np.ndarray, **options) -> pathlib.Path:
  with ckpt.options(coalesce_bytes=0, **options), ocp.CheckpointManager(root) as mngr:
    mngr.save(step, args=ocp.args.StandardSave(
        {'kernel': put(kernel, mesh(), 'data', 'model'), 'step': step}))
    mngr.wait_until_finished()
  return root / str(step)

