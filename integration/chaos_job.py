"""One run of ``integration/chaos.py``'s training job: its processes (``chaos_worker.py``), one
per node, each in a process group of its own, what they report, and how they are stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from chaos_worker import DEVICES

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, 'chaos_worker.py')


def _progress(shared: str, pid: int) -> list[tuple[str, int | None, float]]:
  try:
    with open(os.path.join(shared, f'progress_{pid}'), encoding='ascii') as f:
      lines = f.read().splitlines()
  except OSError:
    return []
  out = []
  for line in lines:
    parts = line.split()
    if len(parts) == 3:
      out.append((parts[0], None if parts[1] == 'None' else int(parts[1]), float(parts[2])))
  return out


class Job:
  """One run of the training job: N processes of one ``jax.distributed`` job, each in its own
  process group, with the node's tier directory; killed and reaped by ``stop``."""

  def __init__(self, harness: Any, n: int, plan: dict):
    from support import mp_harness, procs, zygote  # pylint: disable=g-import-not-at-top
    self.n = n
    self.dir = tempfile.mkdtemp(prefix='job-', dir=harness.base)
    self.shared = os.path.join(self.dir, 'shared')
    self.results = os.path.join(self.dir, 'results')
    os.makedirs(self.shared)
    os.makedirs(self.results)
    coordinator = f'127.0.0.1:{procs.free_port()}'
    self.procs = []
    self.t0 = time.time()
    for i in range(n):
      env = mp_harness.worker_env(
          os.environ, harness.env, pid=i, num_processes=n, devices_per_process=DEVICES,
          coordinator=coordinator, results_dir=self.results, shared_dir=self.shared,
          init_timeout=120)
      env['ORBAX_PATHWAYS_TIER_DIR'] = harness.tier(i)
      env.pop('ORBAX_PATHWAYS_NO_SIGTERM', None)  # a SIGTERM is the preemption notice
      argv = [sys.executable, WORKER, harness.root,
              str(harness.args.storage_every), str(harness.args.local_every),
              str(harness.rows), json.dumps(plan)]
      with open(os.path.join(self.dir, f'{i}.out'), 'wb') as out, \
          open(os.path.join(self.dir, f'{i}.err'), 'wb') as err:
        popen = zygote.Popen if harness.args.fast_start else subprocess.Popen
        self.procs.append(popen(argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                                           stdout=out, stderr=err, start_new_session=True))

  def progress(self, pid: int):
    return _progress(self.shared, pid)

  def emitted(self, pid: int) -> list[dict]:
    try:
      with open(os.path.join(self.results, f'process_{pid}.jsonl'), encoding='utf-8') as f:
        return [json.loads(line) for line in f if line.strip()]
    except OSError:
      return []

  def resumed(self) -> list[dict] | None:
    got = [[e for e in self.emitted(i) if e.get('event') == 'resumed'] for i in range(self.n)]
    return [g[0] for g in got] if all(got) else None

  def trained(self) -> list[int | None]:
    """Per process, the last step its loop trained (its ``save()`` returned)."""
    return [max((s for e, s, _ in self.progress(i) if e == 'trained'), default=None)
            for i in range(self.n)]

  def first_trained_at(self) -> float | None:
    """Seconds from the launch until every process had trained its first step."""
    times = [min((t for e, _, t in self.progress(i) if e == 'trained'), default=None)
             for i in range(self.n)]
    return None if None in times else max(times) - self.t0

  def codes(self) -> list[int | None]:
    return [p.poll() for p in self.procs]

  def signal(self, sig: int, pids) -> None:
    for i in pids:
      try:
        os.killpg(self.procs[i].pid, sig)
      except ProcessLookupError:
        pass

  def stop(self) -> None:
    self.signal(signal.SIGKILL, range(self.n))
    for p in self.procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass

  def tails(self) -> str:
    out = []
    for i in range(self.n):
      try:
        with open(os.path.join(self.dir, f'{i}.err'), errors='replace') as f:
          out.append(f'--- process {i} (rc {self.procs[i].poll()}) ---\n' + f.read()[-3000:])
      except OSError:
        pass
    return '\n'.join(out)


  def package_log(self, per_process: int = 12) -> list[list[str]]:
    """Per process, the last ``per_process`` lines of its stderr that the package logged
    (``orbax_pathways``, less the lease taken over at each start): why a resume passed a step
    over, what it fetched from where."""
    out = []
    for i in range(self.n):
      try:
        with open(os.path.join(self.dir, f'{i}.err'), errors='replace') as f:
          lines = [line.rstrip()[:400] for line in f
                   if 'orbax_pathways' in line and 'took over the writer lease' not in line]
      except OSError:
        lines = []
      out.append(lines[-per_process:])
    return out


class Hang(Exception):
  """A phase of a run took longer than ``--deadline``."""
