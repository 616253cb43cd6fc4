#!/usr/bin/env python3
"""A restore that the node-local tier serves, against the same restore from storage, stock
Orbax's, and a plain memcpy of the same bytes, interleaved in one run.

    .venv/bin/python benchmarks/tier_read.py                     # 1.1 GiB, 8 CPU devices, 3 rounds
    .venv/bin/python benchmarks/tier_read.py --size-gb 0.25 --rounds 2 --fresh-rounds 1   # smoke
    .venv/bin/python benchmarks/tier_read.py --json-out /tmp/tier_read.json

One process with 8 CPU devices builds ``bench.py``'s state (``benchlib/workloads.build_state``:
9 big arrays, 76 % 8-way sharded, 20 % partly replicated, 4 % fully replicated, and 16 small
leaves) and saves it twice into a local directory (its files stay in the page cache: storage as
fast as this machine's memory allows): with ours, the tier on (a fresh directory under /dev/shm;
the copy flushed before any restore), and with stock Orbax. Then, per round, in an order that
rotates from round to round (so drift hits every mode alike), after ``--warmup`` untimed
rounds (the first restore after the saves pays one-time costs), same-mesh restores of step 1
(``ocp.CheckpointManager.restore`` + ``block_until_ready``, a fresh manager each):

- ``tier_on``: ours, the tier on: every chunk from /dev/shm (checked: 0 bytes from storage);
- ``tier_copy``: ``tier_on`` with the tier's files copied into the region buffers instead of
  mapped there (``storage/pages``, ``ORBAX_PATHWAYS_MAP_TIER=0``): the read path before mapping;
- ``tier_off``: ours, ``tier_dir='off'``, the same step from storage;
- ``stock``: stock Orbax restoring its own save of the same state;
- ``memcpy``: the same unique bytes copied with numpy into freshly allocated buffers (page
  faults included, as a restore's new buffers have them): the floor.
- ``file_read``: every chunk file of the tier's entries read (``readinto``) into one buffer
  touched beforehand: the kernel's copy out of tmpfs alone, with no allocation, no page fault
  and no checksum; the floor of any restore that copies its bytes out of the tier's files.

Then ``--fresh-rounds`` rounds of the three restores each in a fresh process (``--_worker``:
the first restore of a process, as after a restart; the interpreter's and jax's start not
counted). Every restore is checked (shapes, dtypes, devices, one leaf's values; the first round
every value against the saved state). Reported: median and best wall seconds and median CPU
seconds (every thread of the process: less moved by other load than wall time) per mode, and
the ratios tier_on / tier_off, tier_on / memcpy, tier_on / stock and tier_off / stock of the
medians.
Timings are wall clock; compare within one run (a shared machine moves them run to run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
  sys.path.insert(0, HERE)

from benchlib import GiB, cli  # noqa: E402

MODES = ('tier_on', 'tier_copy', 'tier_off', 'stock', 'memcpy', 'file_read')
RESTORES = ('tier_on', 'tier_copy', 'tier_off', 'stock')


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--size-gb', type=float, default=1.1, help='unique bytes of the state, GiB')
  p.add_argument('--rounds', type=int, default=3, help='in-process rounds of every mode')
  p.add_argument('--warmup', type=int, default=1,
                 help='untimed in-process rounds of every mode first (the first restore after '
                 'the saves pays one-time costs, whichever mode it is)')
  p.add_argument('--fresh-rounds', type=int, default=2,
                 help='rounds of each restore in a fresh process (0: none)')
  p.add_argument('--dir', default=None, help='checkpoint root (default: a fresh dir under /tmp)')
  p.add_argument('--json-out', default=None)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--_worker', dest='worker', choices=RESTORES, default=None,
                 help=argparse.SUPPRESS)
  p.add_argument('--_work', dest='work', default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _use(mode: str, tier_dir: str) -> None:
  """The handler and tier setting of a restore mode (ours through the public API)."""
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from benchlib import handlers  # pylint: disable=g-import-not-at-top
  if mode == 'stock':
    handlers.use_handler('stock')
    return
  from orbax_pathways.storage import pages  # pylint: disable=g-import-not-at-top
  handlers.use_handler('ours')
  pages._state.enabled = False if mode == 'tier_copy' else None  # pylint: disable=protected-access
  orbax_pathways.install(orbax_pathways.Options(tier_dir='off' if mode == 'tier_off' else tier_dir))


def _restore(mode: str, work: dict, target, mesh, check_all=None) -> tuple[float, float, dict]:
  """One timed restore of step 1 in ``mode`` (a fresh manager); (wall seconds, CPU seconds of
  every thread of this process, bytes by source)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from benchlib import handlers  # pylint: disable=g-import-not-at-top
  _use(mode, work['tier'])
  root = work['stock'] if mode == 'stock' else work['ours']
  served = handlers.Served('stock' if mode == 'stock' else 'ours', 'restore')
  gc.collect()
  with ocp.CheckpointManager(root) as mngr:
    c0, t0 = time.process_time(), time.perf_counter()
    out = mngr.restore(1, args=ocp.args.StandardRestore(target))
    jax.block_until_ready(out)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
  st = served.check()
  sources = dict(st.bytes_by_source) if st is not None else {}
  if mode in ('tier_on', 'tier_copy') and sources.get('storage', 0) != 0:
    raise RuntimeError(f'{mode} read {sources["storage"]} bytes from storage: the tier did not '
                       f'serve every chunk ({sources})')
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(target)):
    if isinstance(b, jax.ShapeDtypeStruct):
      assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
      assert set(a.sharding.device_set) == set(mesh.devices.flat), 'restored on the wrong devices'
  if check_all is not None:
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(check_all)):
      if isinstance(b, np.ndarray):
        np.testing.assert_array_equal(np.asarray(a), b)
  del out
  gc.collect()
  return dt, cpu, sources


