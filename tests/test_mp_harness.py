"""Proves tests/support/mp_harness.py: stock orbax CheckpointManager save/restore across real
jax.distributed CPU processes (gloo), plus the harness's own failure/timeout handling."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time

import numpy as np
import pytest

from support.mp_harness import MultiProcessError, run_processes

pytestmark = pytest.mark.multiprocess

GLOBAL_SHAPE = (32, 16)
REPLICATED_SHAPE = (8, 4)
STEP = 5

# Worker: save a NamedSharding array spread over all 8 global devices with a stock
# ocp.CheckpointManager (StandardSave), restore it (same sharding, and resharded onto a
# different layout), and report a checksum of every addressable shard.
ROUNDTRIP_WORKER = """
import os
import sys

from support import mp_worker as w

w.init()

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

GLOBAL_SHAPE = (32, 16)
REPLICATED_SHAPE = (8, 4)
STEP = 5

assert jax.device_count() == 8, jax.device_count()
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('data', 'model'))
w_np = np.arange(np.prod(GLOBAL_SHAPE), dtype=np.float32).reshape(GLOBAL_SHAPE) * 0.5
r_np = (np.arange(np.prod(REPLICATED_SHAPE), dtype=np.int32) - 7).reshape(REPLICATED_SHAPE)

def make(value, spec):
  s = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(value.shape, s, lambda idx: value[idx])

state = {
    'w': make(w_np, P('data', 'model')),        # 8 distinct shards, one per device
    'r': make(r_np, P('data', None)),           # replicated along 'model'
    'step': STEP,
}
assert not state['w'].is_fully_addressable

shard_sums = w.shard_digests

ckpt_dir = os.path.join(w.shared_dir(), 'ckpt')
mngr = ocp.CheckpointManager(ckpt_dir)
mngr.save(STEP, args=ocp.args.StandardSave(state))
mngr.wait_until_finished()

def target(spec_w, spec_r):
  return {
      'w': jax.ShapeDtypeStruct(GLOBAL_SHAPE, np.float32, sharding=NamedSharding(mesh, spec_w)),
      'r': jax.ShapeDtypeStruct(REPLICATED_SHAPE, np.int32, sharding=NamedSharding(mesh, spec_r)),
      'step': 0,
  }

same = mngr.restore(STEP, args=ocp.args.StandardRestore(target(P('data', 'model'), P('data', None))))
# Resharded: columns over all 8 devices, so every process reads chunks other processes wrote.
moved = mngr.restore(STEP, args=ocp.args.StandardRestore(target(P(None, ('data', 'model')), P())))
mngr.close()

w.emit({
    'process_index': jax.process_index(),
    'local_devices': [d.id for d in jax.local_devices()],
    'saved': {'w': shard_sums(state['w']), 'r': shard_sums(state['r'])},
    'same': {'w': shard_sums(same['w']), 'r': shard_sums(same['r']), 'step': same['step']},
    'moved': {'w': shard_sums(moved['w']), 'r': shard_sums(moved['r'])},
    'latest_step': mngr.latest_step(),
})
"""


def _expected():
  w_np = np.arange(np.prod(GLOBAL_SHAPE), dtype=np.float32).reshape(GLOBAL_SHAPE) * 0.5
  r_np = (np.arange(np.prod(REPLICATED_SHAPE), dtype=np.int32) - 7).reshape(REPLICATED_SHAPE)
  return {'w': w_np, 'r': r_np}


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
      ROUNDTRIP_WORKER, num_processes, devices_per_process, shared_dir=tmp_path, timeout=120)
  elapsed = time.monotonic() - t0
  expected = _expected()

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

FAILING_WORKER = """
import subprocess, sys
from support import mp_worker as w
w.init()
from jax.experimental import multihost_utils
# A grandchild in the worker's process group: must not survive the run.
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
w.emit({'grandchild': child.pid})
if w.process_id() == 1:
  raise RuntimeError('deliberate failure in process 1')
multihost_utils.sync_global_devices('never reached by process 1')  # process 0 blocks here
w.emit({'unreachable': True})
"""


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
    run_processes(FAILING_WORKER, 2, 1, timeout=60, fail_fast_grace=2)
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
    run_processes(
        'import os, time\nprint("pid", os.getpid(), flush=True)\ntime.sleep(600)\n',
        3, 1, timeout=2)
  assert time.monotonic() - t0 < 10
  assert all(r.returncode is None for r in ei.value.results)
  ps = subprocess.run(['ps', '-eo', 'pid,args'], capture_output=True, text=True).stdout
  for r in ei.value.results:
    if r.stdout_tail.startswith('pid '):
      pid = int(r.stdout_tail.split()[1])
      assert not _alive(pid), ps


def test_emit_args_env_and_shared_dir(tmp_path):
  script = tmp_path / 'worker.py'
  script.write_text(
      'import os, sys\n'
      'from support import mp_worker as w\n'
      'w.init()\n'
      'import jax\n'
      'open(os.path.join(w.shared_dir(), f"hello_{w.process_id()}"), "w").close()\n'
      'w.emit({"first": True})\n'
      'w.emit({"argv": sys.argv[1:], "extra": os.environ["EXTRA"], "pid": jax.process_index(),\n'
      '        "n": jax.process_count(), "devs": jax.device_count(),\n'
      '        "coll": jax.config.jax_cpu_collectives_implementation})\n')
  shared = tmp_path / 'shared'
  results = run_processes(
      str(script), 2, 3, args=['a', 'b'], env={'EXTRA': 'x'}, shared_dir=shared,
      per_process_args=[['p0'], ['p1']], timeout=60)
  for r in results:
    assert r.results[0] == {'first': True}
    assert r.result == {'argv': ['a', 'b', f'p{r.process_id}'], 'extra': 'x',
                        'pid': r.process_id, 'n': 2, 'devs': 6, 'coll': 'gloo'}
  assert sorted(os.listdir(shared)) == ['hello_0', 'hello_1']
