#!/usr/bin/env python3
"""Survivor-first restore against storage-only: 4 processes as 4 slices on gs://, one slice lost,
restore onto 3.

    .venv/bin/python benchmarks/tier.py                      # 48 MiB per state, 32 MiB/s storage
    .venv/bin/python benchmarks/tier.py --mib 96 --bandwidth-mib 64 --json-out /tmp/tier.json

Storage is fake-gcs-server (in memory) behind ``tests/support/fault_proxy.py`` with its
bandwidth cap (all connections together, both directions), so storage is slower than node-local
memory as in production. Each state (4 float32 arrays of ``--mib``/4 MiB) runs twice, each on a
mesh (slices, 2) with one slice per process:

- ``replicated``: ``P(None, 'd')``: every slice holds the whole state (split over its 2 devices);
- ``sharded``: ``P('slice', 'd')``: each slice holds a quarter.

Per state: 4 ``jax.distributed`` processes (2 CPU devices each, each its own node-local tier
directory) save steps 1-3 with the tier off, then on, then off and on again, each round into a
root of its own (``save()`` blocking of steps 2 and 3, after the previous save finished; the
survivor-first restore reads the first 'on' root); the tier directory of process 3 is deleted
(the lost slice); 3 processes restore step 3 (mesh (3, 2), same specs) once with the tier off
(storage only) and once survivor-first. Reported: bytes read from storage (array bytes the
restores counted, and every body byte through the proxy), restore seconds (slowest process,
between two barriers), host memory used by the tiers (their files: tmpfs is memory), and the
bytes only the lost host held (what its tier held: each chunk is in exactly one host's tier).

Timings are wall clock on a shared machine; compare within one run. Values read back are
checked against the saved ones in every process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import storage as benchlib_storage  # noqa: E402  pylint: disable=wrong-import-position
REPO = os.path.dirname(HERE)
TESTS = os.path.join(REPO, 'tests')
MiB = 1 << 20

WORKER = r'''
import dataclasses, json, os, sys, time
from support import mp_worker
mp_worker.init()
import jax, numpy as np
import orbax.checkpoint as ocp
import orbax_pathways
from orbax_pathways import stats
from jax.experimental import multihost_utils

P = jax.sharding.PartitionSpec
mode, root, kind, mib = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
rows = max(12, int(mib * (1 << 20) / 4 / 4 / 1024) // 12 * 12)
host = {f'a{i}': (np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024) + i) for i in range(4)}
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(jax.process_count(), 2), ('slice', 'd'))
spec = P(None, 'd') if kind == 'replicated' else P('slice', 'd')
sharding = jax.sharding.NamedSharding(mesh, spec)
options = orbax_pathways.Options.from_env()
opts = ocp.CheckpointManagerOptions(max_to_keep=1)

if mode == 'save':
  state = {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i]) for k, v in host.items()}
  out = {'off': [], 'on': []}
  for rnd, tier in enumerate(('off', 'on', 'off', 'on')):  # interleaved: drift hits both alike
    orbax_pathways.install(options if tier == 'on' else dataclasses.replace(options, tier_dir='off'))
    with ocp.CheckpointManager(f'{root}/{tier}{"" if rnd < 2 else "2"}', options=opts) as m:
      for step in (1, 2, 3):
        m.wait_until_finished()
        multihost_utils.sync_global_devices(f'save{rnd}{step}')
        t0 = time.perf_counter()
        m.save(step, args=ocp.args.StandardSave(state))
        if step > 1:  # the first save of a manager also builds plans and opens storage
          out[tier].append(time.perf_counter() - t0)
      m.wait_until_finished()
  tier_bytes = 0
  for d, _, files in os.walk(os.environ['ORBAX_PATHWAYS_TIER_DIR']):  # two roots: halve below
    tier_bytes += sum(os.path.getsize(os.path.join(d, f)) for f in files if f.endswith('.bin'))
  share = sum(s.data.nbytes for a in state.values() for s in a.addressable_shards)
  mp_worker.emit({'blocking_off': out['off'], 'blocking_on': out['on'], 'tier_bytes': tier_bytes // 2,
                  'device_bytes': share})
else:
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in host.items()}
  with ocp.CheckpointManager(f'{root}/on', options=opts) as m:
    multihost_utils.sync_global_devices('before')
    t0 = time.perf_counter()
    out = m.restore(3, args=ocp.args.StandardRestore(target))
    jax.block_until_ready(out)
    local_s = time.perf_counter() - t0
    multihost_utils.sync_global_devices('after')
    wall = time.perf_counter() - t0
  for k, v in host.items():
    for s in out[k].addressable_shards:
      np.testing.assert_array_equal(np.asarray(s.data), v[s.index])
  st = stats.last_restore()
  mp_worker.emit({'restore_s': wall, 'own_s': local_s, 'bytes_by_source': st.bytes_by_source,
                  'seconds_by_source': st.seconds_by_source})
'''


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--mib', type=float, default=48.0, help='MiB of each state (4 arrays)')
  p.add_argument('--bandwidth-mib', type=float, default=32.0,
                 help='storage bandwidth cap, MiB/s, all connections together')
  p.add_argument('--kinds', default='replicated,sharded')
  p.add_argument('--scope', choices=('written', 'held'), default='written',
                 help="Options.tier_scope of the saves: what each node's tier keeps")
  p.add_argument('--json-out', default=None)
  p.add_argument('--timeout', type=float, default=900, help='seconds per multi-process run')
  return p.parse_args(argv)


def _tier_base() -> str:
  base = '/dev/shm' if os.path.isdir('/dev/shm') and os.access('/dev/shm', os.W_OK) else None
  return tempfile.mkdtemp(prefix='orbax-pathways-bench-tier-', dir=base)


def _run(run_processes, n, args, env, per_env, timeout):
  res = run_processes(WORKER, n, 2, args=args, env=env, per_process_env=per_env,
                      timeout=timeout, init_timeout=300)
  return [r.result for r in res]


def one_kind(kind, args, bucket, proxy, run_processes) -> dict:
  root = f'gs://{bucket}/{kind}'
  base = _tier_base()
  tiers = [os.path.join(base, f'node{i}') for i in range(4)]
  env = {'ORBAX_PATHWAYS_TIER_PEER_TIMEOUT_S': '30', 'TF_CPP_MIN_LOG_LEVEL': '2',
         'ORBAX_PATHWAYS_TIER_SCOPE': args.scope}
  try:
    proxy.reset_stats()
    t0 = time.perf_counter()
    saved = _run(run_processes, 4, ['save', root, kind, args.mib], env,
                 [{'ORBAX_PATHWAYS_TIER_DIR': t} for t in tiers], args.timeout)
    save_wall = time.perf_counter() - t0
    # 'written': each chunk sits in exactly one host's tier. 'held': replicas sit in several;
    # what only the lost host held is then its share of what no survivor's devices hold.
    lost_only = saved[3]['tier_bytes'] if args.scope == 'written' else None
    shutil.rmtree(tiers[3])
    out = {'kind': kind, 'mib': args.mib, 'scope': args.scope, 'save_run_s': save_wall,
           'save_blocking_off_s': sorted(b for s in saved for b in s['blocking_off']),
           'save_blocking_on_s': sorted(b for s in saved for b in s['blocking_on']),
           'tier_bytes_per_host': [s['tier_bytes'] for s in saved],
           'device_bytes_per_host': [s['device_bytes'] for s in saved],
           'lost_host_only_bytes': lost_only}
    for mode, tier_dirs in (('storage_only', ['off'] * 3), ('survivor_first', tiers[:3])):
      proxy.reset_stats()
      res = _run(run_processes, 3, ['restore', root, kind, args.mib], env,
                 [{'ORBAX_PATHWAYS_TIER_DIR': d} for d in tier_dirs], args.timeout)
      by_source: dict[str, int] = {}
      for r in res:
        for k, v in r['bytes_by_source'].items():
          by_source[k] = by_source.get(k, 0) + v
      out[mode] = {'restore_s': max(r['restore_s'] for r in res),
                   'own_s': [r['own_s'] for r in res], 'bytes_by_source': by_source,
                   'per_process': [r['bytes_by_source'] for r in res],
                   'proxy_response_bytes': proxy.stats()['response_bytes']}
    return out
  finally:
    shutil.rmtree(base, ignore_errors=True)


def _median(xs):
  xs = sorted(xs)
  return xs[len(xs) // 2] if xs else float('nan')


def table(results, args) -> str:
  lines = [f'| {args.mib:g} MiB per state, storage capped at {args.bandwidth_mib:g} MiB/s, '
           f'4 slices, 1 lost, restore onto 3, tier_scope={args.scope} | storage-only | '
           'survivor-first | ratio |',
           '|---|---:|---:|---:|']
  for r in results:
    so, sf = r['storage_only'], r['survivor_first']
    s_bytes, f_bytes = so['bytes_by_source'].get('storage', 0), sf['bytes_by_source'].get('storage', 0)
    lines += [
        f'| **{r["kind"]}**: array bytes read from storage (all processes) | '
        f'{s_bytes / MiB:.1f} MiB | {f_bytes / MiB:.1f} MiB | {f_bytes / max(s_bytes, 1):.2f} |',
        f'| {r["kind"]}: body bytes through the storage proxy | '
        f'{so["proxy_response_bytes"] / MiB:.1f} MiB | {sf["proxy_response_bytes"] / MiB:.1f} MiB | '
        f'{sf["proxy_response_bytes"] / max(so["proxy_response_bytes"], 1):.2f} |',
        (f'| {r["kind"]}: bytes only the lost host held (its tier) | | '
         f'{r["lost_host_only_bytes"] / MiB:.1f} MiB | storage / that: '
         f'{f_bytes / max(r["lost_host_only_bytes"], 1):.2f} |')
        if r['lost_host_only_bytes'] is not None else
        f'| {r["kind"]}: bytes only the lost host held | | (see the written-scope run) | |',
        f'| {r["kind"]}: survivor-first bytes by source | | ' + ', '.join(
            f'{k} {v / MiB:.1f} MiB' for k, v in sorted(sf['bytes_by_source'].items())) + ' | |',
        f'| {r["kind"]}: restore seconds (slowest process) | {so["restore_s"]:.2f} s | '
        f'{sf["restore_s"]:.2f} s | {sf["restore_s"] / so["restore_s"]:.2f} |',
        f'| {r["kind"]}: host memory used by the tier, per host (its device share) | | ' + ', '.join(
            f'{t / MiB:.1f}' for t in r['tier_bytes_per_host']) + ' MiB (' + ', '.join(
            f'{d / MiB:.1f}' for d in r['device_bytes_per_host']) + ' MiB) | |',
        f'| {r["kind"]}: save() blocking, median of 16 (steps 2-3, 2 rounds, 4 processes), tier off / on | '
        f'{_median(r["save_blocking_off_s"]) * 1e3:.0f} ms | '
        f'{_median(r["save_blocking_on_s"]) * 1e3:.0f} ms | '
        f'{_median(r["save_blocking_on_s"]) / _median(r["save_blocking_off_s"]):.2f} |',
    ]
  return '\n'.join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  sys.path.insert(0, TESTS)
  from support.mp_harness import run_processes  # pylint: disable=import-outside-toplevel
  with benchlib_storage.capped_gcs(args.bandwidth_mib * MiB) as (server, proxy):
    results = []
    for kind in args.kinds.split(','):
      bucket = server.new_bucket('tier')
      t0 = time.perf_counter()
      results.append(one_kind(kind, args, bucket, proxy, run_processes))
      print(f'{kind}: {time.perf_counter() - t0:.0f} s', file=sys.stderr, flush=True)
    print(table(results, args))
    if args.json_out:
      with open(args.json_out, 'w', encoding='utf-8') as f:
        json.dump({'args': vars(args), 'date': time.strftime('%Y-%m-%d'), 'results': results}, f,
                  indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