def _memcpy(host) -> tuple[float, float]:
  """A numpy copy of every unique byte into new buffers (one per array, as a restore makes)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  gc.collect()
  c0, t0 = time.process_time(), time.perf_counter()
  out = [np.empty_like(h) for h in host]
  for dst, src in zip(out, host):
    np.copyto(dst, src)
  dt, cpu = time.perf_counter() - t0, time.process_time() - c0
  del out
  gc.collect()
  return dt, cpu


def _file_read(tier_dir: str) -> tuple[float, float]:
  """Reads every chunk file under ``tier_dir`` into one buffer touched beforehand (not timed)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  files = [os.path.join(d, f) for d, _, fs in os.walk(tier_dir) for f in fs if f.endswith('.bin')]
  sizes = [os.path.getsize(f) for f in files]
  buf = np.ones(sum(sizes), np.uint8)  # touched: no page fault inside the timed part
  view = memoryview(buf)
  gc.collect()
  c0, t0 = time.process_time(), time.perf_counter()
  at = 0
  for f, n in zip(files, sizes):
    with open(f, 'rb', buffering=0) as fh:
      got = 0
      while got < n:
        k = fh.readinto(view[at + got:at + n])
        if not k:
          raise OSError(f'{f}: ended after {got} of {n} bytes')
        got += k
    at += n
  dt, cpu = time.perf_counter() - t0, time.process_time() - c0
  del view, buf
  gc.collect()
  return dt, cpu


def _describe(state) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.tree.map(lambda x: {'shape': list(x.shape), 'dtype': str(x.dtype),
                                 'spec': [list(s) if isinstance(s, tuple) else s
                                          for s in x.sharding.spec]}
                      if isinstance(x, jax.Array) else x, state)


def _target(desc: dict, mesh):
  """The abstract restore target (saved shardings on ``mesh``) from ``_describe``'s record."""
  import jax  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  dtypes = {'bfloat16': np.dtype(ml_dtypes.bfloat16)}

  def leaf(x):
    if not (isinstance(x, dict) and set(x) == {'shape', 'dtype', 'spec'}):
      return x
    spec = jax.sharding.PartitionSpec(*[tuple(s) if isinstance(s, list) else s for s in x['spec']])
    return jax.ShapeDtypeStruct(tuple(x['shape']), dtypes.get(x['dtype'], np.dtype(x['dtype'])),
                                sharding=jax.sharding.NamedSharding(mesh, spec))
  return jax.tree.map(leaf, desc, is_leaf=lambda x: isinstance(x, dict) and 'shape' in x)


