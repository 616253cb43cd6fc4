"""Proves tests/support/mp_harness.py: stock orbax CheckpointManager save/restore across real
jax.distributed CPU processes (gloo), plus the harness's own failure/timeout handling."""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest

from support import procs
from support.mp_harness import MultiProcessError, run_processes
from support.workers import harness_echo_worker, harness_failing_worker, harness_sleeping_worker
from support.workers import harness_roundtrip_worker as roundtrip

pytestmark = pytest.mark.multiprocess

GLOBAL_SHAPE = roundtrip.GLOBAL_SHAPE
REPLICATED_SHAPE = roundtrip.REPLICATED_SHAPE
STEP = roundtrip.STEP


def _check_shards(shards, global_value, *, expect_count):
  assert len(shards) == expect_count
  for sh in shards:
    idx = tuple(slice(a, b) for a, b in sh['index'])
    want = np.ascontiguousarray(global_value[idx])
    assert sh['dtype'] == str(want.dtype)
    assert sh['sha'] == hashlib.sha256(want.tobytes()).hexdigest(), sh


def _run_roundtrip(tmp_path, num_processes, devices_per_process):
  t0 = time.monotonic()
  results = run_processes(
      roundtrip.__file__, num_processes, devices_per_process, shared_dir=tmp_path, timeout=120)
  elapsed = time.monotonic() - t0
  expected = roundtrip.values()

  all_devices = []
  covered_w = np.zeros(GLOBAL_SHAPE, dtype=bool)
  for r in results:
    out = r.result
    assert out is not None, r.stderr_tail
    assert out['process_index'] == r.process_id
    assert out['latest_step'] == STEP
    assert len(out['local_devices']) == devices_per_process
    all_devices += out['local_devices']
    for phase in ('saved', 'same', 'moved'):
      for name in ('w', 'r'):
        _check_shards(out[phase][name], expected[name], expect_count=devices_per_process)
    assert out['same']['step'] == STEP
    for sh in out['same']['w']:
      covered_w[tuple(slice(a, b) for a, b in sh['index'])] = True
  # 8 distinct global devices. NB: multi-process CPU device ids are not 0..7; jax numbers them
  # process_index * 2048 + local index (so the `_sharding` file orbax writes records e.g. 2048).
  assert len(set(all_devices)) == 8
  assert sorted(all_devices) == sorted(
      p * 2048 + d for p in range(num_processes) for d in range(devices_per_process))
  assert covered_w.all()  # the processes' addressable shards tile the whole array

  item = tmp_path / 'ckpt' / str(STEP) / 'default'
  assert (tmp_path / 'ckpt' / str(STEP) / 'commit_success.txt').is_file()
  assert (item / 'manifest.ocdbt').is_file()  # per-process trees merged by process 0
  for i in range(num_processes):
    assert (item / f'ocdbt.process_{i}').is_dir(), sorted(os.listdir(item))
    assert (item / 'array_metadatas' / f'process_{i}').is_file()
  assert not (item / f'ocdbt.process_{num_processes}').exists()
  assert not any(p.name.endswith('orbax-checkpoint-tmp') for p in (tmp_path / 'ckpt').iterdir())
  return elapsed


def test_orbax_roundtrip_2_processes_x_4_devices(tmp_path):
  elapsed = _run_roundtrip(tmp_path, 2, 4)
  print(f'2x4 orbax roundtrip: {elapsed:.1f}s')


def test_orbax_roundtrip_4_processes_x_2_devices(tmp_path):
  elapsed = _run_roundtrip(tmp_path, 4, 2)
  print(f'4x2 orbax roundtrip: {elapsed:.1f}s')


# --- the harness itself -----------------------------------------------------------------------

def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie still answers kill(0); treat it as dead.
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().split(')')[-1].split()[0] != 'Z'
  except FileNotFoundError:
    return False


def test_failure_reports_every_stderr_and_kills_peers():
  t0 = time.monotonic()
  with pytest.raises(MultiProcessError) as ei:
    run_processes(harness_failing_worker.__file__, 2, 1, timeout=60, fail_fast_grace=2)
  elapsed = time.monotonic() - t0
  msg = str(ei.value)
  assert 'deliberate failure in process 1' in msg
  assert '===== process 0' in msg and '===== process 1' in msg
  by_id = {r.process_id: r for r in ei.value.results}
  assert by_id[1].returncode == 1
  assert by_id[0].returncode is None  # blocked in a barrier with the dead peer: killed
  assert elapsed < 30  # did not wait for gloo / heartbeat timeouts
  for r in ei.value.results:
    assert not _alive(r.results[0]['grandchild'])


def test_timeout_kills_everything():
  t0 = time.monotonic()
  with pytest.raises(MultiProcessError, match='timed out') as ei:
    run_processes(harness_sleeping_worker.__file__, 3, 1, timeout=2)
  assert time.monotonic() - t0 < 10
  assert all(r.returncode is None for r in ei.value.results)
  ps = procs.run(['ps', '-eo', 'pid,args'], timeout=30).stdout
  for r in ei.value.results:
    if r.stdout_tail.startswith('pid '):
      pid = int(r.stdout_tail.split()[1])
      assert not _alive(pid), ps


def test_emit_args_env_and_shared_dir(tmp_path):
  shared = tmp_path / 'shared'
  results = run_processes(
      harness_echo_worker.__file__, 2, 3, args=['a', 'b'], env={'EXTRA': 'x'}, shared_dir=shared,
      per_process_args=[['p0'], ['p1']], timeout=60)
  for r in results:
    assert r.results[0] == {'first': True}
    assert r.result == {'argv': ['a', 'b', f'p{r.process_id}'], 'extra': 'x',
                        'pid': r.process_id, 'n': 2, 'devs': 6, 'coll': 'gloo'}
  assert sorted(os.listdir(shared)) == ['hello_0', 'hello_1']
