"""Two writers on one directory: the writer lease.

Real processes saving through ordinary CheckpointManagers, on local disk and on fake-gcs-server:
a second live writer is refused with an error naming both jobs; once the first is killed (or
stalls past the timeout) the second takes over with one warning and its values are what the
directory holds; evaluators never take or need the lease; a multi-controller job is one owner.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from support import REPO, procs
from support.workers import lease_worker as lw

from orbax_pathways import errors
from orbax_pathways.manager import lease
from orbax_pathways.manager import lease_policy as plan

WORKER = os.path.join(REPO, 'tests', 'support', 'workers', 'lease_worker.py')  # the mp jobs' script
TIMEOUT = 300  # generous: several helpers share two cores


# ---------------------------------------------------------------------------------------------
# The pure decision.


def _owner(**kw):
  base = dict(token='theirs', host='h1', host_id='aaaa', pid=10, pid_start=5, job='',
              processes=1, started=0.0, renewed=100.0, timeout_s=30.0)
  base.update(kw)
  return plan.Owner(**base)


def _decide(held, **kw):
  args = dict(present=held is not None, my_token='mine', my_host_id='aaaa', now=110.0,
              timeout_s=30.0, owner_alive=None, unchanged_for_s=None, changed_while_watched=False)
  args.update(kw)
  return plan.decide(held, **args).action


def test_decide():
  assert _decide(None) == plan.TAKE
  assert _decide(_owner(token='mine')) == plan.KEEP
  # Same host: a dead owner is taken over at once, a live one refused at once.
  assert _decide(_owner(), owner_alive=False) == plan.TAKEOVER
  assert _decide(_owner(), owner_alive=True) == plan.REFUSE
  # A live pid does not keep a lease it stopped renewing (a stalled process).
  assert _decide(_owner(), owner_alive=True, now=200.0) == plan.TAKEOVER
  # Another host: watch; a renewal seen means a live writer, none for `timeout` a gone one.
  other = _owner(host_id='bbbb')
  assert _decide(other) == plan.WAIT
  assert _decide(other, changed_while_watched=True) == plan.REFUSE
  assert _decide(other, unchanged_for_s=31.0) == plan.TAKEOVER
  assert _decide(other, now=131.0) == plan.TAKEOVER  # its own clock says it is stale
  # An unreadable object: treated as another host's.
  assert _decide(None, present=True) == plan.WAIT
  assert _decide(None, present=True, unchanged_for_s=31.0) == plan.TAKEOVER


def test_owner_round_trip_and_unreadable():
  o = _owner(job='train-7', processes=4)
  assert plan.Owner.decode(o.encode()) == o
  assert 'train-7' in o.describe() and '4 processes' in o.describe()
  assert plan.Owner.decode(b'{"token": 1') is None
  assert plan.Owner.decode(b'[]') is None


def test_participants_of_orbaxs_emergency_managers():
  """Orbax's emergency manager on 4 processes: the persistent manager on slice 0 (primary host
  0), a local one per process on slice 1 (primary_host=None). Rounds name what every member
  passes Orbax, never the directory (per process for the local one), and the two differ."""
  from orbax_pathways.coord import participants as pl  # pylint: disable=g-import-not-at-top
  persistent = pl.Participants.of({1, 0}, 0, 'persistent')
  local = pl.Participants.of({3, 2}, None, 'local-1')
  assert persistent.members(4) == (0, 1) and local.members(4) == (2, 3)
  assert persistent.leader(4) == 0 and local.leader(4) == 2
  assert persistent.writes(0) and not persistent.writes(1)
  assert local.writes(2) and local.writes(3) and local.every_process_writes
  assert not local.includes(0, 4) and local.includes(3, 4)
  assert persistent.name('lease') != local.name('lease')
  assert local.name('lease') == pl.Participants.of([2, 3], None, 'local-1').name('lease')
  everyone = pl.Participants.of(None, 0, None)
  assert everyone.members(3) == (0, 1, 2) and everyone.size(3) == 3
  assert everyone.describe(3) == 'all 3 processes'
  assert "processes 2, 3 (barrier prefix 'local-1')" == local.describe(4)


# ---------------------------------------------------------------------------------------------
# In one process.


def test_racing_takers_cannot_both_win(tmp_path):
  """Eight takers race for an absent lease (each its own owner): the conditional create lets
  exactly one win, the others are refused naming it."""
  d = lease.directory_key(tmp_path)
  leases = [lease.Lease(d, timeout=30.0, processes=1) for _ in range(8)]
  start = threading.Barrier(len(leases))
  won, refused = [], []

  def take(one):
    start.wait()
    try:
      one.acquire()
      won.append(one)
    except errors.WriterLeaseError as e:
      refused.append(str(e))

  threads = [threading.Thread(target=take, args=(one,)) for one in leases]
  for t in threads:
    t.start()
  for t in threads:
    t.join(TIMEOUT)
  assert len(won) == 1 and len(refused) == 7, (len(won), refused[:1])
  on_disk = json.loads((tmp_path / lease.LEASE_FILE).read_text())
  assert on_disk['token'] == won[0].me.token
  won[0].release()
  assert not (tmp_path / lease.LEASE_FILE).exists()


def test_release_at_exit_waits_no_longer_than_the_lease_timeout(tmp_path, monkeypatch):
  """``release_all`` (registered with atexit) bounds each delete by ``EXIT_RELEASE_S`` and by
  the lease's own timeout, past which the lease is stale anyway (``test_lease_exit.py`` runs it
  at a real exit with a delete that never answers)."""
  d = lease.directory_key(tmp_path)
  one = lease.Lease(d, timeout=2.0, processes=1)
  one.acquire()
  waits = []
  write_if = one._store.write_if  # pylint: disable=protected-access

  def recording(data, generation, timeout_s=None):
    waits.append(timeout_s)
    return write_if(data, generation, timeout_s)

  monkeypatch.setattr(one._store, 'write_if', recording)  # pylint: disable=protected-access
  monkeypatch.setitem(lease._leases, d, one)  # pylint: disable=protected-access
  lease.release_all()
  assert waits == [2.0] and lease.EXIT_RELEASE_S > 2.0, waits
  assert not (tmp_path / lease.LEASE_FILE).exists()


def test_managers_of_one_process_share_the_lease(tmp_path):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  first, second = ocp.CheckpointManager(tmp_path), ocp.CheckpointManager(tmp_path)
  first.save(0, args=ocp.args.StandardSave({'a': np.arange(4)}))
  first.wait_until_finished()
  second.save(1, args=ocp.args.StandardSave({'a': np.arange(4) + 1}))
  second.wait_until_finished()
  path = tmp_path / lease.LEASE_FILE
  owner = plan.Owner.decode(path.read_bytes())
  assert owner is not None and owner.pid == os.getpid()
  second.close()
  assert path.exists()  # still held by `first`
  first.close()
  assert not path.exists()  # released by the last one
  reader = ocp.CheckpointManager(tmp_path)  # a reader never takes it
  assert reader.all_steps() == [0, 1]
  reader.close()
  assert not path.exists()


def test_a_lease_deleted_while_held_stops_saving_there_and_says_so(tmp_path):
  """Deleted by hand (or with a wiped directory, as Orbax's emergency tests empty a local
  directory) while a manager holds it: the next save refuses, saying it was deleted, not that
  another job took it over; closing the manager and building a new one takes it again."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  mngr = ocp.CheckpointManager(tmp_path)
  mngr.save(0, args=ocp.args.StandardSave({'a': np.arange(4)}))
  mngr.wait_until_finished()
  (tmp_path / lease.LEASE_FILE).unlink()
  lease._leases[lease.directory_key(tmp_path)].renew()  # pylint: disable=protected-access  # its renewer, now
  with pytest.raises(errors.WriterLeaseError) as info:
    mngr.save(1, args=ocp.args.StandardSave({'a': np.arange(4) + 1}))
  text = str(info.value)
  assert 'the lease was deleted while this job held it' in text, text
  assert 'took it over' not in text, text
  mngr.close()
  with ocp.CheckpointManager(tmp_path) as again:
    again.save(1, args=ocp.args.StandardSave({'a': np.arange(4) + 1}))
    again.wait_until_finished()
    assert again.all_steps() == [0, 1]


