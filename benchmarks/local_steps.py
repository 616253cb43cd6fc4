#!/usr/bin/env python3
"""Multi-tier checkpointing against storage-only: steps lost and time to resume after
every process is killed, and what a save costs the training loop.

    .venv/bin/python benchmarks/local_steps.py                      # 32 MiB per process
    .venv/bin/python benchmarks/local_steps.py --mib 64 --json-out /tmp/local_steps.json
    .venv/bin/python benchmarks/local_steps.py --lose-node --modes multi_tier,multi_tier_copies
    .venv/bin/python benchmarks/local_steps.py --train-only --modes multi_tier,multi_tier_copies \
        --mib 256 --step-s 1 --local-every 1 --storage-every 1000 --steps 12   # the overhead

Storage is fake-gcs-server (in memory) behind ``tests/support/fault_proxy.py`` with its bandwidth
cap (all connections together), so storage is slower than node-local memory as in production;
``--latency-ms`` also holds every response that long (a GCS round trip; 0: loopback's).
4 ``jax.distributed`` processes (2 CPU devices each, one node-local tier directory each) train a
state sharded over all 8 devices (``--mib`` per process) for ``--steps`` steps of ``--step-s``
seconds each (a sleep: the CPU stays free for the background commits), with an unchanged
``CheckpointManager`` saving to storage every ``--storage-every`` steps, and then stop without
a final save: every process exits right after its last ``save()`` returned on all of them, inside
the manager's block (no ``close()``, which would wait for the saves still committing), as at a
kill. Each mode of ``--modes`` is run in turn (``--runs K`` times each, a summary per mode
after the table: the storage steps committed at the kill, the steps resumed and lost, and the
restart's ``latest_step()`` / ``restore()`` or ``preemption.resume`` alone):

- ``storage_only``: ``local_save_interval_steps=0`` and no node-local tier (``tier_dir='off'``):
  every restore reads storage, as stock Orbax does;
- ``multi_tier``: ``local_save_interval_steps=--local-every``, a tier per process;
- ``multi_tier_copies``: the same with ``local_copies=2`` (each process a slice: process i's
  share also kept by process i+1);
- ``multi_tier_nodes``: ``multi_tier`` with ``local_steps_in='nodes'``: each process saves its
  part of a local-only step alone into its node (no storage request, no barrier);
- ``multi_tier_nodes_copies``: the same with ``local_copies=2`` (each node step copied into the
  partner's node).

Then 4 fresh processes (3 with ``--lose-node``: the 4th node and its tier gone; 4 with
``--replace-node``: the 4th node's tier gone, a new node in its place) run
``preemption.resume`` and one training step. ``--leaves N`` splits the state's rows into N arrays (a model's leaves: per-array work on
storage shows with many). ``--layout replicated`` (and ``--api emergency``,
whose slices are replicas) splits the state over each slice's devices only instead of over every
device: every process then holds and saves all of it, 4 x ``--mib``. Reported per mode: the
step resumed from and the steps lost, seconds from the resume call to the end of the first step
after it (slowest process, between barriers), bytes read from storage, and the training loop's
mean step time against the step time with no checkpointing (``--steps`` steps, measured in the
same processes before the saving runs).

``--train-only``: no restart; the tables are the overhead of saving on the training loop: the
step time with saves minus the bare step time (each step: the sleep, then the step's new state
built on the devices; ``--api v1``: saved through Orbax v1's ``training.Checkpointer`` instead of
a v0 ``CheckpointManager``), against the overhead goal: the device-to-host snapshot plus 5% of
the bare step. The snapshot is the save's own part of the loop's ``save()``
(``stats.SaveStats.loop_snapshot_s`` for a local-only save in the background, the serialize's
``blocking_s`` otherwise), mean over processes; the rest of ``save()``'s blocking is waiting (for
the previous save, for a barrier). First over steps 2 on (Orbax's policy saves the first step
to storage, and the loop waits for that save's commit, untimed, before step 2), then over the
steady state after the tier's warm-up (``warm_up_steps``: the first local-only saves allocate
the tier's memory; a run trains for far longer than they last), with the warm-up saves' own
writes listed. Process 0's Orbax duration events over the saving loop (``jax.monitoring``:
where ``save()`` and the background commit spend their time) close the report.

Memory: ``--values noise`` gives the state about as little to compress as trained weights
(the default, an arange, shrinks several times under the zstd Orbax's stock saves use, and
node steps keep float chunks raw so that a restore maps them); ``--tier-parent`` puts each
process's tier (node steps, and stock's ``local_directory``) on a local disk instead of
``/dev/shm``, for states whose steps do not fit beside the processes in this machine's memory.

Timings are wall clock on a shared machine; compare within one run. The resumed state is checked
against the values of the step it came from in every process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import storage as benchlib_storage  # noqa: E402  pylint: disable=wrong-import-position
REPO = os.path.dirname(HERE)
TESTS = os.path.join(REPO, 'tests')
MiB = 1 << 20
MODES = ('storage_only', 'multi_tier', 'multi_tier_copies', 'multi_tier_nodes',
         'multi_tier_nodes_copies', 'stock')

WORKER = os.path.join(HERE, 'local_steps_worker.py')  # one process of a run


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--mib', type=float, default=32.0,
                 help='MiB of state per process when it is sharded over every device: the '
                      'state is 4 x MIB in all; with --layout replicated (and --api emergency) '
                      'every process holds all of it')
  p.add_argument('--steps', type=int, default=96, help='steps trained before the kill')
  p.add_argument('--step-s', type=float, default=0.1, help='seconds of one training step')
  p.add_argument('--storage-every', type=int, default=50)
  p.add_argument('--local-every', type=int, default=10)
  p.add_argument('--bandwidth-mib', type=float, default=64.0,
                 help='storage bandwidth cap, MiB/s, all connections together')
  p.add_argument('--layout', choices=('sharded', 'replicated'), default='sharded',
                 help="the state: split over every device, or over each slice's devices")
  p.add_argument('--lose-node', action='store_true',
                 help='restart on 3 processes, the 4th node (and its tier) gone')
  p.add_argument('--replace-node', action='store_true',
                 help='restart on 4 processes, the 4th node\'s tier gone (a new node)')
  p.add_argument('--modes', default='storage_only,multi_tier',
                 help='comma-separated: storage_only, multi_tier, multi_tier_copies '
                      '(multi_tier with local_copies=2: a partner of another slice keeps a '
                      'second copy of each share), multi_tier_nodes (multi_tier with '
                      "local_steps_in='nodes'), multi_tier_nodes_copies (and local_copies=2)")
  p.add_argument('--train-only', action='store_true',
                 help='no restart: the training loop\'s step time only (the overhead run)')
  p.add_argument('--latency-ms', type=float, default=0.0,
                 help='each storage response held this long by the proxy (a GCS round trip)')
  p.add_argument('--when-busy', choices=('wait', 'skip'), default='wait',
                 help='Options.local_save_when_busy: a local save due while the previous one '
                 'still commits waits for it or is skipped')
  p.add_argument('--update', choices=('device', 'host'), default='host',
                 help="how each step builds its new state: 'host' (numpy on the host, then a "
                 "transfer to the devices: host CPU an accelerator host does not spend) or "
                 "'device' (a jitted add on the devices, as a training step's update); the same "
                 'values either way')
  p.add_argument('--api', choices=('v0', 'v1', 'emergency'), default='v0',
                 help="v0: an unchanged CheckpointManager; v1: Orbax v1's training.Checkpointer; "
                      "emergency: Orbax's emergency CheckpointManager as MaxText builds it "
                      '(replicated layout; modes stock, multi_tier, multi_tier_nodes[_copies])')
  p.add_argument('--leaves', type=int, default=1,
                 help="the state's rows split into this many arrays (a model's leaves): a "
                 "local-only save's per-array work on storage shows with many")
  p.add_argument('--runs', type=int, default=1,
                 help='train, kill and restart each mode this many times (a summary per mode '
                      'follows the table: the storage steps committed at the kill, the steps '
                      'resumed, steps lost, restore seconds)')
  p.add_argument('--values', choices=('arange', 'noise'), default='arange',
                 help="the state's values: arange (r * 1024 + c, which zstd shrinks several "
                      "times: Orbax's default compression makes stock's copies small) or noise "
                      '(a hashed mantissa in [1, 2), about as compressible as trained weights)')
  p.add_argument('--tier-parent', default=None,
                 help='where each process\'s tier directory is made (default /dev/shm: node '
                      'memory); a local disk path keeps the steps in the page cache instead')
  p.add_argument('--json-out', default=None)
  p.add_argument('--timeout', type=float, default=900, help='seconds per multi-process run')
  return p.parse_args(argv)


class _StorageCpu:
  """Samples, every 0.2 s, the CPU time (user + system) of the storage emulation that runs on
  this machine's cores beside the training processes: fake-gcs-server's process and this
  process (the bandwidth-capped proxy's threads). ``between(t0, t1)``: its CPU in that wall
  window (the workers' steady state)."""

  def __init__(self, server_pid: int | None):
    self._pid = server_pid
    self._samples: list[tuple[float, float]] = []
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)

  def _now(self) -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    cpu = ru.ru_utime + ru.ru_stime
    if self._pid:
      try:
        with open(f'/proc/{self._pid}/stat', encoding='ascii') as f:
          fields = f.read().rsplit(')', 1)[1].split()
        cpu += (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')
      except (OSError, IndexError, ValueError):
        pass
    return cpu

  def _loop(self) -> None:
    while not self._stop.wait(0.2):
      self._samples.append((time.time(), self._now()))

  def __enter__(self) -> '_StorageCpu':
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()

  def between(self, t0: float, t1: float) -> float | None:
    inside = [c for t, c in self._samples if t0 <= t <= t1]
    return inside[-1] - inside[0] if len(inside) >= 2 else None


def _run(run_processes, args, mode, root, env, tiers):
  res = run_processes(WORKER, len(tiers), 2, timeout=args.timeout, init_timeout=300, env=env,
                      args=[mode, root, str(args.mib), str(args.steps), str(args.step_s),
                            str(args.storage_every), args.layout,
                            'train_only' if args.train_only else 'restart', args.update,
                            args.api, str(args.leaves), str(args.local_every)],
                      per_process_env=[{'ORBAX_PATHWAYS_TIER_DIR': t} for t in tiers])
  return [r.result for r in res]


def _uploads(entries) -> list[str]:
  """The object writes among the proxy's log entries (method, target, agent): their targets,
  unquoted (a JSON API upload names its object in the query)."""
  return [urllib.parse.unquote(t) for m, t, _ in entries
          if m in ('POST', 'PUT') and ('upload' in t or '/o/' in t or m == 'PUT')]


def one_mode(mode, args, bucket, run_processes, server_pid=None, proxy=None) -> dict:
  root = f'gs://{bucket}/{mode}'
  parent = args.tier_parent or ('/dev/shm' if os.access('/dev/shm', os.W_OK) else None)
  tiers = [tempfile.mkdtemp(prefix=f'orbax-pathways-bench-{mode}-{i}-', dir=parent)
           for i in range(4)]
  tiered = mode != 'storage_only'
  env = {# stock: Orbax alone (the package imported, nothing installed)
         'ORBAX_PATHWAYS_DISABLE': '1' if mode == 'stock' else '0',
         # the emergency manager's local interval is its own (LocalCheckpointOptions)
         'ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS': str(
             args.local_every if tiered and args.api != 'emergency' else 0),
         'ORBAX_PATHWAYS_LOCAL_COPIES': '2' if mode.endswith('_copies') else '1',
         'ORBAX_PATHWAYS_LOCAL_SAVE_WHEN_BUSY': args.when_busy,
         'ORBAX_PATHWAYS_BENCH_VALUES': args.values,
         'ORBAX_PATHWAYS_LOCAL_STEPS_IN': ('nodes' if mode.startswith('multi_tier_nodes')
                                           else 'storage')}
  per_tier = list(tiers) if tiered else ['off'] * 4  # storage only: no tier at all
  try:
    logged = len(proxy.log()) if proxy is not None else 0
    with _StorageCpu(server_pid) as storage_cpu:
      train = _run(run_processes, args, 'train', root, env, per_tier)
    entries = proxy.log()[logged:] if proxy is not None else []
    if args.replace_node and tiered:  # a new node: its tier directory empty
      shutil.rmtree(tiers[3])
      os.mkdir(tiers[3], 0o700)
    resume = [] if args.train_only else _run(run_processes, args, 'resume', root, env,
                                              per_tier[:3] if args.lose_node else per_tier)
  finally:
    for t in tiers:
      shutil.rmtree(t, ignore_errors=True)
  out = {
      'mode': mode,
      'step_s': max(t['step_s'] for t in train), 'bare_step_s': max(t['bare_step_s'] for t in train),
      'blocking_max_s': max(t['blocking_max_s'] for t in train),
      'blocking_mean_s': max(t['blocking_mean_s'] for t in train),
      'blocking_s': [t.get('blocking_s') for t in train],  # per process, steps 2..
      # the saves' own part of save() (the snapshot), mean over processes and steps 2..
      'snapshot_s': (sum(sum(t['snapshot_s']) for t in train)
                     / sum(len(t['snapshot_s']) for t in train)
                     if all(t.get('snapshot_s') for t in train) else None),
      'write_s': [t.get('write_s') for t in train],  # per process, steps 2..: [s] or []
      'last_save': train[0].get('last') or {},  # process 0's last save: snapshot, write, commit
      # process 0's Orbax duration events over the saving loop: {name: [total s, count]}
      'events': train[0].get('events') or {},
      # CPU seconds per step and process (user + system, every thread), mean over processes
      'bare_cpu_s': sum(t['bare_cpu_s'] for t in train) / len(train),
      'cpu_s': (sum(t['cpu_s'] for t in train) / len(train)
                if all(t.get('cpu_s') is not None for t in train) else None),
      'peak_rss_mib': max(t.get('peak_rss_mib', 0) for t in train),  # the largest process's
      'local_saves': train[0].get('local_saves'),  # process 0's (every process skips alike)
      'copies_held': [t.get('copies_held') for t in train],  # per process, at the end
      # storage requests of the training run (every process, the loop and its background
      # saves), and the objects written for local-only steps (their hidden step directory),
      # per local-only step of the run
      'requests': len(entries),
      'local_objects_per_step': (
          sum(1 for t in _uploads(entries) if '.orbax-pathways-local' in t)
          / max(1, sum(1 for k in range(args.steps)
                       if args.local_every and k % args.local_every == 0
                       and k % args.storage_every != 0)) if proxy is not None else None),
  }
  if args.train_only and all(t.get('ends') and t.get('snapshot_s') is not None for t in train):
    out.update(_steady(train, args))
  windows = [t.get('steady') for t in train]
  if all(windows):  # the steady state every process was in: fake-gcs-server and the proxy
    t0, t1 = max(w[0] for w in windows), min(w[1] for w in windows)
    used = storage_cpu.between(t0, t1)
    n_steps = (t1 - t0) * min(w[2] / max(1e-9, w[1] - w[0]) for w in windows)
    out['storage_cpu_s'] = used / n_steps if used is not None and n_steps > 0 else None
  if resume:
    steps = {r['step'] for r in resume}
    assert len(steps) == 1, steps
    step = steps.pop()
    out.update({
        'resumed_step': step,
        'steps_lost': (args.steps - 1) - (step if step is not None else -1),
        'resume_s': max(r['resume_s'] for r in resume),
        'restore_s': max(r['restore_s'] for r in resume),  # the slowest process's
        'storage_steps_at_restart': resume[0]['storage_steps'],
        'storage_bytes': (None if any(r['bytes_by_source'] is None for r in resume) else
                          sum(r['bytes_by_source'].get('storage', 0) for r in resume))})
  return out


def warm_up_steps(args) -> int:
  """The last step of the tier's warm-up: until ``tier_keep + 1`` local-only saves were made,
  no entry has been dropped, so every save writes its copy into newly allocated memory (no
  spare pages to write over, ``tier/spares.py``), and the save after the last of them may wait
  for its write. The steady state is every step after this one (0: no local-only saves).
  Counted as if every local step due were saved: with ``--when-busy skip`` the warm-up's last
  fresh save can fall a step or two later, on steps the loop does not wait for."""
  keep = int(os.environ.get('ORBAX_PATHWAYS_TIER_KEEP', '1'))
  local = [k for k in range(2, args.steps + 1) if args.local_every and k % args.local_every == 0]
  return local[keep + 1] if len(local) > keep + 1 else 0


def _steady(train, args) -> dict:
  """The loop after the tier's warm-up (``warm_up_steps``): step time, save() blocking, the
  saves' own part of it (the snapshot), the background writes and CPU per step, slowest
  process for the clock, mean of processes for CPU; and the warm-up's own steps alike."""
  last = warm_up_steps(args)
  if not last or last >= args.steps - 2:
    return {}
  n = args.steps - last  # steps last+1 .. steps; ends[i] is step i + 1's
  step = max((t['ends'][-1] - t['ends'][last - 1]) / n for t in train)
  warm = max((t['ends'][last - 1] - t['ends'][0]) / (last - 1) for t in train)
  cpu = sum((t['cpus'][-1] - t['cpus'][last - 1]) / n for t in train) / len(train)
  blocking = [b for t in train for b in t['blocking_s'][last - 1:]]  # blocking_s[0]: step 2
  snap = [x for t in train for x in t['snapshot_s'][last - 1:]]
  writes = [w[0] for t in train for w in (t.get('write_s') or [])[last - 1:] if w]
  return {'warm_up_last_step': last, 'steady_step_s': step, 'warm_up_step_s': warm,
          'steady_cpu_s': cpu, 'steady_blocking_mean_s': sum(blocking) / len(blocking),
          'steady_blocking_max_s': max(blocking), 'steady_snapshot_s': sum(snap) / len(snap),
          'steady_write_s': sum(writes) / len(writes) if writes else None,
          'warm_up_write_s': [w[0] for w in (train[0].get('write_s') or [])[:last - 1] if w]}


def held_mib(args) -> float:
  """MiB of state each process holds and saves: ``--mib``, or the whole state (4 x ``--mib``)
  where every slice holds all of it."""
  return args.mib * (4 if args.layout == 'replicated' else 1)


def table(results, args) -> str:
  lines = [f'4 processes x 2 CPU devices, {held_mib(args):g} MiB of state held per process '
           f'({4 * args.mib:g} MiB in all, {args.layout}'
           + (f', {args.leaves} arrays' if args.leaves > 1 else '') + '), '
           + ("Orbax v1's training.Checkpointer, " if args.api == 'v1' else '')
           + ("Orbax's emergency CheckpointManager as MaxText builds it (stock: Orbax "
              "alone, ORBAX_PATHWAYS_DISABLE=1), " if args.api == 'emergency' else '') +
           f'{args.steps} steps of {args.step_s:g} s (state update on the {args.update}), '
           f'storage every {args.storage_every}, local '
           f'every {args.local_every}, gs:// at {args.bandwidth_mib:g} MiB/s'
           + (f' and {args.latency_ms:g} ms per request' if args.latency_ms else '') + '; '
           + ('no restart' if args.train_only else
              f'restart on {3 if args.lose_node else 4} processes'
              + (' (node 4 lost)' if args.lose_node else '')
              + (' (node 4 replaced by a new one)' if args.replace_node else '')), '']
  if args.train_only:
    lines += [f'Steps 2-{args.steps} (the warm-up included). Goal: the device-to-host snapshot '
              "(the save's own part of the loop's save(), mean) plus 5% of the bare step.", '',
              '| mode | bare step (s) | step with saves (s) | overhead (s) | save() blocking mean '
              '/ max (s) | snapshot (s) | goal (s) | met |',
              '|---|---:|---:|---:|---:|---:|---:|---|']
    for r in results:
      over = r['step_s'] - r['bare_step_s']
      snap = r.get('snapshot_s')
      goal = None if snap is None else snap + 0.05 * r['bare_step_s']
      lines.append(f"| {r['mode']} | {r['bare_step_s']:.3f} | {r['step_s']:.3f} | {over:.3f} | "
                   f"{r['blocking_mean_s']:.3f} / {r['blocking_max_s']:.3f} | "
                   + ('- | - | - |' if goal is None else
                      f"{snap:.3f} | {goal:.3f} | {'yes' if over <= goal else 'no'} |"))
    lines.append('')
    if any(r.get('steady_step_s') for r in results):
      lines += [f'The steady state: steps {warm_up_steps(args) + 1}-{args.steps}, after the '
                "tier's warm-up (its first local-only saves write into newly allocated memory: "
                'no dropped entry to write over yet). Goal: the snapshot (the saves\' own part '
                'of save(), mean) plus 5% of the bare step.', '',
                '| mode | bare step (s) | warm-up step (s) | steady step (s) | steady overhead (s) '
                '| save() blocking mean / max (s) | snapshot (s) | goal (s) | met | background '
                'write (s) | CPU per step, added (s) |',
                '|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|']
      for r in results:
        if not r.get('steady_step_s'):
          continue
        over = r['steady_step_s'] - r['bare_step_s']
        goal = r['steady_snapshot_s'] + 0.05 * r['bare_step_s']
        wr = r.get('steady_write_s')
        lines.append(
            f"| {r['mode']} | {r['bare_step_s']:.3f} | {r['warm_up_step_s']:.3f} | "
            f"{r['steady_step_s']:.3f} | {over:.3f} | {r['steady_blocking_mean_s']:.3f} / "
            f"{r['steady_blocking_max_s']:.3f} | {r['steady_snapshot_s']:.3f} | {goal:.3f} | "
            f"{'yes' if over <= goal else 'no'} | {'-' if wr is None else f'{wr:.3f}'} | "
            f"+{r['steady_cpu_s'] - r['bare_cpu_s']:.3f} |")
      lines.append('')
      for r in results:
        if r.get('warm_up_write_s'):
          lines.append(f"{r['mode']}, process 0's warm-up saves' background writes: "
                       + ', '.join(f'{w:.2f} s' for w in r['warm_up_write_s']))
      lines.append('')
    for r in results:
      if r.get('cpu_s') is not None:
        lines.append(f"{r['mode']}: CPU per step and process (user + system, every thread, mean "
                     f"of 4): bare {r['bare_cpu_s']:.3f} s, with saves {r['cpu_s']:.3f} s "
                     f"(+{r['cpu_s'] - r['bare_cpu_s']:.3f} s; this machine has "
                     f"{os.cpu_count()} cores for the 4 processes)")
      if r.get('local_saves') is not None and args.local_every and r['mode'] != 'storage_only':
        due = len([k for k in range(2, args.steps + 1) if k % args.local_every == 0])
        lines.append(f"{r['mode']}: steps 2-{args.steps} saved local-only: {r['local_saves']} of "
                     f"the {due} due (local_save_when_busy={args.when_busy!r})")
      if r['mode'].endswith('_copies') and None not in r.get('copies_held', [None]):
        lines.append(f"{r['mode']}: partner copies of node steps each node held at the end "
                     f"(processes 0-3): {r['copies_held']}")
      if r.get('storage_cpu_s') is not None:
        lines.append(f"{r['mode']}: the storage emulation's CPU per step on the same cores "
                     f"(fake-gcs-server and the bandwidth-capped proxy; remote on a real job): "
                     f"{r['storage_cpu_s']:.3f} s")
    for r in results:
      last = r.get('last_save') or {}
      if last:
        lines.append(f"{r['mode']}, process 0's last save: snapshot (save()'s own part) "
                     f"{last['snapshot_s']:.3f} s, background write {last['write_s']:.3f} s, "
                     f"save() called -> committed {last['commit_s'] or 0:.3f} s")
      ev = sorted((r.get('events') or {}).items(), key=lambda kv: -kv[1][0])[:8]
      if ev:
        lines.append(f"{r['mode']}, process 0's Orbax duration events over the loop (total s / "
                     'count): ' + ', '.join(f'`{k}` {v[0]:.2f}/{v[1]}' for k, v in ev))
    return '\n'.join(lines)
  lines += ['| mode | resumed from | steps lost | resume to first step (s) | storage bytes read '
            '| step time / bare | save() blocking mean / max (s) | storage objects per '
            'local-only step | storage requests of the run |',
            '|---|---:|---:|---:|---:|---:|---:|---:|---:|']
  for r in results:
    read = '-' if r['storage_bytes'] is None else f"{r['storage_bytes'] / MiB:.1f} MiB"
    objects = r.get('local_objects_per_step')
    lines.append(f"| {r['mode']} | {r['resumed_step']} | {r['steps_lost']} | "
                 f"{r['resume_s']:.2f} | {read} | "
                 f"{r['step_s'] / r['bare_step_s']:.3f} | "
                 f"{r['blocking_mean_s']:.3f} / {r['blocking_max_s']:.3f} | "
                 f"{'-' if objects is None else f'{objects:.2f}'} | {r.get('requests', '-')} |")
  by = {r['mode']: r for r in results}
  if {'storage_only', 'multi_tier'} <= set(by):
    lines.append('')
    lines.append(f"resume time multi_tier / storage_only: "
                 f"{by['multi_tier']['resume_s'] / by['storage_only']['resume_s']:.2f}")
  lines.append('')
  lines.append(f'Peak resident memory of the largest process over the training run '
               f'({held_mib(args):g} MiB of state held per process): ' + ', '.join(
                   f"{r['mode']} {r['peak_rss_mib']:.0f} MiB" for r in results
                   if r.get('peak_rss_mib')))
  return '\n'.join(lines)


def runs_summary(results, args) -> str:
  """Per mode, over its runs: the newest storage step committed when the job was killed (how
  often), the step resumed (how often), steps lost, and the slowest process's
  ``latest_step()`` + ``restore()`` (``restore_s``; ``resume_s`` adds a training step and a
  barrier)."""
  lines = ['', '| mode | runs | newest storage step at the kill (runs) | resumed from (runs) | '
           'steps lost mean / max | restore (s) mean / max |', '|---|---:|---|---|---:|---:|']
  for mode in dict.fromkeys(r['mode'] for r in results):
    rs = [r for r in results if r['mode'] == mode]
    def counts(values):
      c = {}
      for v in values:
        c[v] = c.get(v, 0) + 1
      return ', '.join(f'{k} ({n})' for k, n in sorted(c.items(), key=lambda kv: -(kv[0] or -1)))
    newest = counts(max(r['storage_steps_at_restart'], default=None) for r in rs)
    lost = [r['steps_lost'] for r in rs]
    rest = [r['restore_s'] for r in rs]
    lines.append(f"| {mode} | {len(rs)} | {newest} | {counts(r['resumed_step'] for r in rs)} | "
                 f"{sum(lost) / len(lost):.2f} / {max(lost)} | "
                 f"{sum(rest) / len(rest):.2f} / {max(rest):.2f} |")
  del args
  return '\n'.join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.api == 'emergency':
    args.layout = 'replicated'  # the emergency manager's slices are replicas
  sys.path.insert(0, TESTS)
  from support.mp_harness import run_processes  # pylint: disable=import-outside-toplevel
  with benchlib_storage.capped_gcs(args.bandwidth_mib * MiB,
                                   args.latency_ms / 1000) as (server, proxy):
    results = []
    for mode in args.modes.split(','):
      if mode not in MODES:
        raise SystemExit(f'--modes: {mode!r} is none of {", ".join(MODES)}')
      if mode == 'stock' and args.api != 'emergency':
        raise SystemExit('--modes: stock (Orbax\'s emergency manager alone) needs --api emergency')
      if mode == 'storage_only' and args.api == 'emergency':
        raise SystemExit('--modes: storage_only is not an emergency manager mode (use stock)')
      for _ in range(args.runs):
        t0 = time.perf_counter()
        bucket = server.new_bucket('local')
        results.append(one_mode(mode, args, bucket, run_processes, server.pid, proxy))
        server.delete_objects(bucket)  # the in-memory server's memory, for the next mode
        print(f'{mode}: {time.perf_counter() - t0:.0f} s', file=sys.stderr, flush=True)
    print(table(results, args))
    if not args.train_only:
      print(runs_summary(results, args))
    if args.json_out:
      with open(args.json_out, 'w', encoding='utf-8') as f:
        json.dump({'args': vars(args), 'date': time.strftime('%Y-%m-%d'), 'results': results},
                  f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
