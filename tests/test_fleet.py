"""Fleet scale (issue 14): what one host reads, and what one worker call carries, does not grow
with the number of hosts.

- Simulated fleets: one interpreter with 64 or 256 CPU devices
  (``--xla_force_host_platform_device_count``, set before jax is imported, so each size runs in
  a subprocess); the colocated transport makes every CPU device its own worker host.
- Real multi-controller: 8 ``jax.distributed`` processes (``tests/support/workers/fleet_worker.py``).
- Requests per step on fake-gcs-server, ours against stock Orbax in the same subprocess.

Counts are asserted; timings live in ``benchmarks/fleet.py``.
"""

from __future__ import annotations

import concurrent.futures
import os
import textwrap

import pytest

from support.mp_harness import run_processes
from support.procs import run_json
from support.workers import fleet_worker

# An exception nobody could raise (a callback into a closed event loop) or a coroutine never
# awaited fails the test (issue 26, item 13).
pytestmark = [pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning'),
              pytest.mark.filterwarnings('error:coroutine .* was never awaited:RuntimeWarning')]

FLEETS = (64, 256)


def _run_fleet(n: int, code: str) -> dict:
  """Runs ``code`` in a fresh interpreter with ``n`` CPU devices; returns the JSON it printed last."""
  return run_json(code, devices=n, timeout=600)


def _per_fleet(fn) -> dict:
  """``{n: fn(n)}`` for every fleet size, the sizes in parallel (independent subprocesses)."""
  with concurrent.futures.ThreadPoolExecutor(len(FLEETS)) as pool:
    return dict(zip(FLEETS, pool.map(fn, FLEETS)))


# ---- 1. what one colocated worker call carries -------------------------------------------------

PAYLOAD_CHILD = """
    import dataclasses, json, sys
    import cloudpickle, jax, numpy as np, orbax.checkpoint as ocp
    from jax.experimental.colocated_python import serialization
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import orbax_pathways
    from orbax_pathways.storage import meta_io
    from orbax_pathways.transports import colocated

    n = jax.device_count()
    mesh = Mesh(np.asarray(jax.devices()).reshape(n // 4, 4), ('data', 'model'))
    # A fixed share per host: every device holds 8x64, 16x32 and 16x64 (4 replicas) elements.
    layout = {'a': ((n * 8, 64), P(('data', 'model'))), 'b': ((n // 4 * 16, 128), P('data', 'model')),
              'c': ((n // 4 * 16, 64), P('data'))}
    rng = np.random.default_rng(0)
    values = {k: rng.standard_normal(shape, dtype=np.float32) for k, (shape, _) in layout.items()}
    state = {k: jax.device_put(values[k], NamedSharding(mesh, spec)) for k, (_, spec) in layout.items()}
    target = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for k, a in state.items()}

    ser = serialization._serialize  # what colocated Python pickles and ships to every worker
    def shipped(fn, specs):
      # The pickle also holds the call's output specs; colocated Python writes an equal sharding
      # once, so shardings the function shares with them cost nothing: count what it adds.
      return len(ser((fn, specs))) - len(ser((None, specs)))

    got = {}
    make_save, make_restore = colocated.make_worker_save, colocated.make_worker_restore
    def save_hook(task):
      fn = make_save(task)
      got['save_task'] = len(cloudpickle.dumps(task))
      got['save_fn'] = shipped(fn, ())
      return fn
    def restore_hook(task):
      fn = make_restore(task)
      specs = tuple(t.sharding for t in task.targets)
      got['restore_fn'] = shipped(fn, specs)
      got['restore_task_no_shardings'] = len(cloudpickle.dumps(dataclasses.replace(
          task, targets=tuple(dataclasses.replace(t, sharding=None) for t in task.targets))))
      got['restore_chunks_in_call'] = sum(len(t.chunks) for t in task.targets)
      return fn
    colocated.make_worker_save, colocated.make_worker_restore = save_hook, restore_hook

    orbax_pathways.install(orbax_pathways.Options(transport='colocated'))
    ckpt = CKPT
    with ocp.CheckpointManager(ckpt) as mngr:
      mngr.save(0, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()
    st = orbax_pathways.stats.last_save()
    meta_io.clear_cache()
    before = meta_io.read_counts()
    with ocp.CheckpointManager(ckpt) as mngr:
      restored = mngr.restore(0, args=ocp.args.StandardRestore(target))
    rst = orbax_pathways.stats.last_restore()
    after = meta_io.read_counts()
    for k, v in values.items():
      np.testing.assert_array_equal(np.asarray(restored[k]), v, err_msg=k)
    got.update(
        row=max(colocated.payload_row_bytes), writers=len(st.written_bytes),
        readers=len(rst.bytes_read), verified=rst.chunks_verified,
        index_reads=after.get('index', 0) - before.get('index', 0),
        record_reads=after.get('record', 0) - before.get('record', 0))
    print(json.dumps(got))
"""