def test_a_step_orbax_declines_checks_no_lease_and_the_next_written_one_does(tmp_path):
  """A declined ``save()`` writes nothing, so it costs no lease check (every training step
  calls ``save()``); a lost lease is refused at the first step Orbax would write, before any of
  it is written."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  mngr = ocp.CheckpointManager(
      tmp_path, options=ocp.CheckpointManagerOptions(save_interval_steps=10))
  mngr.save(0, args=ocp.args.StandardSave({'a': np.arange(4)}))
  mngr.wait_until_finished()
  (tmp_path / lease.LEASE_FILE).unlink()
  lease._leases[lease.directory_key(tmp_path)].renew()  # pylint: disable=protected-access
  for step in range(1, 10):
    assert mngr.save(step, args=ocp.args.StandardSave({'a': np.arange(4) + step})) is False
  with pytest.raises(errors.WriterLeaseError) as info:
    mngr.save(10, args=ocp.args.StandardSave({'a': np.arange(4) + 10}))
  assert 'the lease was deleted while this job held it' in str(info.value)
  assert mngr.all_steps() == [0] and sorted(p.name for p in tmp_path.iterdir()) == ['0']
  mngr.close()


def test_lease_off(tmp_path, monkeypatch):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv(lease.ENABLE_ENV, '0')
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(0, args=ocp.args.StandardSave({'a': np.arange(4)}))
    mngr.wait_until_finished()
    assert sorted(p.name for p in tmp_path.iterdir()) == ['0']


# ---------------------------------------------------------------------------------------------
# Processes.


class Job:
  """A worker process whose stdout (JSON lines) goes to a file.

  ``paused``: the process starts now but waits, its imports done, until ``go()`` (the worker's
  ``--after``): a test starts its next job while the current one runs, so that the next
  interpreter's start-up (seconds of imports) overlaps it; the job's work starts at ``go()``,
  where the test would otherwise have started it."""

  def __init__(self, tmp_path, name, *args, env=None, paused=False):
    self.out = tmp_path / f'{name}.out'
    self.err = tmp_path / f'{name}.err'
    self._go = tmp_path / f'{name}.go'
    argv = procs.worker_argv(lw, *args)
    if paused:
      argv += ['--after', str(self._go)]
    with open(self.out, 'wb') as out, open(self.err, 'wb') as err:
      self.proc = procs.start(argv, env=env, devices=None, stdout=out, stderr=err)

  def go(self):
    self._go.touch()
    return self

  def lines(self):
    return [json.loads(l) for l in self.out.read_text().splitlines() if l.startswith('{')]

  def wait_for(self, key, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      for line in self.lines():
        if key in line:
          return line
      assert self.proc.poll() is None, self.tail()
      time.sleep(0.1)
    raise AssertionError(f'no {key!r} line after {timeout} s: {self.tail()}')

  def finish(self, timeout=TIMEOUT):
    self.proc.wait(timeout)
    assert self.proc.returncode == 0, self.tail()
    return self.lines()

  def stderr(self):
    return self.err.read_text(errors='replace')

  def tail(self):
    return f'stdout:\n{self.out.read_text()[-3000:]}\nstderr:\n{self.stderr()[-5000:]}'

  def kill(self):
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()


def _finish(job):
  """Lets a job (paused or not) run to its end: its JSON lines and stderr."""
  try:
    return job.go().finish(), job.stderr()
  finally:
    job.kill()


def _kill_all(jobs):
  for job in jobs:
    job.kill()


def _saves(lines):
  return {l['step']: l for l in lines if 'step' in l}


def _lease_json(directory):
  from etils import epath  # pylint: disable=g-import-not-at-top
  path = epath.Path(lease.lease_path(directory))
  return json.loads(path.read_text()) if path.exists() else None


@pytest.fixture(params=['local', pytest.param('gcs', marks=pytest.mark.gcs)])
def ckpt_dir(request, tmp_path):
  if request.param == 'local':
    return str(tmp_path / 'ckpt')
  bucket = request.getfixturevalue('gcs_bucket')
  return bucket.path('ckpt')


def test_second_writer_refused_then_takes_over_once_the_first_is_killed(ckpt_dir, tmp_path):
  first = Job(tmp_path, 'first', 'save', ckpt_dir, 'A', '0,1', '--hold', tmp_path / 'never')
  # Every later job starts now, paused; each runs where the test lets it go.
  second = Job(tmp_path, 'second', 'save', ckpt_dir, 'B', '2', paused=True)
  readers = [Job(tmp_path, 'reader' + ''.join(flags), 'read', ckpt_dir, *flags, paused=True)
             for flags in ([], ['--stock'])]
  restarted = Job(tmp_path, 'restarted', 'save', ckpt_dir, 'B', '2', paused=True)
  final = Job(tmp_path, 'final', 'read', ckpt_dir, paused=True)
  try:
    pid_a = first.wait_for('ready')['ready']
    assert all(s['ok'] for s in _saves(first.lines()).values()), first.tail()
    held = _lease_json(ckpt_dir)
    assert held['pid'] == pid_a and held['processes'] == 1

    # A second job saving into the same directory is refused, naming both, and writes nothing.
    lines, _ = _finish(second)
    refused = _saves(lines)[2]
    pid_b = next(l['ready'] for l in lines if 'ready' in l)
    assert not refused['ok'] and refused['type'] == 'WriterLeaseError', refused
    text = refused['error']
    assert text.startswith(f'orbax_pathways: refusing to save into {ckpt_dir}: another job is '
                           'saving into it.'), text
    assert f'{ckpt_dir}/{lease.LEASE_FILE} is held by' in text
    assert f'(pid {pid_a};' in text and f'(pid {pid_b})' in text, text
    assert 'Stop the other job' in text and 'ORBAX_PATHWAYS_LEASE_TIMEOUT_S' in text

    # Evaluators (ours and stock Orbax) list and restore while the lease is held, and leave it.
    for reader, flags in zip(readers, ([], ['--stock'])):
      lines, _ = _finish(reader)
      assert lines[-1]['steps'] == [0, 1] and lines[-1]['values'] == {'0': 'A0', '1': 'A1'}
      assert lines[-1]['pathways'] == (not flags)
    assert _lease_json(ckpt_dir)['token'] == held['token']

    # kill -9 the first job: the restarted second one takes its lease over, with one warning.
    first.kill()
    lines, err = _finish(restarted)
    assert _saves(lines)[2]['ok'], err[-3000:]
    warnings = [l for l in err.splitlines() if 'took over the writer lease' in l]
    assert len(warnings) == 1, err[-3000:]
    assert f'process {pid_a} on this host, is gone' in warnings[0], warnings
    assert _lease_json(ckpt_dir) is None  # released on close()
    lines, _ = _finish(final)
    assert lines[-1]['values'] == {'0': 'A0', '1': 'A1', '2': 'B2'}
  finally:
    _kill_all([first, second, *readers, restarted, final])


@pytest.mark.gcs
def test_restarted_jobs_each_save_a_new_step_on_gcs(gcs_bucket, tmp_path):
  """Each restart is a fresh process saving the next step into the same gs:// directory (its
  predecessor's lease released). Before gcsfs's listing cache was dropped ahead of Orbax's
  finalize, about half of these commits failed ('Checkpoint directory does not exist')."""
  ckpt_dir = gcs_bucket.path('ckpt')
  specs = [(f'job{step}', 'save', ckpt_dir, 'A', str(step)) for step in range(6)]
  specs.append(('final', 'read', ckpt_dir))
  jobs = [Job(tmp_path, *specs[0], paused=True)]
  try:
    for step in range(6):
      # The next job starts up, paused, while this one runs; it goes once this one has exited.
      jobs.append(Job(tmp_path, *specs[step + 1], paused=True))
      lines, err = _finish(jobs[step])
      assert _saves(lines)[step]['ok'], (_saves(lines)[step], err[-2000:])
    lines, _ = _finish(jobs[-1])
    assert lines[-1]['values'] == {str(s): f'A{s}' for s in range(6)}
  finally:
    _kill_all(jobs)


def test_a_stalled_writer_loses_its_lease_and_is_refused_at_its_next_save(tmp_path):
  """The first job stops renewing (SIGSTOP: alive, silent, like a host cut off). Past the
  timeout the second takes over; the first, resumed, is refused at its next save, naming the
  new owner; the directory holds the first's steps before and the second's after."""
  ckpt_dir = str(tmp_path / 'ckpt')
  env = {lease.TIMEOUT_ENV: 3}
  first = Job(tmp_path, 'first', 'save', ckpt_dir, 'A', '0', '--hold', tmp_path / 'go-a',
              '--then', '3', env=env)
  second = Job(tmp_path, 'second', 'save', ckpt_dir, 'B', '1,2', '--hold', tmp_path / 'go-b',
               env=env, paused=True)
  final = Job(tmp_path, 'final', 'read', ckpt_dir, paused=True)
  try:
    pid_a = first.wait_for('ready')['ready']
    os.kill(pid_a, signal.SIGSTOP)
    time.sleep(3.5)
    second.go()
    pid_b = second.wait_for('ready')['ready']
    assert all(s['ok'] for s in _saves(second.lines()).values()), second.tail()
    warnings = [l for l in second.stderr().splitlines() if 'took over the writer lease' in l]
    assert len(warnings) == 1 and f'(pid {pid_a};' in warnings[0], second.stderr()[-3000:]
    assert 'not renewed for' in warnings[0], warnings
    os.kill(pid_a, signal.SIGCONT)
    (tmp_path / 'go-a').touch()
    lost = _saves(first.finish())[3]
    assert not lost['ok'] and lost['type'] == 'WriterLeaseError', lost
    assert 'no longer holds its writer lease' in lost['error'], lost
    assert f'(pid {pid_b};' in lost['error'], lost['error']
    (tmp_path / 'go-b').touch()
    second.finish()
    lines, _ = _finish(final)
    assert lines[-1]['values'] == {'0': 'A0', '1': 'B1', '2': 'B2'}
    assert _lease_json(ckpt_dir) is None
  finally:
    try:
      os.kill(first.proc.pid, signal.SIGCONT)
    except ProcessLookupError:
      pass
    _kill_all([first, second, final])


def test_a_multi_controller_job_is_one_owner(tmp_path):
  """Two jax.distributed processes save together: one lease, written by process 0, naming 2
  processes, and released on close. While a single-process job holds the lease, every process
  of a second two-process job is refused at the same save (none is left waiting in a barrier)."""
  from support.mp_harness import run_processes  # pylint: disable=g-import-not-at-top
  ckpt_dir = str(tmp_path / 'ckpt')
  holder = Job(tmp_path, 'holder', 'save', ckpt_dir, 'C', '2', '--hold', tmp_path / 'never',
               paused=True)
  final = Job(tmp_path, 'final', 'read', ckpt_dir, paused=True)
  try:
    results = run_processes(WORKER, 2, 1, args=['mp', ckpt_dir, 'A', '0,1'], timeout=TIMEOUT)
    for r in results:
      assert [o['ok'] for o in r.result['outcomes']] == [True, True], r.result
    tokens = [r.result['held'] for r in results]
    assert list(tokens[0]) == [ckpt_dir] and tokens[1] == {}, tokens  # process 0 only
    assert _lease_json(ckpt_dir) is None

    holder.go().wait_for('ready')
    results = run_processes(WORKER, 2, 1, args=['mp', ckpt_dir, 'A', '3'], timeout=TIMEOUT)
    for r in results:
      (outcome,) = r.result['outcomes']
      assert not outcome['ok'] and outcome['type'] == 'WriterLeaseError', outcome
      assert f'(pid {holder.proc.pid};' in outcome['error'], outcome['error']
      assert f'(pid {results[0].result["pid"]}, 2 processes)' in outcome['error']
    holder.kill()
    lines, _ = _finish(final)
    assert lines[-1]['values'] == {'0': 'A0', '1': 'A1', '2': 'C2'}
  finally:
    _kill_all([holder, final])


def test_values_helper():
  assert lw.tag_of(lw.values('B', 2)) == 'B2'
