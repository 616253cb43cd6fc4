#!/usr/bin/env python3
"""Controller-side planning cost at fleet scale: a first save of a 200-array model.

Times what the controller (every process, in multi-controller JAX) computes before any byte
moves: each array's write plan (``layout.plan_writes``, or the pure planner under it), one
host's own writes (``plan.for_host``) and the first write (what the handler reads for zarr
metadata); and, for restore, the boxes of every addressable device plus the read plan (a
Pathways controller addresses all devices). Each measurement runs in a fresh subprocess, so
every plan is a first plan (no cache from an earlier run).

Two kinds of rows:

* ``pure``: synthetic placements at 1k-32k devices (no jax devices): a mesh ``(n/8, 8)`` over
  ``('data', 'tp')``, device ids in mesh order, 4 devices per host. The current planner starts
  from the mesh description (``plan.shards.mesh_grid``, what ``sharding/layout.py`` builds from a
  ``NamedSharding``); an older checkout, without that module, gets a ``Placement`` list per
  array, built outside the timed region (its ``layout.placements`` did that work from JAX).
* ``jax``: real ``NamedSharding``s on 64/256/1024 forced host CPU devices
  (``--xla_force_host_platform_device_count``), through ``layout.plan_writes``. ``jax-dim`` is
  JAX's own ``devices_indices_map`` for the same 200 (sharding, shape) pairs, first calls.

``--before REF`` extracts ``orbax_pathways/`` at git ref REF (e.g. ``main``) into a temporary
directory and runs the same measurements on it, for a before/after table. A before
measurement that would take too long stops after ``--budget`` seconds and is extrapolated
from the arrays it did (marked ``~``).

    .venv/bin/python benchmarks/plan_scale.py                       # current tree only
    .venv/bin/python benchmarks/plan_scale.py --before main         # before/after table
    .venv/bin/python benchmarks/plan_scale.py --pure 1024,16384 --jax 64 --json-out /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB = 1 << 20
OPTIONS = dict(max_chunk_bytes=16 * MiB, replica_parallel=True, coalesce_bytes=MiB)
DEVICES_PER_HOST = 4


# ---- the model ---------------------------------------------------------------------------

def model(num_devices: int) -> list[tuple[str, tuple[int, ...], int, tuple]]:
  """200 arrays (name, shape, itemsize, spec) of a transformer over a (data, tp) mesh:
  data-parallel (one dimension over every device), FSDP (both dimensions), tensor-parallel
  replicated across data, fully replicated, small coalesced biases, an FSDP-sharded bias.

  Every layer has its own widths, so no two arrays share (layout, shape) and the plan cache of
  ``layout.plan_writes`` never hits: the worst case for a first save. (A model whose layers
  repeat one shape plans once per distinct shape.)
  """
  d, ff, vocab = 8192, 32768, 131072
  dp, fsdp, tp_cols, tp_rows = (('data', 'tp'),), ('data', 'tp'), (None, 'tp'), ('tp', None)
  arrays = [
      ('embed', (vocab, d), 2, dp),
      ('pos_embed', (65536, d), 2, dp),
      ('unembed', (d, vocab), 2, fsdp),
      ('final_ln', (d,), 4, ()),
      ('step', (), 4, ()),
      ('router', (d, 64), 4, ('data',)),
      ('kv_cache_index', (num_devices * 16, 128), 4, dp),
      ('rng', (2,), 4, ()),
  ]
  for layer in range(24):
    wide, ffl = d + 4096 * layer, ff + 4096 * layer
    arrays += [
        (f'l{layer}.qkv', (wide, 3 * d), 2, fsdp),
        (f'l{layer}.attn_out', (wide, d), 2, fsdp),
        (f'l{layer}.attn_bias', (3 * d + 4096 * layer,), 4, ('data',)),
        (f'l{layer}.mlp_in', (d, ffl), 2, tp_cols),
        (f'l{layer}.mlp_out', (ffl, d), 2, tp_rows),
        (f'l{layer}.mlp_bias', (ffl,), 4, ('tp',)),
        (f'l{layer}.ln1', (d + 16 * layer + 8,), 4, ()),
        (f'l{layer}.ln2', (d + 16 * layer + 16,), 4, ()),
    ]
  assert len(arrays) == 200 and len({(a[1], a[3]) for a in arrays}) == 200
  return arrays


def host_of(device) -> str:
  return f'p{device.id // DEVICES_PER_HOST}'


# ---- workers (one per subprocess) ----------------------------------------------------------

CLOCKS = {'wall': time.perf_counter, 'cpu': time.process_time}
_now = CLOCKS['wall']


def _pure(n: int, budget: float) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from orbax_pathways.plan import save as save_plan  # pylint: disable=g-import-not-at-top
  try:
    from orbax_pathways.plan import shards  # pylint: disable=g-import-not-at-top
  except ImportError:
    shards = None
  mesh_shape, names = (n // 8, 8), ('data', 'tp')
  ids = np.arange(n)
  arrays = model(n)
  out = {'arrays': len(arrays), 'impl': os.path.dirname(save_plan.__file__)}
  if shards is not None:
    t0 = _now()
    host_idx, hosts = shards.intern_hosts([f'p{i // DEVICES_PER_HOST}' for i in ids.tolist()])
    grids = {}
    for _, shape, itemsize, spec in arrays:
      key = (spec, len(shape))
      if key not in grids:
        grids[key] = shards.mesh_grid(mesh_shape, names, spec, len(shape), ids, host_idx, hosts)
      plan = save_plan.plan_shards(grids[key].table(shape), itemsize, **OPTIONS)
      plan.for_host('p0')
      _ = plan.writes[0] if len(plan.writes) else None
    out['plan_s'] = _now() - t0
    return out
  # An older planner: placements per array (timed apart), then its plan_array_writes.
  from orbax_pathways.plan import boxes as boxes_lib  # pylint: disable=g-import-not-at-top
  coords = np.indices(mesh_shape).reshape(2, -1)
  size = dict(zip(names, mesh_shape))
  build = plan_time = 0.0
  for done, (_, shape, itemsize, spec) in enumerate(arrays, 1):
    t0 = _now()
    start, stop = [], []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
      axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
      cell, parts = np.zeros(n, dtype=np.int64), 1
      for a in axes:
        cell, parts = cell * size[a] + coords[names.index(a)], parts * size[a]
      start.append(cell * (dim // parts))
      stop.append(cell * (dim // parts) + dim // parts)
    start = np.stack(start, 1).tolist() if shape else [[]] * n
    stop = np.stack(stop, 1).tolist() if shape else [[]] * n
    placements = [save_plan.Placement(i, f'p{i // DEVICES_PER_HOST}',
                                      boxes_lib.Box(tuple(a), tuple(b)))
                  for i, a, b in zip(ids.tolist(), start, stop)]
    t1 = _now()
    plan = save_plan.plan_array_writes(shape, itemsize, placements, **OPTIONS)
    plan.for_host('p0')
    _ = plan.writes[0] if plan.writes else None
    t2 = _now()
    build, plan_time = build + t1 - t0, plan_time + t2 - t1
    if plan_time > budget and done < len(arrays):
      out['extrapolated_from'] = done
      plan_time *= len(arrays) / done
      build *= len(arrays) / done
      break
  out['plan_s'], out['placements_s'] = plan_time, build
  return out


def _jax_setup(n: int):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.asarray(jax.devices()[:n]).reshape(n // 8, 8), ('data', 'tp'))
  return [(NamedSharding(mesh, P(*spec)), shape, itemsize) for _, shape, itemsize, spec in model(n)]


def _jax(n: int, budget: float) -> dict:
  from orbax_pathways.sharding import layout  # pylint: disable=g-import-not-at-top
  from orbax_pathways.plan import restore as restore_plan  # pylint: disable=g-import-not-at-top
  arrays = _jax_setup(n)
  out = {'arrays': len(arrays), 'impl': os.path.dirname(layout.__file__)}
  t0 = _now()
  plans = []
  for sharding, shape, itemsize in arrays:
    plan = layout.plan_writes(sharding, shape, itemsize, host_of, **OPTIONS)
    plan.for_host('p0')
    _ = plan.writes[0] if len(plan.writes) else None
    plans.append(plan)
  out['plan_s'] = _now() - t0
  t0 = _now()
  for sharding, _, _ in arrays:
    layout.sharding_record(sharding)
  out['record_s'] = _now() - t0
  t0 = _now()
  for done, ((sharding, shape, _), plan) in enumerate(zip(arrays, plans), 1):
    boxes = layout.device_boxes(sharding, shape, addressable_only=True)
    restore_plan.plan_array_reads(shape, plan.chunk_shape, list(boxes.values()))
    if _now() - t0 > budget and done < len(arrays):
      out['restore_extrapolated_from'] = done
      out['restore_s'] = (_now() - t0) * len(arrays) / done
      break
  else:
    out['restore_s'] = _now() - t0
  return out


def _jax_dim(n: int, budget: float) -> dict:
  del budget
  arrays = _jax_setup(n)
  t0 = _now()
  for sharding, shape, _ in arrays:
    sharding.devices_indices_map(shape)
  return {'arrays': len(arrays), 'plan_s': _now() - t0}


WORKERS = {'pure': _pure, 'jax': _jax, 'jax-dim': _jax_dim}


# ---- driver ------------------------------------------------------------------------------

def _run(kind: str, n: int, root: str, budget: float, clock: str) -> dict:
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS='cpu')
  if kind.startswith('jax'):
    env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                        f' --xla_force_host_platform_device_count={n}').strip()
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), '--_worker', kind, str(n),
                         str(budget), clock], env=env, cwd=root, capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f'{kind} {n} under {root} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _checkout(ref: str) -> str:
  tmp = tempfile.mkdtemp(prefix='plan-scale-')
  archive = subprocess.run(['git', 'archive', ref, 'orbax_pathways'], cwd=REPO, check=True,
                           capture_output=True).stdout
  subprocess.run(['tar', '-x', '-C', tmp], input=archive, check=True)
  return tmp


def _fmt(r: dict | None, key: str = 'plan_s', extra: str = 'extrapolated_from') -> str:
  if r is None or key not in r:
    return '-'
  return ('~' if extra in r else '') + f'{r[key]:.3f}'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--pure', default='1024,8192,16384,32768', help='device counts ("" for none)')
  parser.add_argument('--jax', default='64,256,1024', help='CPU device counts ("" for none)')
  parser.add_argument('--before', default=None, help='git ref to compare with (e.g. main)')
  parser.add_argument('--budget', type=float, default=120.0,
                      help='seconds one measurement may take before it is extrapolated')
  parser.add_argument('--clock', choices=sorted(CLOCKS), default='wall',
                      help='cpu: process CPU time, steadier on a shared machine')
  parser.add_argument('--json-out', default=None)
  parser.add_argument('--_worker', nargs=4, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args._worker:  # pylint: disable=protected-access
    kind, n, budget, clock = args._worker  # pylint: disable=protected-access
    global _now  # pylint: disable=global-statement
    _now = CLOCKS[clock]
    print(json.dumps(WORKERS[kind](int(n), float(budget))))
    return

  roots = {'after': REPO}
  if args.before:
    roots = {'before': _checkout(args.before), 'after': REPO}
  cases = [('pure', int(n)) for n in args.pure.split(',') if n]
  cases += [(k, int(n)) for n in args.jax.split(',') if n for k in ('jax-dim', 'jax')]
  results = []
  try:
    for kind, n in cases:
      row = {'kind': kind, 'devices': n}
      for label, root in roots.items():
        if kind == 'jax-dim' and label == 'before':
          continue  # JAX's own cost: the same for both
        row[label] = _run(kind, n, root, args.budget, args.clock)
        print(f'# {kind:8s} {n:6d} {label:6s} {row[label]}', file=sys.stderr, flush=True)
      results.append(row)
  finally:
    if args.before:
      shutil.rmtree(roots['before'], ignore_errors=True)

  print(f'\nFirst save of a 200-array model: controller planning seconds ({args.clock} clock, '
        f'all 200 arrays); {DEVICES_PER_HOST} devices per host.')
  print('| rows | devices | before | after | speedup | before restore plan | after restore plan |')
  print('|---|---:|---:|---:|---:|---:|---:|')
  for row in results:
    b, a = row.get('before'), row['after']
    speed = f"{b['plan_s'] / a['plan_s']:.0f}x" if b and a['plan_s'] > 0 else '-'
    restore_b = _fmt(b, 'restore_s', 'restore_extrapolated_from')
    restore_a = _fmt(a, 'restore_s', 'restore_extrapolated_from')
    print(f"| {row['kind']} | {row['devices']} | {_fmt(b)} | {_fmt(a)} | {speed} | "
          f'{restore_b} | {restore_a} |')
  built = [f"{r['devices']}: {r['before']['placements_s']:.2f} s" for r in results
           if r['kind'] == 'pure' and r.get('before')]
  print('\n`~`: extrapolated from the arrays done within --budget.' +
        (f" Before, pure: its placements were built outside the timed region ({', '.join(built)})."
         if built else ''))
  if args.json_out:
    with open(args.json_out, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  main()
