#!/usr/bin/env python3
"""``save()`` blocking with the node-local tier on against off, interleaved in one process
(the tier's bound: it may not make ``save()`` block more than 5% longer).

    .venv/bin/python benchmarks/save_blocking.py                  # 512 MiB, 8 devices, 12 pairs
    .venv/bin/python benchmarks/save_blocking.py --mib 256 --pairs 20 --json-out /tmp/b.json

One process with 8 CPU devices holds a state of ``--mib`` MiB (8 float32 arrays sharded over
the 8 devices) and saves it with an unchanged ``ocp.CheckpointManager`` into two local
directories, one with the tier on (a fresh tmpfs directory under /dev/shm) and one with it off
(``tier_dir='off'``). Each pair saves once into each (the order alternates from pair to pair, so
drift hits both alike), each save after the previous one finished, tier copy included. Reported:
the median, 10th and 90th percentile of ``save()`` blocking per mode and the ratio of medians
(on / off). The first pair is a warm-up and not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--mib', type=float, default=512.0, help='MiB of the state (8 arrays)')
  p.add_argument('--pairs', type=int, default=12, help='saves per mode (plus one warm-up each)')
  p.add_argument('--json-out', default=None)
  return p.parse_args(argv)


def _pct(xs, q):
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> int:
  args = parse_args(argv)
  os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  os.environ['JAX_PLATFORMS'] = 'cpu'
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax_pathways import options as options_lib  # pylint: disable=g-import-not-at-top
  from orbax_pathways.tier import store as tier_store  # pylint: disable=g-import-not-at-top

  work = tempfile.mkdtemp(prefix='orbax-pathways-bench-blocking-')
  shm = '/dev/shm' if os.path.isdir('/dev/shm') and os.access('/dev/shm', os.W_OK) else None
  tier_dir = tempfile.mkdtemp(prefix='orbax-pathways-bench-blocking-tier-', dir=shm)
  try:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ('d',))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('d'))
    rows = max(8, int(args.mib * (1 << 20) / 8 / 4 / 1024) // 8 * 8)
    state = {f'a{i}': jax.device_put(np.full((rows, 1024), i, np.float32), sharding)
             for i in range(8)}
    jax.block_until_ready(state)
    modes = {'on': options_lib.Options(tier_dir=tier_dir), 'off': options_lib.Options(tier_dir='off')}
    managers = {m: ocp.CheckpointManager(os.path.join(work, m),
                                         options=ocp.CheckpointManagerOptions(max_to_keep=2))
                for m in modes}
    blocking: dict[str, list[float]] = {m: [] for m in modes}
    for pair in range(args.pairs + 1):
      order = ('on', 'off') if pair % 2 == 0 else ('off', 'on')
      for mode in order:
        orbax_pathways.install(modes[mode])
        t0 = time.perf_counter()
        managers[mode].save(pair, args=ocp.args.StandardSave(state))
        dt = time.perf_counter() - t0
        managers[mode].wait_until_finished()
        tier_store.flush()  # the tier copy too: the next save starts on a quiet machine
        if pair:
          blocking[mode].append(dt)
    for m in managers.values():
      m.close()
    out = {'mib': args.mib, 'pairs': args.pairs, 'devices': jax.device_count(),
           'blocking_s': blocking,
           'median_s': {m: statistics.median(v) for m, v in blocking.items()},
           'p10_s': {m: _pct(v, 0.1) for m, v in blocking.items()},
           'p90_s': {m: _pct(v, 0.9) for m, v in blocking.items()}}
    out['ratio_on_off'] = out['median_s']['on'] / out['median_s']['off']
    print(f'| save() blocking, {args.mib:g} MiB, 8 CPU devices, {args.pairs} pairs | tier off | '
          'tier on | on / off |')
    print('|---|---:|---:|---:|')
    print(f'| median | {out["median_s"]["off"] * 1e3:.1f} ms | {out["median_s"]["on"] * 1e3:.1f} ms '
          f'| {out["ratio_on_off"]:.3f} |')
    print(f'| p10 .. p90 | {out["p10_s"]["off"] * 1e3:.1f} .. {out["p90_s"]["off"] * 1e3:.1f} ms | '
          f'{out["p10_s"]["on"] * 1e3:.1f} .. {out["p90_s"]["on"] * 1e3:.1f} ms | |')
    if args.json_out:
      with open(args.json_out, 'w', encoding='utf-8') as f:
        json.dump(out, f, indent=1)
  finally:
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(tier_dir, ignore_errors=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
