"""Peak host memory (RSS) of one save+commit, and the restore of that step, each in a fresh
interpreter.

The main process calls ``run_rss_subprocess`` per (handler, repetition): it runs
``bench.py --mode M --size-gb S --seed N --_rss-worker IMPL --_ckpt PATH`` (the same entry point,
the same environment) so the allocator holds nothing from earlier runs. That subprocess's
``bench.py`` calls ``rss_worker``: build the same state, ``gc.collect()``, record the RSS, then
save and wait for the commit while ``RssSampler`` reads ``psutil`` RSS every 5 ms; the kernel's
``VmHWM`` (reset through ``/proc/self/clear_refs``) cross-checks the sampler. The worker prints one
``RSS_RESULT {json}`` line, which the parent parses. Then ``bench.py ... --_restore-worker IMPL
--_ckpt PATH`` restores that step as a restarted job does (``restore_worker``: a fresh
interpreter, the target built from shapes alone, nothing else in memory) and prints
``RESTORE_RESULT {json}`` with its seconds.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time

from benchlib import BENCH_PY
from benchlib.cli import quiet_logs
from benchlib.handlers import Served, use_handler
from benchlib.measure import timed_save
from benchlib.workloads import abstract_state, build_state, device_bytes, meshes


class RssSampler:
  """psutil RSS every 5 ms in a thread; peak kept."""

  def __init__(self, interval=0.005):
    import psutil
    self.proc = psutil.Process()
    self.interval = interval
    self.peak = 0
    self.samples = 0
    self._stop = threading.Event()
    self._t = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.is_set():
      self.sample()
      time.sleep(self.interval)

  def sample(self):
    rss = self.proc.memory_info().rss
    self.samples += 1
    if rss > self.peak:
      self.peak = rss

  def __enter__(self):
    self.sample()
    self._t.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._t.join()
    self.sample()


def _reset_hwm() -> bool:
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
    return True
  except OSError:
    return False


def _vm_hwm() -> int | None:
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith('VmHWM:'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def rss_worker(args) -> None:
  """One peak-RSS measurement of save+commit in this fresh interpreter; prints a JSON line."""
  import orbax.checkpoint as ocp
  import psutil
  quiet_logs()
  import orbax_pathways  # noqa: F401  (installs ours)
  mesh, _ = meshes(args.mode)
  state = build_state(mesh, args.size_gb, args.seed)
  use_handler(args.rss_worker)
  dev_bytes = device_bytes(state)
  path = args.worker_ckpt
  with ocp.CheckpointManager(path) as mngr:
    # Warm the manager (directory creation, metadata) without the state; then measure.
    gc.collect()
    time.sleep(0.2)
    base = psutil.Process().memory_info().rss
    hwm_ok = _reset_hwm()
    sv = Served(args.rss_worker, 'save')
    with RssSampler() as s:
      blocking, commit = timed_save(mngr, 1, state)
    sv.check()
    hwm = _vm_hwm() if hwm_ok else None
  print('RSS_RESULT ' + json.dumps({
      'impl': args.rss_worker, 'rss_before': base, 'rss_peak': s.peak, 'samples': s.samples,
      'peak_rss_delta_bytes': s.peak - base, 'peak_rss_over_state': s.peak / dev_bytes,
      'peak_rss_delta_over_state': (s.peak - base) / dev_bytes, 'device_bytes': dev_bytes,
      'vm_hwm_delta_bytes': (hwm - base) if hwm else None,
      'save_blocking_s': blocking, 'commit_s': commit}), flush=True)


def restore_worker(args) -> None:
  """The restore of step 1 at ``--_ckpt`` in this fresh interpreter, as a restarted job's:
  the target from shapes alone (no state built first); prints a JSON line."""
  import jax
  import orbax.checkpoint as ocp
  quiet_logs()
  import orbax_pathways  # noqa: F401  (installs ours)
  mesh, _ = meshes(args.mode)
  target = abstract_state(mesh, args.size_gb, args.seed)
  use_handler(args.restore_worker)
  with ocp.CheckpointManager(args.worker_ckpt) as mngr:
    rv = Served(args.restore_worker, 'restore')
    t0 = time.perf_counter()
    out = mngr.restore(1, args=ocp.args.StandardRestore(target))
    jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
    rv.check()
  print('RESTORE_RESULT ' + json.dumps({'impl': args.restore_worker, 'restore_s': seconds}),
        flush=True)


def _worker(impl, args, path, flag, tag) -> dict:
  cmd = [sys.executable, BENCH_PY, '--mode', args.mode, '--size-gb', str(args.size_gb),
         '--seed', str(args.seed), flag, impl, '--_ckpt', path]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
  for line in proc.stdout.splitlines():
    if line.startswith(tag + ' '):
      return json.loads(line[len(tag) + 1:])
  raise RuntimeError(f'{flag} worker ({impl}) failed rc={proc.returncode}:\n'
                     f'{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}')


def run_rss_subprocess(impl, args, storage, rep) -> dict:
  """The RSS worker's RSS_RESULT record for ``impl``, with ``cold_restore_s`` from the restore
  worker that follows it on the same step; raises with a worker's output if it failed."""
  path = storage.new_dir(f'rss-{impl}-r{rep}')
  try:
    out = _worker(impl, args, path, '--_rss-worker', 'RSS_RESULT')
    out['cold_restore_s'] = _worker(impl, args, path, '--_restore-worker',
                                    'RESTORE_RESULT')['restore_s']
  finally:
    storage.remove(path)
  return out