@pytest.fixture(scope='module')
def payloads(tmp_path_factory):
  base = tmp_path_factory.mktemp('fleet')

  def run(n):
    ckpt = base / f'n{n:05d}'  # the same path length at every size: paths are in the call
    return _run_fleet(n, f'CKPT = {str(ckpt)!r}\n' + textwrap.dedent(PAYLOAD_CHILD))

  out = _per_fleet(run)
  for n, got in out.items():
    print(f'[payload] {n} devices: {got}')
  return out


def test_worker_call_carries_the_same_bytes_at_any_fleet_size(payloads):
  small, big = payloads[FLEETS[0]], payloads[FLEETS[-1]]
  # Before issue 14 the save call carried every host's plan (28 KB at 64 devices, 94 KB at 256,
  # 366 KB at 1024) and the restore call every chunk's checksum (53 / 167 / 635 KB).
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

GCS_CHILD = """
    import json, os, sys, time
    import jax, numpy as np, orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from support import gcs_server
    from support.fault_proxy import FaultProxy
    import orbax_pathways
    from orbax_pathways.storage import hedge

    mode, server_url, root = sys.argv[1:4]
    proxy = FaultProxy(server_url, rate=0.0).start()
    seen = []
    orig = proxy._choose
    proxy._choose = lambda m, t: (seen.append(t.replace('%2F', '/')), orig(m, t))[1]
    import tempfile
    for k in gcs_server.FakeGcs.unset_keys():
      os.environ.pop(k, None)
    os.environ.update(gcs_server.hermetic_env(proxy.url, tempfile.mkdtemp()))
    gcs_server.configure_fsspec_anon()

    n = jax.device_count()
    mesh = Mesh(np.asarray(jax.devices()).reshape(n // 4, 4), ('data', 'model'))
    specs = [P('data', 'model'), P(('data', 'model')), P('data'), P('model', 'data')]
    values = {f'a{i}': np.arange(n * 64, dtype=np.float32).reshape(n, 64) + i for i in range(8)}
    state = {k: jax.device_put(v, NamedSharding(mesh, specs[i % 4]))
             for i, (k, v) in enumerate(values.items())}
    target = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for k, a in state.items()}
    out = {}
    for impl in ('stock', 'local', 'colocated'):
      if impl == 'stock':
        orbax_pathways.uninstall()
      else:
        # Hedging off (a deadline of an hour, which no request here reaches): a hedge is a
        # second request issued because the first was slow, so on a loaded machine it would add
        # requests that say nothing about what a step costs; hedging has tests of its own
        # (test_gcs_deadlines, test_gcs_request_kinds).
        orbax_pathways.install(orbax_pathways.Options(
            transport=impl, request_deadline_floor_s=3600, request_deadline_cap_s=3600))
      path = f'{root}/{impl}'
      if mode == 'save':
        with ocp.CheckpointManager(path) as mngr:
          mngr.save(0, args=ocp.args.StandardSave(state))  # the first save: jit, directories
          mngr.wait_until_finished()
          del seen[:]
          mngr.save(1, args=ocp.args.StandardSave(state))
          mngr.wait_until_finished()
      else:
        with ocp.CheckpointManager(path) as mngr:
          del seen[:]
          restored = mngr.restore(1, args=ocp.args.StandardRestore(target))
        for k, v in values.items():
          np.testing.assert_array_equal(np.asarray(restored[k]), v, err_msg=k)
      out[impl] = {'requests': len(seen), 'pathways': sum('/_pathways/' in t for t in seen),
                   'hedged': {k: v for k, v in hedge.counts().items() if v}}
    proxy.stop()
    print(json.dumps(out))
"""


@pytest.mark.gcs
def test_requests_per_step_exceed_stock_by_a_constant_per_host(fake_gcs):
  bucket = fake_gcs.create_bucket(f'fleet-{os.getpid()}')
  code = textwrap.dedent(GCS_CHILD)

  def run(n):
    root = f'gs://{bucket}/n{n}'
    counts = {}
    for mode in ('save', 'restore'):  # the restore in a fresh process: no client cache helps
      counts[mode] = _run_fleet(n, f'import sys; sys.argv = ["-", {mode!r}, {fake_gcs.url!r}, '
                                   f'{root!r}]\n' + code)
    return counts

  per_host = {}
  for n, counts in _per_fleet(run).items():
    print(f'[requests] {n} devices: {counts}')
    save, restore = counts['save'], counts['restore']
    # What is counted is what a step costs: no request was hedged (a second request for a slow
    # one, which depends on the machine's load, not on the fleet's size).
    assert all(not c['hedged'] for m in (save, restore) for c in m.values()), counts
    # Our metadata: the colocated controller writes the index (one PUT; the finalize lists
    # _pathways/ once and finds it); the local transport writes its record, and the finalize
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
    per_host[n] = ((save['colocated']['requests'] - save['stock']['requests']) / n,
                   (restore['colocated']['requests'] - restore['stock']['requests']) / n)
    assert per_host[n][0] <= 8 and per_host[n][1] <= 8, (n, per_host[n], counts)
  (s_small, r_small), (s_big, r_big) = per_host[FLEETS[0]], per_host[FLEETS[-1]]
  assert s_big <= s_small + 0.5 and r_big <= r_small + 0.5, per_host  # a constant per host