def worker(args) -> int:
  """One restore in this fresh process (``--_worker MODE --_work FILE``); prints its JSON."""
  from benchlib import workloads  # pylint: disable=g-import-not-at-top
  with open(args.work, encoding='utf-8') as f:
    work = json.load(f)
  mesh, _ = workloads.meshes('cpu')
  target = _target(work['desc'], mesh)
  dt, cpu, sources = _restore(args.worker, work, target, mesh)
  print('RESULT ' + json.dumps({'mode': args.worker, 's': dt, 'cpu_s': cpu, 'sources': sources}),
        flush=True)
  return 0


def _fresh(mode: str, work_file: str) -> dict:
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(p for p in (env.get('PYTHONPATH'), os.path.dirname(HERE))
                                      if p)  # a PYTHONPATH given (another tree's package) wins
  res = subprocess.run([sys.executable, os.path.abspath(__file__), '--_worker', mode, '--_work',
                        work_file], env=env, capture_output=True, text=True, timeout=900,
                       check=False)
  lines = [line for line in res.stdout.splitlines() if line.startswith('RESULT ')]
  if res.returncode or not lines:
    raise RuntimeError(f'fresh {mode} restore failed (rc {res.returncode}):\n{res.stderr[-3000:]}')
  return json.loads(lines[-1][len('RESULT '):])


def _stats(xs, cpu):
  return {'median_s': statistics.median(xs), 'best_s': min(xs), 'all_s': xs,
          'cpu_median_s': statistics.median(cpu), 'cpu_all_s': cpu}


def main(argv=None) -> int:
  args = parse_args(argv)
  cli.set_platform_env('cpu')
  if args.worker:
    cli.quiet_logs()
    return worker(args)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from benchlib import handlers, workloads  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import store as tier_store  # pylint: disable=g-import-not-at-top
  cli.quiet_logs()

  root = tempfile.mkdtemp(prefix='orbax-bench-tier-read-', dir=args.dir or '/tmp')
  shm = '/dev/shm' if os.path.isdir('/dev/shm') and os.access('/dev/shm', os.W_OK) else None
  tier = tempfile.mkdtemp(prefix='orbax-pathways-bench-tier-read-', dir=shm)
  work = {'ours': os.path.join(root, 'ours'), 'stock': os.path.join(root, 'stock'), 'tier': tier}
  try:
    mesh, _ = workloads.meshes('cpu')
    t0 = time.perf_counter()
    state = workloads.build_state(mesh, args.size_gb, args.seed)
    unique = workloads.logical_bytes(state)
    print(f'state: {unique / GiB:.2f} GiB unique, {workloads.device_bytes(state) / GiB:.2f} GiB '
          f'on {jax.device_count()} devices, built in {time.perf_counter() - t0:.1f} s', flush=True)
    for mode, path in (('tier_on', work['ours']), ('stock', work['stock'])):
      _use(mode, tier)
      with ocp.CheckpointManager(path) as mngr:
        mngr.save(1, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
      tier_store.flush()
    host = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, state)
    desc = _describe(state)
    del state
    gc.collect()
    target = _target(desc, mesh)
    leaves = [x for x in jax.tree.leaves(host) if isinstance(x, np.ndarray)]
    work_file = os.path.join(root, 'work.json')
    with open(work_file, 'w', encoding='utf-8') as f:
      json.dump({**work, 'desc': desc}, f)

    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpus: dict[str, list[float]] = {m: [] for m in MODES}
    sources: dict[str, dict] = {}
    for _ in range(args.warmup):
      for mode in MODES:
        if mode == 'memcpy':
          _memcpy(leaves)
        elif mode == 'file_read':
          _file_read(work['tier'])
        else:
          _restore(mode, work, target, mesh)
    for rnd in range(args.rounds):
      order = MODES[rnd % len(MODES):] + MODES[:rnd % len(MODES)]
      for mode in order:
        if mode == 'memcpy':
          dt, cpu = _memcpy(leaves)
        elif mode == 'file_read':
          dt, cpu = _file_read(work['tier'])
        else:
          dt, cpu, sources[mode] = _restore(mode, work, target, mesh,
                                            check_all=host if rnd == 0 else None)
        times[mode].append(dt)
        cpus[mode].append(cpu)
        print(f'round {rnd}: {mode:8s} {dt:.3f} s ({unique / dt / 1e9:.2f} GB/s), CPU {cpu:.3f} s',
              flush=True)
    fresh: dict[str, list[float]] = {m: [] for m in RESTORES}
    fresh_cpu: dict[str, list[float]] = {m: [] for m in RESTORES}
    for rnd in range(args.fresh_rounds):
      order = RESTORES[rnd % len(RESTORES):] + RESTORES[:rnd % len(RESTORES)]
      for mode in order:
        r = _fresh(mode, work_file)
        fresh[mode].append(r['s'])
        fresh_cpu[mode].append(r['cpu_s'])
        print(f'fresh {rnd}: {mode:8s} {r["s"]:.3f} s {r["sources"]}', flush=True)
    out = {'size_gb': args.size_gb, 'unique_bytes': unique, 'devices': jax.device_count(),
           'rounds': args.rounds, 'warmup': args.warmup, 'fresh_rounds': args.fresh_rounds, 'cpus': os.cpu_count(),
           'loadavg': os.getloadavg(), 'bytes_by_source': sources,
           'in_process': {m: _stats(v, cpus[m]) for m, v in times.items()},
           'fresh_process': {m: _stats(v, fresh_cpu[m]) for m, v in fresh.items() if v}}
    med = {m: v['median_s'] for m, v in out['in_process'].items()}
    out['ratios'] = {'tier_on/tier_copy': med['tier_on'] / med['tier_copy'],
                     'tier_on/tier_off': med['tier_on'] / med['tier_off'],
                     'tier_on/memcpy': med['tier_on'] / med['memcpy'],
                     'file_read/memcpy': med['file_read'] / med['memcpy'],
                     'tier_on/file_read': med['tier_on'] / med['file_read'],
                     'tier_on/stock': med['tier_on'] / med['stock'],
                     'tier_off/stock': med['tier_off'] / med['stock']}
    cm = {m: v['cpu_median_s'] for m, v in out['in_process'].items()}
    out['cpu_ratios'] = {'tier_on/tier_copy': cm['tier_on'] / cm['tier_copy'],
                         'tier_on/tier_off': cm['tier_on'] / cm['tier_off'],
                         'tier_on/memcpy': cm['tier_on'] / cm['memcpy'],
                         'tier_on/stock': cm['tier_on'] / cm['stock']}
    if out['fresh_process']:
      fm = {m: v['median_s'] for m, v in out['fresh_process'].items()}
      out['fresh_ratios'] = {'tier_on/tier_copy': fm['tier_on'] / fm['tier_copy'],
                             'tier_on/tier_off': fm['tier_on'] / fm['tier_off'],
                             'tier_on/stock': fm['tier_on'] / fm['stock'],
                             'tier_off/stock': fm['tier_off'] / fm['stock']}
    print(table(out))
    if args.json_out:
      with open(args.json_out, 'w', encoding='utf-8') as f:
        json.dump(out, f, indent=1)
  finally:
    handlers.use_handler('ours')
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(tier, ignore_errors=True)
  return 0


