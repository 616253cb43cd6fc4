#!/usr/bin/env python3
"""CPU per local-only save in one process (the multi-tier overhead): what a save every step
costs the host's cores, with the node-local tier's spares (``tier/spares.py``) on and off, side
by side.

    .venv/bin/python benchmarks/local_save_cpu.py                       # 256 MiB, local dir
    .venv/bin/python benchmarks/local_save_cpu.py --storage gcs         # gs:// on fake-gcs-server
    .venv/bin/python benchmarks/local_save_cpu.py --storage gcs --latency-ms 30  # GCS-like round trips

One process, 2 CPU devices, an unchanged ``CheckpointManager`` (storage every 1000 steps) with
``local_save_interval_steps=1`` and a tier directory on /dev/shm; each step's new state is a
jitted ``w + 1`` (donated), then ``save()`` and ``wait_until_finished()``: the CPU time of the
whole process (every thread) from ``save()`` to committed is one save's cost. Variants run in
fresh processes, alternating, ``--rounds`` each: ``spares`` (the default) and ``no_spares``
(``spares.WINDOW_S = 0``: no file is kept, each save writes new pages and frees the old ones, as
before spares). Reported: the median over each variant's saves after the first two, and the
ratio. ``--storage gcs``: the checkpoint directory is gs:// on fake-gcs-server (memory backend,
behind the test proxy), so Orbax's per-save metadata requests are in the number too; with
``--latency-ms N`` the proxy holds every response N ms (a GCS round trip), and the wall time from
``save()`` to committed shows what those requests cost a save's commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

CHILD = r'''
import json, os, sys, time
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=2')
import jax, numpy as np
import orbax.checkpoint as ocp
import orbax_pathways
from orbax_pathways.tier import spares
variant, root, saves, mib = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
if variant == 'no_spares':
  spares.WINDOW_S = 0.0
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 1), ('x', 'y'))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x', 'y'))
rows = int(mib * (1 << 20) / 4 / 1024) // 2 * 2
step_fn = jax.jit(lambda w: w + 1, donate_argnums=0)
w = jax.device_put(np.zeros((rows, 1024), np.float32), sharding)
opts = ocp.CheckpointManagerOptions(save_interval_steps=1000, max_to_keep=2)
cpu, wall = [], []
with ocp.CheckpointManager(root, options=opts) as m:
  m.save(0, args=ocp.args.StandardSave({'w': w}))  # Orbax's first save: to storage
  m.wait_until_finished()
  for step in range(1, saves + 1):
    w = step_fn(w)
    jax.block_until_ready(w)
    c0, t0 = time.process_time(), time.perf_counter()
    m.save(step, args=ocp.args.StandardSave({'w': w}))
    m.wait_until_finished()
    cpu.append(time.process_time() - c0)
    wall.append(time.perf_counter() - t0)
print(json.dumps({'cpu': cpu, 'wall': wall}))
'''


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--mib', type=float, default=256.0, help='MiB of state')
  p.add_argument('--saves', type=int, default=12, help='local-only saves per process')
  p.add_argument('--rounds', type=int, default=2, help='processes per variant, alternating')
  p.add_argument('--storage', choices=('local', 'gcs'), default='local')
  p.add_argument('--latency-ms', type=float, default=0.0,
                 help='with --storage gcs: each storage response held this long (a round trip)')
  p.add_argument('--json-out', default=None)
  return p.parse_args(argv)


def _one(variant: str, args, env: dict, root: str) -> tuple[list[float], list[float]]:
  tier = tempfile.mkdtemp(prefix='orbax-pathways-bench-tier-',
                          dir='/dev/shm' if os.access('/dev/shm', os.W_OK) else None)
  try:
    run_env = dict(env, ORBAX_PATHWAYS_TIER_DIR=tier, ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS='1',
                   PYTHONPATH=os.pathsep.join(filter(None, [REPO, env.get('PYTHONPATH')])))
    out = subprocess.run([sys.executable, '-c', CHILD, variant, root, str(args.saves),
                          str(args.mib)], env=run_env, capture_output=True, text=True,
                         timeout=1200, check=False)
    if out.returncode:
      raise RuntimeError(f'{variant}: rc {out.returncode}\n{out.stderr[-3000:]}')
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got['cpu'][2:], got['wall'][2:]
  finally:
    shutil.rmtree(tier, ignore_errors=True)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.latency_ms and args.storage != 'gcs':
    raise SystemExit('--latency-ms needs --storage gcs')
  results: dict[str, list[float]] = {'spares': [], 'no_spares': []}
  walls: dict[str, list[float]] = {'spares': [], 'no_spares': []}

  def run_all(env, new_root):
    for r in range(args.rounds):
      for variant in (('no_spares', 'spares') if r % 2 == 0 else ('spares', 'no_spares')):
        cpu, wall = _one(variant, args, env, new_root())
        results[variant] += cpu
        walls[variant] += wall

  if args.storage == 'gcs':
    from benchlib import storage as benchlib_storage  # pylint: disable=import-outside-toplevel
    with benchlib_storage.capped_gcs(None, args.latency_ms / 1000) as (server, _):
      run_all(dict(os.environ), lambda: f'gs://{server.new_bucket("cpu")}/ckpt')
  else:
    base = tempfile.mkdtemp(prefix='orbax-pathways-bench-ckpt-')
    try:
      run_all(dict(os.environ), lambda: tempfile.mkdtemp(dir=base))
    finally:
      shutil.rmtree(base, ignore_errors=True)
  med = {k: statistics.median(v) for k, v in results.items()}
  med_wall = {k: statistics.median(v) for k, v in walls.items()}
  latency = f', {args.latency_ms:g} ms per storage request' if args.latency_ms else ''
  print(f'one process, {args.mib:g} MiB of state, a local-only save every step, storage '
        f'{args.storage}{latency}; CPU per save (whole process, save() to committed) and wall '
        f'time save() to committed, medians of {len(results["spares"])} saves per variant over '
        f'{args.rounds} processes each\n')
  print('| variant | CPU per save, median (s) | min / max (s) | save() to committed, median (s) |')
  print('|---|---:|---:|---:|')
  for k in ('no_spares', 'spares'):
    print(f'| {k} | {med[k]:.3f} | {min(results[k]):.3f} / {max(results[k]):.3f} '
          f'| {med_wall[k]:.3f} |')
  print(f'\nspares / no_spares: {med["spares"] / med["no_spares"]:.2f}')
  if args.json_out:
    with open(args.json_out, 'w', encoding='utf-8') as f:
      json.dump({'args': vars(args), 'cpu': results, 'wall': walls, 'median': med,
                 'median_wall': med_wall}, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
