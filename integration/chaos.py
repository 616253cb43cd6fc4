"""Fault soak: a multi-tier training job hit by a seeded random schedule of faults, one at a time,
each followed by a restart through ``preemption.resume`` and more training; counts recoveries.

    python integration/chaos.py --faults 20 --seed 0 [--json-out F] [--keep] [--fast-start]
        [--local-steps-in nodes|storage]

The job: 4 ``jax.distributed`` processes (2 CPU devices each; each process a node with its own
node-local tier directory and its own slice), an unchanged ``CheckpointManager`` (storage every
``--storage-every`` steps, ``max_to_keep=2``) with multi-tier on through the package's
environment (a local-only save every ``--local-every`` steps, ``local_copies=2``), on
fake-gcs-server behind ``tests/support/fault_proxy.py`` (started here, on loopback). The state
is a deterministic function of the step (a sharded array and a replicated one, ``base + step``),
so any restored value can be checked.

Each fault of the schedule (``--seed``: the kinds, where each strikes, which process) is
injected into a running job; then the job is restarted (on 3 processes after a lost node, back
on 4 at the restart after that) and every process resumes, checks the values it restored
against the step it resumed, and trains on until the next fault. A fault counts as recovered
when every process of the restart resumed the same step with the right values and trained a
step after it. Per fault: the steps lost (the last step the loop trained before the fault minus
the step resumed), seconds from the restart's launch to its first trained step (every process,
jax's start included), bytes read from storage. A wrong value, a restart that does not train, or
a hang (past ``--deadline`` seconds) is a failure, printed with the seed and the fault's index:
``--faults <index + 1> --seed <seed>`` replays the schedule up to it exactly (the faults are
drawn in order from the seed; timing within a run still varies).

The kinds (``KINDS``): SIGKILL of one process or of all, inside ``save()``, during a storage
commit, during a local-only save and its partner copy, during the resume; a lost node (its tier
gone; the restart on 3 processes); SIGTERM to one process or to all (the preemption save); 5%
storage errors, stalled requests, dropped connections during saves and the next restore; a
flipped byte in a tier chunk, in a partner copy, in a storage chunk, in a step's metadata.

Its parts: ``chaos_worker.py`` (a process of the job), ``chaos_job.py`` (one run of the job:
its processes, what they report, their end), ``chaos_report.py`` (the closing line and the table
by kind); this file draws the schedule, injects each fault and judges each recovery.

Ends with one line:
``chaos: R/N recovered, W wrong values, H hangs, steps lost mean A max B, resume mean C s``.
Exits 1 unless every fault recovered.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time

from chaos_job import Hang, Job
from chaos_report import by_kind, fmt, summary

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

KILLS = ('kill_all_in_save', 'kill_one_in_save', 'kill_all_storage_commit',
         'kill_one_storage_commit', 'kill_all_local_save', 'kill_one_local_save',
         'kill_all_in_resume', 'kill_one_in_resume')
KINDS = KILLS + ('node_lost', 'sigterm_all', 'sigterm_one', 'storage_errors', 'storage_stall',
                 'storage_dropped', 'flip_tier_chunk', 'flip_partner_copy',
                 'flip_storage_chunk', 'flip_metadata')

def _damaged_node_step(record: dict) -> tuple[int, int] | None:
  """(node, step) of the node step whose own data file a ``flip_tier_chunk`` damaged (its path:
  ``<base>/node<i>/.node-steps/<digest>/<step>/...``), else None."""
  parts = str(record.get('damaged') or '').split(os.sep)
  if record.get('kind') != 'flip_tier_chunk' or '.node-steps' not in parts:
    return None
  at = parts.index('.node-steps')
  node, digest, step = parts[at - 1], parts[at + 1], parts[at + 2]
  if not node.startswith('node') or digest.endswith('.copies') or not step.isdigit():
    return None
  return int(node[4:]), int(step)


def newer_whole(record: dict) -> int | None:
  """The newest step every node held committed (a node's own step damaged by the fault only
  where a partner's copy of it was committed too), or storage held committed, when the fault's
  restart started (None where the record has neither: storage mode, a lost node)."""
  nodes, storage = record.get('node_steps'), record.get('storage_steps') or []
  if not nodes or record.get('kind') == 'node_lost':
    return None
  held = [set(n) for n in nodes]
  damaged = _damaged_node_step(record)
  copies = record.get('node_copies')  # not in records taken before they were recorded
  if damaged is not None and copies is not None and damaged[0] < len(held):
    node, step = damaged
    if not any(step in c.get(str(node), ()) for c in copies):
      held[node].discard(step)  # damaged, and no copy to restore it from
  everywhere = held[0].intersection(*held[1:])
  return max(everywhere | set(storage), default=None)


class Chaos:
  """The soak: fake-gcs-server behind the fault proxy, 4 node directories, the schedule."""

  def __init__(self, args, gcs, proxy, bucket: str):
    self.args = args
    self.gcs, self.proxy, self.bucket = gcs, proxy, bucket
    self.root = f'gs://{bucket}/ckpt'
    self.env = dict(gcs.env(proxy.url))
    self.env.update({
        'ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS': str(args.local_every),
        'ORBAX_PATHWAYS_LOCAL_COPIES': '2',
        'ORBAX_PATHWAYS_LOCAL_STEPS_IN': args.local_steps_in,
    })
    self.base = tempfile.mkdtemp(prefix='orbax-pathways-chaos-')
    # rows of the sharded array: args.mib per process on 4 processes, divisible by 3 and 4
    self.rows = 12 * max(1, round(args.mib * 2**20 * 4 / (256 * 4) / 12))
    self.rng = random.Random(args.seed)
    self.nodes = 4  # processes of the next run
    self.records: list[dict] = []
    # storage faults on until the next restart has resumed: its restore runs under them too
    self.proxy_faults_until_resume = False

  def tier(self, i: int) -> str:
    return os.path.join(self.base, f'node{i}')

  # -- waiting -------------------------------------------------------------------------
  def _wait(self, until, what: str) -> None:
    """Polls ``until()``; past ``--deadline`` seconds, raises ``Hang`` naming ``what``."""
    end = time.monotonic() + self.args.deadline
    while not until():
      if time.monotonic() > end:
        raise Hang(f'{what}: not after {self.args.deadline:.0f} s')
      time.sleep(0.02)

  def _wait_resumed(self, job: Job) -> list[dict] | None:
    """The restart's resume on every process, or None when a process died first."""
    def done():
      return job.resumed() is not None or any(c is not None for c in job.codes())
    self._wait(done, 'resume')
    return job.resumed()

  def _wait_trained(self, job: Job, step: int) -> bool:
    """Until process 0's loop trained ``step``; False when a process ended first."""
    def done():
      last = job.trained()[0]
      return (last is not None and last >= step) or any(c is not None for c in job.codes())
    self._wait(done, f'training to step {step}')
    return all(c is None for c in job.codes())

  # -- one fault -------------------------------------------------------------------------
  def _plan(self, kind: str) -> dict:
    rng = self.rng
    plan = {'kind': kind, 'offset': rng.randint(1, 2 * self.args.storage_every)}
    if kind in KILLS:
      who = (list(range(self.nodes)) if '_all_' in kind else [rng.randrange(self.nodes)])
      plan['who'] = who
      if kind.endswith('in_save'):
        plan.update(when='in_save', delay=rng.uniform(0.0, 0.05))
      elif kind.endswith('storage_commit'):
        plan.update(when='after_save', at='storage', delay=rng.uniform(0.0, 0.6))
      elif kind.endswith('local_save'):
        plan.update(when='after_save', at='local', delay=rng.uniform(0.0, 0.2))
      else:
        plan.update(when='resume', delay=rng.uniform(0.0, 2.0))
    elif kind == 'sigterm_one':
      plan['who'] = [rng.randrange(self.nodes)]
    elif kind == 'sigterm_all':
      plan['who'] = list(range(self.nodes))
    plan['pick'] = rng.random()  # which file a flip hits, which step a storage fault strikes
    return plan

  def run(self) -> list[dict]:
    """Runs the schedule; returns the faults' records (``_report`` prints each)."""
    kinds = self.args.kinds.split(',') if self.args.kinds else list(KINDS)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
      raise SystemExit(f'chaos.py: unknown kinds {unknown}; the kinds are {", ".join(KINDS)}')
    schedule = [self.rng.choice(kinds) for _ in range(self.args.faults)]
    previous: dict | None = None  # the fault whose restart the next job is
    for index, kind in enumerate(schedule + [None]):
      record = self._episode(index, self._plan(kind) if kind else None, previous)
      if previous is not None:
        self.records.append(previous)
        self._report(previous)
      previous = record
    return self.records

  def _episode(self, index: int, plan: dict | None, previous: dict | None) -> dict | None:
    """Starts the job on ``self.nodes`` processes. It is ``previous``'s restart (its outcome is
    recorded into ``previous``); then it gets ``plan``'s fault (None: it trains 2 steps and
    ends). Returns the new fault's record."""
    n = self.nodes
    # A kill during the resume strikes the restart after this job (_inject), not this one.
    job_plan = (plan if plan is None or plan.get('when') != 'resume'
                else {k: v for k, v in plan.items() if k not in ('who', 'when')})
    job = Job(self, n, job_plan or {'steps': 2})
    record = None if plan is None else {'index': index, 'kind': plan['kind'], 'processes': n,
                                        'plan': plan}
    try:
      resumed = self._wait_resumed(job)
      if self.proxy_faults_until_resume:
        self.proxy.set_rate(0.0)
        self.proxy_faults_until_resume = False
      if previous is not None:
        self._recovery(job, resumed, previous)
      if resumed is None or len({r['step'] for r in resumed}) != 1:
        return self._no_fault(record, 'not injected: its restart did not resume')
      step = resumed[0]['step']
      first = 0 if step is None else step + 1
      if previous is None:
        self._wait(lambda: all(s is not None for s in job.trained())
                   or any(c is not None for c in job.codes()), 'the first step')
      with open(os.path.join(job.shared, 'go.tmp'), 'w', encoding='ascii') as f:
        f.write(str(max((s for s in job.trained() if s is not None), default=first) + 2))
      os.replace(os.path.join(job.shared, 'go.tmp'), os.path.join(job.shared, 'go'))
      if record is None:  # the last restart: trains its 2 steps and ends cleanly
        self._wait(lambda: all(c is not None for c in job.codes()), 'the last run')
        return None
      self._inject(job, plan, first, record)
      record.setdefault('trained_by', job.trained())
      if record.get('last_trained') is None:
        record['last_trained'] = max((s for s in job.trained() if s is not None),
                                     default=None)
      if self.args.local_steps_in == 'nodes':
        record['node_steps'] = [self._committed_node_steps(self.tier(i))
                                for i in range(self.nodes)]
        record['node_copies'] = [self._committed_copies(self.tier(i))
                                 for i in range(self.nodes)]
        record['storage_steps'] = self._committed_storage_steps()
      if record['last_trained'] is None and previous is not None:
        record['last_trained'] = previous.get('last_trained')
      if n == 3 and plan['kind'] != 'node_lost':
        self.nodes = 4  # the lost node replaced: the next restart is on 4 again
      return record
    except Hang as e:
      if previous is not None and 'recovered' not in previous:
        previous.update(recovered=False, hang=True, detail=f'{e}\n{job.tails()}')
        return self._no_fault(record, 'not injected: its restart hung')
      if record is not None:
        record.update(hang=True, detail=f'{e}\n{job.tails()}')
      return record
    finally:
      job.stop()
      self.proxy.release()

  @staticmethod
  def _no_fault(record, why: str):
    if record is not None:
      record.update(skipped=why)
    return record

  def _recovery(self, job: Job, resumed, previous: dict) -> None:
    """Records the restart's outcome into the fault it followed."""
    previous['resume_wall_s'] = None
    if resumed is None:
      codes = job.codes()
      previous.update(recovered=False, detail=f'a process ended before resuming (codes '
                      f'{codes})\n{job.tails()}')
      return
    steps = {r['step'] for r in resumed}
    wrong = [i for i, r in enumerate(resumed) if not r['ok']]
    previous['resumed'] = sorted(steps, key=lambda s: -1 if s is None else s)
    previous['storage_bytes'] = sum(r['bytes'].get('storage', 0) for r in resumed)
    previous['resume_call_s'] = max(r['resume_s'] for r in resumed)
    if wrong:
      previous.update(recovered=False, wrong=True,
                      detail=f'processes {wrong} restored values other than step {steps}\'s')
      return
    if len(steps) != 1:
      previous.update(recovered=False, detail=f'the processes resumed different steps: {steps}')
      return
    step = steps.pop()
    # Recovered: every process trained a step after the resume.
    first = 0 if step is None else step + 1
    try:
      self._wait(lambda: all(s is not None and s >= first for s in job.trained())
                 or any(c not in (None, 0) for c in job.codes()), 'the first step after resume')
    except Hang:
      previous.update(recovered=False, hang=True,
                      detail=f'no step trained after the resume\n{job.tails()}')
      return
    if not all(s is not None and s >= first for s in job.trained()):
      previous.update(recovered=False, detail=f'a process ended before training a step after '
                      f'resuming {step} (codes {job.codes()})\n{job.tails()}')
      return
    last = previous.get('last_trained')
    lost = None if last is None else last - (-1 if step is None else step)
    previous.update(recovered=True, resumed_step=step, steps_lost=lost,
                    resume_wall_s=job.first_trained_at())
    if lost is not None and lost > self.args.local_every:  # kept to explain it
      previous['resume_log'] = job.package_log()

  def _inject(self, job: Job, plan: dict, first: int, record: dict) -> None:
    kind = plan['kind']
    args = self.args
    target = first + plan['offset']
    if plan.get('when') == 'resume':
      # The job is killed at a step, and its restart (on the same nodes) dies in the resume:
      # the restart after that one recovers.
      if not self._wait_trained(job, target):
        record['detail'] = f'a process ended before the fault\n{job.tails()}'
      job.stop()
      record['trained_by'] = job.trained()
      record['last_trained'] = max((s for s in job.trained() if s is not None), default=None)
      job = Job(self, job.n, plan)
    if kind in KILLS:
      # The worker kills itself (or all do); then the rest of the job is killed, as a
      # scheduler restarts a job that lost a process.
      try:
        self._wait(lambda: any(c is not None for c in job.codes()), 'the planned kill')
        time.sleep(self.rng.uniform(0.0, 1.0))
        record['codes'] = job.codes()
      finally:
        job.stop()
      if plan.get('when') == 'resume':
        # A restart whose resume ended before the kill's delay trained on: its steps count.
        again = [s for s in job.trained() if s is not None]
        if again:
          record['trained_by'] = job.trained()
          record['last_trained'] = max(again + [record.get('last_trained') or -1])
      return
    if not self._wait_trained(job, target):
      record['codes'] = job.codes()
      record['detail'] = f'a process ended before the fault\n{job.tails()}'
      return
    if kind in ('sigterm_one', 'sigterm_all'):
      job.signal(signal.SIGTERM, plan['who'])
      self._wait(lambda: all(c is not None for c in job.codes()), 'the preemption save')
      record['codes'] = job.codes()
      pre = [e['step'] for i in range(job.n) for e in job.emitted(i)
             if e.get('event') == 'preempted']
      record['preempted_at'] = sorted(set(pre))
      if record['codes'] != [0] * job.n:
        record['detail'] = f'preempted job exited with {record["codes"]}\n{job.tails()}'
      return
    if kind.startswith('storage_'):
      if kind == 'storage_errors':
        self.proxy.set_rate(0.05, ('429', '503', 'delay'))
      elif kind == 'storage_dropped':
        self.proxy.set_rate(0.05, ('reset', 'reset_after'))
      else:  # stalled: the next uploads hang unanswered for a while
        self.proxy.hold(lambda method, target: method in ('POST', 'PUT'), count=3)
      self.proxy_faults_until_resume = kind != 'storage_stall'
      self._wait_trained(job, target + args.storage_every)
      if kind == 'storage_stall':
        time.sleep(self.rng.uniform(0.0, 2.0))
      job.stop()
      self.proxy.release()
      record['codes'] = job.codes()
      return
    job.stop()  # everything else: the whole job killed, then the damage done
    record['codes'] = job.codes()
    if kind == 'node_lost':
      lost = self.tier(self.nodes - 1)
      shutil.rmtree(lost, ignore_errors=True)
      self.nodes = 3
      record['damaged'] = lost
      return
    record['damaged'] = self._flip(kind, plan['pick'])

  def _flip(self, kind: str, pick: float) -> str:
    """Flips one bit of one file of the newest step of ``kind``'s sort; returns its path."""
    pick2 = (pick * 1000) % 1.0
    if kind == 'flip_storage_chunk' or (kind == 'flip_metadata' and pick2 < 0.5):
      return self._flip_object(kind, pick)
    # The node-local store of one node: <store>/<step>/<item>/p<process>.<id>/<files>, both
    # the tier's copy of storage steps and the local-only steps. flip_tier_chunk: a chunk of
    # the node's own share; flip_partner_copy: of the share it keeps for another slice's
    # process; flip_metadata: a share's manifest. With node steps, the two chunk kinds damage a
    # data file of the newest node step instead: this node's own, or the copy it keeps.
    node_i = int(pick * self.nodes)
    node = self.tier(node_i)
    found: dict[int, list[str]] = {}
    if self.args.local_steps_in == 'nodes' and kind != 'flip_metadata':
      found = self._node_step_files(node, kind == 'flip_partner_copy')
    for dirpath, _, filenames in ([] if found else os.walk(node)):
      parts = os.path.relpath(dirpath, node).split(os.sep)
      if len(parts) != 4 or not parts[1].isdigit() or not parts[3].startswith('p'):
        continue
      own = parts[3][1:].split('.')[0] == str(node_i)
      for f in filenames:
        if (f == 'manifest.msgpack' if kind == 'flip_metadata' else
            f.endswith('.bin') and own == (kind == 'flip_tier_chunk')):
          found.setdefault(int(parts[1]), []).append(os.path.join(dirpath, f))
    if not found:
      return f'nothing: no {kind[5:]} file under {node}'
    files = sorted(found[max(found)])
    path = files[int(pick2 * len(files))]
    size = os.path.getsize(path)
    with open(path, 'r+b') as f:
      at = int(pick * 7919) % size
      f.seek(at)
      b = f.read(1)
      f.seek(at)
      f.write(bytes([b[0] ^ 0x01]))
    return path

  def _committed_storage_steps(self) -> list[int]:
    """The storage steps committed (Orbax's ``commit_success.txt``) as the restart finds them."""
    return sorted({int(n.split('/')[1]) for n in self.gcs.list_objects(self.bucket)
                   if n.count('/') == 2 and n.split('/')[1].isdigit()
                   and n.endswith('/commit_success.txt')})

  @staticmethod
  def _committed_node_steps(node: str) -> list[int]:
    """The node steps committed in ``node`` as the restart finds them (what a resume may choose
    from; a step some node lacks explains steps lost past the local interval)."""
    base = os.path.join(node, '.node-steps')
    steps = []
    for digest in (os.listdir(base) if os.path.isdir(base) else []):
      if digest.endswith('.copies') or not os.path.isdir(os.path.join(base, digest)):
        continue
      for name in os.listdir(os.path.join(base, digest)):
        if name.isdigit() and os.path.exists(
            os.path.join(base, digest, name, 'commit_success.txt')):
          steps.append(int(name))
    return sorted(steps)

  @staticmethod
  def _committed_copies(node: str) -> dict[str, list[int]]:
    """Saving process -> the node steps whose partner copy ``node`` keeps committed, as the
    restart finds them (``<node>/.node-steps/<digest>.copies/p<process>/<step>/``)."""
    base = os.path.join(node, '.node-steps')
    found: dict[str, list[int]] = {}
    for digest in (os.listdir(base) if os.path.isdir(base) else []):
      copies = os.path.join(base, digest)
      if not digest.endswith('.copies') or not os.path.isdir(copies):
        continue
      for writer in os.listdir(copies):
        wdir = os.path.join(copies, writer)
        if not writer.startswith('p') or not writer[1:].isdigit() or not os.path.isdir(wdir):
          continue
        steps = sorted(int(n) for n in os.listdir(wdir) if n.isdigit() and os.path.exists(
            os.path.join(wdir, n, 'commit_success.txt')))
        if steps:
          found[writer[1:]] = steps
    return found

  @staticmethod
  def _node_step_files(node: str, copies: bool) -> dict[int, list[str]]:
    """Step -> the data files of the node steps in ``node`` (``local_steps_in='nodes'``;
    ``support/damage.is_node_data_file``: chunk files, or an older step's OCDBT data files):
    its own (``<node>/.node-steps/<digest>/<step>/...``), or with ``copies`` those it keeps for
    its partner (``<digest>.copies/p<process>/<step>/...``)."""
    from support import damage  # pylint: disable=g-import-not-at-top  (tests/ on sys.path: main)
    base = os.path.join(node, '.node-steps')
    found: dict[int, list[str]] = {}
    for dirpath, _, filenames in os.walk(base):
      parts = os.path.relpath(dirpath, base).split(os.sep)
      if parts[0].endswith('.copies') != copies or len(parts) < (3 if copies else 2):
        continue
      step = parts[2] if copies else parts[1]
      if step.isdigit():
        found.setdefault(int(step), []).extend(
            os.path.join(dirpath, f) for f in filenames
            if damage.is_node_data_file(os.path.join(dirpath, f)))
    return {s: files for s, files in found.items() if files}

  def _flip_object(self, kind: str, pick: float) -> str:
    """Flips one bit of a chunk or metadata object of the newest step in storage."""
    names = self.gcs.list_objects(self.bucket)
    steps = sorted({int(n.split('/')[1]) for n in names
                    if n.count('/') > 1 and n.split('/')[1].isdigit()})
    if not steps:
      return 'nothing: no storage step'
    newest = f'ckpt/{steps[-1]}/'
    if kind == 'flip_storage_chunk':
      chosen = [n for n in names if n.startswith(newest) and '/d/' in n]
    else:
      chosen = [n for n in names if n.startswith(newest) and n.rsplit('/', 1)[-1] in
                ('_METADATA', '_CHECKPOINT_METADATA', 'manifest.ocdbt', '_sharding')]
    if not chosen:
      return f'nothing: no such object in {newest}'
    name = sorted(chosen)[int(pick * len(chosen))]
    data = bytearray(self.gcs.read_object(self.bucket, name))
    if not data:
      return f'nothing: gs://{self.bucket}/{name} is empty'
    data[int(pick * 7919) % len(data)] ^= 0x01
    self.gcs.write_object(self.bucket, name, bytes(data))
    return f'gs://{self.bucket}/{name}'

  # -- report -----------------------------------------------------------------------------
  def _report(self, r: dict) -> None:
    ok = r.get('recovered')
    line = (f'fault {r["index"]} {r["kind"]}: ' +
            ('recovered' if ok else 'NOT recovered') +
            f', resumed {r.get("resumed_step")} after trained {r.get("last_trained")}'
            f' (lost {r.get("steps_lost")}), restart to first step '
            f'{fmt(r.get("resume_wall_s"))} s, storage {r.get("storage_bytes", 0)} B'
            + (f', damaged {r["damaged"]}' if r.get('damaged') else '')
            + (f', skipped: {r["skipped"]}' if r.get('skipped') else ''))
    print(line, flush=True)
    if not ok:
      print(f'FAIL seed {self.args.seed} fault {r["index"]} ({r["kind"]}, plan {r["plan"]}); '
            f'replay: integration/chaos.py --faults {r["index"] + 1} --seed {self.args.seed}\n'
            f'{r.get("detail", "")}', flush=True)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--faults', type=int, default=20)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--json-out', default=None)
  p.add_argument('--storage-every', type=int, default=6)
  p.add_argument('--local-every', type=int, default=2)
  p.add_argument('--mib', type=float, default=1.0, help='MiB of sharded state per process')
  p.add_argument('--deadline', type=float, default=180.0,
                 help='seconds any phase may take before it counts as a hang')
  p.add_argument('--kinds', default='', help='comma-separated subset of the kinds (default all)')
  p.add_argument('--local-steps-in', default='nodes', choices=('storage', 'nodes'),
                 help="Options.local_steps_in of the job (default nodes, the package's: each "
                      'process saves its part of a local-only step alone into its node; storage: '
                      "their records in storage, the path of data iterators' and Pathways' "
                      'local-only steps)')
  p.add_argument('--fast-start', action='store_true',
                 help="fork the jobs' processes from a process that has imported jax and Orbax "
                      '(tests/support/zygote.py): the CI smoke\'s choice; the resume times then '
                      'leave out those imports, so soak results are taken without it')
  p.add_argument('--keep', action='store_true',
                 help="keep the nodes' directories and the jobs' logs (printed at the end)")
  args = p.parse_args(argv)
  sys.path.insert(0, os.path.join(REPO, 'tests'))
  from support import fault_proxy, gcs_server  # pylint: disable=g-import-not-at-top
  t0 = time.time()
  with gcs_server.FakeGcs(backend='memory') as gcs, \
      fault_proxy.FaultProxy(gcs.url, seed=args.seed) as proxy:
    chaos = Chaos(args, gcs, proxy, gcs.new_bucket('chaos'))
    try:
      records = chaos.run()
    finally:
      if args.keep:
        print(f'chaos: the nodes and the jobs\' logs are in {chaos.base}', flush=True)
      else:
        shutil.rmtree(chaos.base, ignore_errors=True)
  line = summary(records)
  print(by_kind(records, KINDS))
  over = [r for r in records if (r.get('steps_lost') or 0) > args.local_every]
  print(f'steps lost over the local interval ({args.local_every}): {len(over)} of '
        f'{len(records)}' + (f' ({", ".join(sorted({r["kind"] for r in over}))})' if over else ''))
  if args.local_steps_in == 'nodes' and over:
    # Over the interval is the goal's exception where every copy of the steps between was lost
    # (a storage step whose commit the fault stopped, a node step some process had not
    # committed): listed are those where a newer step was whole on every node or in storage.
    missed = [r for r in over if newer_whole(r) is not None
              and (r.get('resumed_step') is None or newer_whole(r) > r['resumed_step'])]
    print(f'  of them with a newer step whole on every node or committed in storage at the '
          f'fault: {len(missed)}' + ''.join(
              f'\n    fault {r["index"]} {r["kind"]}: resumed {r.get("resumed_step")}, '
              f'step {newer_whole(r)} was whole' for r in missed))
  if args.json_out:
    with open(args.json_out, 'w', encoding='utf-8') as f:
      json.dump({'seed': args.seed, 'faults': records, 'summary': line,
                 'elapsed_s': time.time() - t0}, f, indent=1, default=str)
  print(line + f' ({time.time() - t0:.0f} s, seed {args.seed})', flush=True)
  return 0 if all(r.get('recovered') for r in records) else 1


if __name__ == '__main__':
  sys.exit(main())
