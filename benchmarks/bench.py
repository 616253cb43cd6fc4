#!/usr/bin/env python3
"""Stock Orbax ArrayHandler vs orbax_pathways' ProxyArrayHandler, same state, same machine.

One run alternates the two handlers (stock, ours, stock, ours, ...) for ``--reps`` repetitions and
prints a table plus JSON (stdout and ``--json-out``) with median / min of every metric and the
ratio ours/stock (< 1 means ours is faster / smaller). See benchmarks/README.md for the metrics.

    .venv/bin/python benchmarks/bench.py --quick              # smoke run, ~1-2 min on 2 cores
    .venv/bin/python benchmarks/bench.py --json-out out.json  # 2 GiB, 3 reps, mode cpu
    .venv/bin/python benchmarks/bench.py --mode gcs           # through fake-gcs-server
    .venv/bin/python benchmarks/bench.py --mode gpu           # default GPU backend, 8 GiB
    .venv/bin/python benchmarks/bench.py --profile restore_fewer  # + py-spy top-15 of ours

Peak RSS is measured in a separate subprocess per (handler, repetition) (this same file, run with
the private ``--_rss-worker`` flag), so allocator state of earlier runs does not leak into it.
The pieces live in ``benchmarks/benchlib/`` (one module per concern); this file runs them in order.
"""

from __future__ import annotations

import collections
import contextlib
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # `python benchmarks/bench.py` puts it there; an import may not
  sys.path.insert(0, HERE)

# None of these imports jax at import time: the platform is set in main() first.
from benchlib import IMPLS, cli, profiling, references, report, rss, storage  # noqa: E402
from benchlib.measure import run_main_rep  # noqa: E402
from benchlib.workloads import (build_state, device_bytes, jax_leaves, logical_bytes,  # noqa: E402
                                meshes, tiny_state)


def main(argv=None) -> int:
  args = cli.parse_args(argv, description=__doc__)
  cli.set_platform_env(args.mode)
  gcs_mod, gcs_note = (storage.import_gcs_server() if args.mode == 'gcs' else (None, None))
  if args.rss_worker:
    if args.mode == 'gcs' and gcs_mod is not None:
      gcs_mod.configure_fsspec_anon()
    rss.rss_worker(args)
    return 0
  if args.restore_worker:
    if args.mode == 'gcs' and gcs_mod is not None:
      gcs_mod.configure_fsspec_anon()
    rss.restore_worker(args)
    return 0
  if args.mode == 'gcs' and gcs_mod is None:
    print(f'--mode gcs: {gcs_note}; cannot run against fake-gcs-server.', file=sys.stderr)
    return 2

  with contextlib.ExitStack() as stack:
    notes = []
    store = storage.open_storage(stack, args.mode, args.dir, gcs_mod, notes)
    result = run(args, store, notes)
  report.print_report(result, args.json_out)
  return 0


def run(args, store: storage.Storage, notes: list) -> dict:
  """The whole benchmark on ``store``: state, warm-up, reps (+ RSS subprocesses), references,
  profile. Returns the JSON document (report.build_result)."""
  import jax
  cli.quiet_logs()
  import orbax.checkpoint  # noqa: F401  (Orbax first, then orbax_pathways, which installs ours)
  import orbax_pathways
  mesh, half = meshes(args.mode)
  if half is None:
    notes.append(f'{len(jax.devices())} device(s): no half mesh, restore onto fewer slices '
                 'and reshard bytes skipped')

  t_build = time.perf_counter()
  state = build_state(mesh, args.size_gb, args.seed)
  t_build = time.perf_counter() - t_build
  tiny = tiny_state(mesh, args.seed)
  meta = {
      'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'), 'mode': args.mode, 'reps': args.reps,
      'size_gb_arg': args.size_gb, 'logical_bytes': logical_bytes(state),
      'device_bytes': device_bytes(state), 'n_arrays': len(jax_leaves(state)),
      'devices': [str(d) for d in jax.devices()], 'mesh': dict(mesh.shape),
      'half_mesh': dict(half.shape) if half is not None else None, 'root': store.root,
      'hostname': platform.node(), 'nproc': os.cpu_count(), 'versions': report.versions(),
      'order': 'alternating: per rep, stock then ours (main metrics), then stock then ours '
               '(peak-RSS subprocess, then a restore of its step in another fresh process)', 'warmup_rounds': args.warmup,
      'state_build_s': t_build, 'notes': notes,
  }
  print(report.state_line(meta), flush=True)

  samples = {impl: collections.defaultdict(list) for impl in IMPLS}
  extras = {impl: [] for impl in IMPLS}
  rss_raw = {impl: [] for impl in IMPLS}
  t_all = time.perf_counter()
  for w in range(args.warmup):  # untimed: first-use costs (compilation, thread pools) of both
    for impl in IMPLS:
      t0 = time.perf_counter()
      res, _ = run_main_rep(impl, state, mesh, half, store, f'w{w}', 1, tiny)
      print(report.warmup_line(impl, res, time.perf_counter() - t0), flush=True)
  for rep in range(args.reps):
    for impl in IMPLS:
      t0 = time.perf_counter()
      res, extra = run_main_rep(impl, state, mesh, half, store, rep, args.tiny_iters, tiny)
      for k, v in res.items():
        samples[impl][k].extend(v if isinstance(v, list) else [v])
      extras[impl].append(extra)
      print(report.rep_line(rep, impl, res, time.perf_counter() - t0), flush=True)
    if not args.no_rss:
      for impl in IMPLS:
        r = rss.run_rss_subprocess(impl, args, store, rep)
        rss_raw[impl].append(r)
        for k in ('peak_rss_delta_bytes', 'peak_rss_over_state'):
          samples[impl][k].append(r[k])
        samples[impl]['cold_save_blocking_s'].append(r['save_blocking_s'])
        samples[impl]['cold_commit_s'].append(r['commit_s'])
        samples[impl]['cold_restore_s'].append(r['cold_restore_s'])
        print(report.rss_line(rep, impl, r), flush=True)
  meta['bench_s'] = time.perf_counter() - t_all

  d2h = None
  if args.d2h_ref:
    try:
      d2h = references.d2h_reference(state)
      notes.append('d2h_pinned_host_s: jax.device_put of every array to its sharding with '
                   "memory_kind='pinned_host', 2nd+ transfers")
    except Exception as e:  # pylint: disable=broad-except
      notes.append(f'pinned_host copy failed: {type(e).__name__}: {e}')

  disk = None
  if store.bucket is None:
    disk = references.disk_reference(store.root, logical_bytes(state))
    notes.append('disk_write_fsync_s: the state\'s logical bytes written in 16 MiB blocks to '
                 'one file in the checkpoint root and fsynced (dd conv=fsync)')

  profile = None
  if args.profile:
    try:
      profile = profiling.profile_metric(args.profile, args.profile_impl, state, mesh, half, tiny,
                                         store, args.profile_native)
    except Exception as e:  # pylint: disable=broad-except
      profile = {'error': f'{type(e).__name__}: {e}'}

  orbax_pathways.install()  # leave the process as `import orbax_pathways` left it
  return report.build_result(meta, samples, extras, rss_raw, d2h, disk, profile)


if __name__ == '__main__':
  sys.exit(main())