def table(out: dict) -> str:
  ip = out['in_process']
  lines = [f'| same-mesh restore, {out["unique_bytes"] / GiB:.2f} GiB unique, {out["devices"]} CPU '
           f'devices, {out["rounds"]} rounds | median | best | GB/s (median) | CPU s (median) |',
           '|---|---:|---:|---:|---:|']
  for m in MODES:
    lines.append(f'| {m} | {ip[m]["median_s"]:.3f} s | {ip[m]["best_s"]:.3f} s | '
                 f'{out["unique_bytes"] / ip[m]["median_s"] / 1e9:.2f} | '
                 f'{ip[m]["cpu_median_s"]:.3f} s |')
  fp = out.get('fresh_process', {})
  for m in RESTORES:
    if m in fp:
      lines.append(f'| {m}, fresh process ({out["fresh_rounds"]} rounds) | '
                   f'{fp[m]["median_s"]:.3f} s | {fp[m]["best_s"]:.3f} s | | '
                   f'{fp[m]["cpu_median_s"]:.3f} s |')
  lines.append('| ratios of medians, wall | ' + ', '.join(
      f'{k} {v:.2f}' for k, v in out['ratios'].items()) + ' | | | |')
  lines.append('| ratios of medians, CPU | ' + ', '.join(
      f'{k} {v:.2f}' for k, v in out['cpu_ratios'].items()) + ' | | | |')
  if 'fresh_ratios' in out:
    lines.append('| fresh process, wall | ' + ', '.join(
        f'{k} {v:.2f}' for k, v in out['fresh_ratios'].items()) + ' | | | |')
  return '\n'.join(lines)


if __name__ == '__main__':
  sys.exit(main())
