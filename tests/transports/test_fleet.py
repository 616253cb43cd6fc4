"""Fleet scale: what one host reads, and what one worker call carries, does not grow
with the number of hosts.

- Simulated fleets: one interpreter with 64 or 256 CPU devices
  (``--xla_force_host_platform_device_count``, set before jax is imported, so each size runs in
  a subprocess: ``tests/support/workers/fleet_payload_worker.py``); the colocated transport
  makes every CPU device its own worker host.
- Real multi-controller: 8 ``jax.distributed`` processes (``tests/support/workers/fleet_worker.py``).
- Requests per step on fake-gcs-server, ours against stock Orbax in the same subprocess
  (``tests/support/workers/fleet_requests_worker.py``).

Counts are asserted; timings live in ``benchmarks/fleet.py``.
"""

from __future__ import annotations

import concurrent.futures
import os

import pytest

from support import procs
from support.mp_harness import run_processes
from support.workers import fleet_payload_worker, fleet_requests_worker, fleet_worker

# An exception nobody could raise (a callback into a closed event loop) or a coroutine never
# awaited fails the test.
pytestmark = [pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning'),
              pytest.mark.filterwarnings('error:coroutine .* was never awaited:RuntimeWarning')]

FLEETS = (64, 256)


def _run_fleet(n: int, worker, *args) -> dict:
  """Runs ``worker`` with ``args`` in a fresh interpreter with ``n`` CPU devices; returns the
  JSON it printed last."""
  return procs.worker_json(worker, *args, devices=n, timeout=600)


def _per_fleet(fn) -> dict:
  """``{n: fn(n)}`` for every fleet size, the sizes in parallel (independent subprocesses)."""
  with concurrent.futures.ThreadPoolExecutor(len(FLEETS)) as pool:
    return dict(zip(FLEETS, pool.map(fn, FLEETS)))


# ---- 1. what one colocated worker call carries -------------------------------------------------

@pytest.fixture(scope='module')
def payloads(tmp_path_factory):
  base = tmp_path_factory.mktemp('fleet')

  def run(n):
    ckpt = base / f'n{n:05d}'  # the same path length at every size: paths are in the call
    return _run_fleet(n, fleet_payload_worker, ckpt)

  out = _per_fleet(run)
  for n, got in out.items():
    print(f'[payload] {n} devices: {got}')
  return out


def test_worker_call_carries_the_same_bytes_at_any_fleet_size(payloads):
  small, big = payloads[FLEETS[0]], payloads[FLEETS[-1]]
  # With every host's plan in it, the save call carried 28 KB at 64 devices, 94 KB at 256 and
  # 366 KB at 1024; with every chunk's checksum, the restore call 53 / 167 / 635 KB.
  for key in ('save_task', 'save_fn', 'restore_fn', 'restore_task_no_shardings', 'row'):
    assert big[key] <= small[key] + 16, (key, small[key], big[key])  # integer widths only
  assert small['save_fn'] < 16_000 and small['restore_fn'] < 16_000, small
  assert big['restore_chunks_in_call'] == 0  # checksums travel per device, in the payload rows


def test_simulated_hosts_each_write_and_read_their_own_share(payloads):
  for n, got in payloads.items():
    assert got['writers'] == n and got['readers'] == n, (n, got)
    assert got['verified'] > 0, got
    # One object of metadata per restore, however many hosts wrote the step.
    assert (got['index_reads'], got['record_reads']) == (1, 0), got


# ---- 2. multi-controller: every process reads one metadata object per restore ------------------


@pytest.mark.multiprocess
def test_each_of_8_processes_reads_one_metadata_object_per_restore(tmp_path):
  n = 8
  results = run_processes(fleet_worker.__file__, n, 1, args=[str(tmp_path / 'ckpt')], shared_dir=str(tmp_path),
                          timeout=240)
  for r in results:
    got = r.result
    assert got['restore_ok'] and got['restore_no_target_ok'] and got['restore_legacy_ok'], got
    assert got['restore_verified'] > 0, got
    assert got['restore'] == {'index': 1}, got
    # metadata() then deserialize(): the second is a conditional read that moves no bytes.
    assert got['restore_no_target'] == {'index': 1, 'index_unchanged': 1}, got
    # A step written before schema 2 (no index): every record, read concurrently.
    assert got['restore_legacy'] == {'list': 1, 'record': n}, got
    if got['process_index'] == 0:  # the primary merges the records at commit, once
      assert got['save'] == {'list': 1, 'record': n}, got
    else:
      assert got['save'] == {}, got


# ---- 3. requests per step on fake-gcs-server, ours against stock --------------------------------

@pytest.mark.gcs
def test_requests_per_step_exceed_stock_by_a_constant_per_host(fake_gcs):
  bucket = fake_gcs.create_bucket(f'fleet-{os.getpid()}')

  def run(n):
    root = f'gs://{bucket}/n{n}'
    counts = {}
    for mode in ('save', 'restore'):  # the restore in a fresh process: no client cache helps
      counts[mode] = _run_fleet(n, fleet_requests_worker, mode, fake_gcs.url, root)
    return counts

  per_host = {}
  for n, counts in _per_fleet(run).items():
    print(f'[requests] {n} devices: {counts}')
    save, restore = counts['save'], counts['restore']
    # What is counted is what a step costs: no request was hedged (a second request for a slow
    # one, which depends on the machine's load, not on the fleet's size).
    assert all(not c['hedged'] for m in (save, restore) for c in m.values()), counts
    # Our metadata: the colocated controller writes the index (one PUT; the finalize lists
    # _pathways/ once and finds it); the in-process transport writes its record, and the finalize
    # lists, reads it and writes the index. A restore reads the index: one GET.
    assert save['colocated']['pathways'] == 2 and save['local']['pathways'] == 4, save
    assert restore['colocated']['pathways'] == 1 and restore['local']['pathways'] == 1, restore
    # One writer (one process): ours within a few requests of stock's. A restore adds the index,
    # and Orbax's own existence checks of the step (4-6 of them) each reach the server because
    # the manager side drops gcsfs's listing cache first, so that a reader sees the steps other
    # processes committed (stock serves them from a listing that never expires).
    assert save['local']['requests'] <= save['stock']['requests'] + 8, save
    assert restore['local']['requests'] <= restore['stock']['requests'] + 18, restore
    # n writer hosts (colocated): each writes its own OCDBT database and reads its own boxes.
    assert save['colocated']['requests'] - save['stock']['requests'] <= 8 * n, (n, counts)
    assert restore['colocated']['requests'] - restore['stock']['requests'] <= 8 * n, (n, counts)
    # What the n writer hosts add over one writer of ours (the same step protocol: what the
    # package saves per step whatever the fleet, below stock's since a save's own small files
    # are one request each and never read back, cancels out), per host. Not against stock: a
    # constant below stock's, divided by n, would grow with n and hide or fake a trend.
    per_host[n] = ((save['colocated']['requests'] - save['local']['requests']) / n,
                   (restore['colocated']['requests'] - restore['local']['requests']) / n)
  (s_small, r_small), (s_big, r_big) = per_host[FLEETS[0]], per_host[FLEETS[-1]]
  assert s_big <= s_small + 0.5 and r_big <= r_small + 0.5, per_host  # a constant per host
