#!/usr/bin/env python3
"""A storage save's commit on gs:// with a round trip per request, ours against stock Orbax,
interleaved in one process: how long from ``save()`` to the end of ``wait_until_finished()``,
and how many requests a save sends.

    .venv/bin/python benchmarks/commit_latency.py                 # 30 ms a request, 6 pairs
    .venv/bin/python benchmarks/commit_latency.py --latency-ms 30 --pairs 8 --json-out /tmp/c.json

Storage is fake-gcs-server (memory backend) behind ``tests/support/fault_proxy.py``, which holds
every response ``--latency-ms`` (a GCS round trip; the bytes move at loopback speed, so what is
measured is the protocol's round trips one after another, not bandwidth). One process with 8 CPU
devices saves a state of ``--arrays`` float32 arrays (``--mib`` MiB in all, sharded over the 8
devices) with an unchanged ``ocp.CheckpointManager``: stock Orbax's handler
(``orbax_pathways.uninstall()``) and ours (``install()``, default options) by turns, the order
alternating from pair to pair. Each pair saves step 0 into a fresh directory per handler (not
timed: the directory's first save also writes Orbax's root metadata), then step 1, timed and
counted. Reported: medians of ``save()`` blocking, of the commit (``save()`` called to
``wait_until_finished()`` returned) and of the requests of step 1's save, per handler, and the
ratios ours / stock. Timings are wall clock on a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import handlers  # noqa: E402  pylint: disable=wrong-import-position
from benchlib import storage as benchlib_storage  # noqa: E402  pylint: disable=wrong-import-position


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--latency-ms', type=float, default=30.0, help='held per response')
  p.add_argument('--pairs', type=int, default=6, help='timed saves per handler')
  p.add_argument('--arrays', type=int, default=8)
  p.add_argument('--mib', type=float, default=8.0, help='MiB of the state in all')
  p.add_argument('--json-out', default=None)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  os.environ['JAX_PLATFORMS'] = 'cpu'
  with benchlib_storage.capped_gcs(None, args.latency_ms / 1000) as (server, proxy):
    bucket = server.new_bucket('commit')
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ('d',))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('d'))
    rows = max(8, int(args.mib * (1 << 20) / args.arrays / 4 / 256) // 8 * 8)
    state = {f'w{i:02d}': jax.device_put(np.full((rows, 256), i, np.float32), sharding)
             for i in range(args.arrays)}
    results: dict[str, dict[str, list[float]]] = {
        impl: {'blocking_s': [], 'commit_s': [], 'requests': []} for impl in ('stock', 'ours')}
    for pair in range(args.pairs):
      for impl in (('stock', 'ours') if pair % 2 == 0 else ('ours', 'stock')):
        handlers.use_handler(impl)
        path = f'gs://{bucket}/{impl}-{pair}-{uuid.uuid4().hex[:6]}'
        with ocp.CheckpointManager(path) as m:
          m.save(0, args=ocp.args.StandardSave(state))
          m.wait_until_finished()
          proxy.reset_stats()
          t0 = time.perf_counter()
          m.save(1, args=ocp.args.StandardSave(state))
          t1 = time.perf_counter()
          m.wait_until_finished()
          t2 = time.perf_counter()
          requests = proxy.stats()['requests']
        r = results[impl]
        r['blocking_s'].append(t1 - t0)
        r['commit_s'].append(t2 - t0)
        r['requests'].append(requests)
        print(f'pair {pair} {impl}: blocking {t1 - t0:.3f} s, commit {t2 - t0:.3f} s, '
              f'{requests} requests', flush=True)
    med = {impl: {k: statistics.median(v) for k, v in r.items()} for impl, r in results.items()}
    ratios = {k: med['ours'][k] / med['stock'][k] for k in ('blocking_s', 'commit_s', 'requests')}
    print(f'\n{args.arrays} arrays, {args.mib:g} MiB, 8 devices, {args.latency_ms:g} ms a '
          f'request, {args.pairs} pairs (medians)')
    print(f'{"":8}{"save() blocks":>15}{"commit":>10}{"requests":>10}')
    for impl in ('stock', 'ours'):
      m_ = med[impl]
      print(f'{impl:8}{m_["blocking_s"]:>13.3f} s{m_["commit_s"]:>8.3f} s'
            f'{m_["requests"]:>10.0f}')
    print(f'{"ours/stock":8}{ratios["blocking_s"]:>14.2f}x{ratios["commit_s"]:>9.2f}x'
          f'{ratios["requests"]:>9.2f}x')
    if args.json_out:
      with open(args.json_out, 'w') as f:
        json.dump({'args': vars(args), 'runs': results, 'medians': med, 'ratios': ratios}, f,
                  indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
