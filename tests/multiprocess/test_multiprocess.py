"""orbax-pathways under real multi-controller JAX: N jax.distributed CPU processes (gloo) on
127.0.0.1 share one checkpoint directory and run *unchanged* ``ocp.CheckpointManager`` code after
``import orbax_pathways`` (worker: ``tests/support/workers/pathways_worker.py``).

Everything here is real: processes, Orbax, OCDBT, tensorstore. The parent computes from the
shardings alone what each process must write / read and checks what the workers report
(``orbax_pathways.stats``), what they wrote (``_pathways/p<i>.msgpack``, ``ocdbt.process_<i>``)
and sha256 of every addressable shard after restore.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import time

import numpy as np
import pytest

from orbax_pathways.format import records as records_lib
from support.mp_harness import run_processes
from support.workers import pathways_worker as wk  # numpy-only top: the workers' values, specs

pytestmark = pytest.mark.multiprocess

WORKER = wk.__file__

MiB = 1 << 20
MIN_SPLIT_BYTES = 1 << 20  # plan/save.py: replica-split pieces are at least this big
STEP = 1
TIMEOUT = 90


def _run(n, d, mode, ckpt, *extra, **kw):
  t0 = time.monotonic()
  results = run_processes(WORKER, n, d, args=[mode, str(ckpt), *extra], shared_dir=str(ckpt.parent),
                          timeout=TIMEOUT, **kw)
  elapsed = time.monotonic() - t0
  for r in results:
    assert r.result is not None, r.stderr_tail
    assert r.result['process_index'] == r.process_id
  print(f'[{mode} {n}x{d}] {elapsed:.1f}s')
  return results


# ---- what the shardings say (parent side, integers only) ------------------------------------

def _axes(entry):
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def device_boxes(shape, spec, mesh_shape, axis_names=wk.AXES):
  """{mesh coordinate: box} for NamedSharding(Mesh(devices.reshape(mesh_shape)), P(*spec)).

  Mesh coordinates are row-major over ``jax.devices()`` (sorted by id), so coordinate (i, j) of
  the (processes, devices-per-process) meshes used here is device j of process i."""
  sizes = dict(zip(axis_names, mesh_shape))
  spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  out = {}
  for coord in itertools.product(*map(range, mesh_shape)):
    pos = dict(zip(axis_names, coord))
    start, stop = [], []
    for dim, entry in zip(shape, spec):
      axes = _axes(entry)
      parts = math.prod(sizes[a] for a in axes)
      idx = 0
      for a in axes:  # major to minor, as JAX lays out a multi-axis dimension
        idx = idx * sizes[a] + pos[a]
      block = dim // parts
      start.append(idx * block)
      stop.append(idx * block + block)
    out[coord] = (tuple(start), tuple(stop))
  return out


def _size(box):
  return math.prod(b - a for a, b in zip(*box))


def expected_written(shape, itemsize, spec, n, d, *, replica_parallel=True):
  """{process: bytes} each process must write: each distinct shard once, by a process whose
  device holds it; a shard held on R >= 2 processes is split among them when the (uniform) shards
  divide by R along some axis into pieces >= 1 MiB; otherwise the lowest device id writes."""
  boxes = device_boxes(shape, spec, (n, d))
  holders = {}
  for coord in sorted(boxes):  # row-major == device-id order
    holders.setdefault(boxes[coord], []).append(coord[0])
  procs = {b: list(dict.fromkeys(p)) for b, p in holders.items()}
  r = min(len(p) for p in procs.values())
  shard_shape = {tuple(b - a for a, b in zip(*box)) for box in procs}
  split = False
  if replica_parallel and r > 1 and len(shard_shape) == 1:
    (ss,) = shard_shape
    split = (any(x % r == 0 and x >= r for x in ss)
             and math.prod(ss) * itemsize // r >= MIN_SPLIT_BYTES)
  out = {p: 0 for p in range(n)}
  for box, ps in procs.items():
    nbytes = _size(box) * itemsize
    if split:
      for p in ps[:r]:
        out[p] += nbytes // r
    else:
      out[ps[0]] += nbytes
  return out


def expected_state_written(n, d):
  total = {p: 0 for p in range(n)}
  for shape, dtype, spec in wk.STATE_SPECS.values():
    for p, b in expected_written(shape, np.dtype(dtype).itemsize, spec, n, d).items():
      total[p] += b
  return total


DISTINCT_STATE_BYTES = sum(
    math.prod(s) * np.dtype(t).itemsize for s, t, _ in wk.STATE_SPECS.values())


@functools.lru_cache(maxsize=None)
def _values():
  return wk.state_values()


@functools.lru_cache(maxsize=None)
def _sha(name, index):
  return wk.sha(_values()[name][tuple(slice(a, b) for a, b in index)])


def _strip(spec):
  spec = list(spec)
  while spec and spec[-1] is None:
    spec.pop()
  return spec


def check_restored(results, key, *, n, d, mesh=None):
  """Every process holds d shards of every array, each with the right bytes, and the
  processes' shards tile every array; returns the mesh shapes reported."""
  mesh = mesh or {'proc': n, 'local': d}
  values = _values()
  meshes = set()
  covered = {k: np.zeros(v.shape, dtype=bool) for k, v in values.items()}
  seen_devices = set()
  for r in results:
    out = r.result[key]
    assert out['step'] == {'value': wk.STEP_VALUE, 'type': 'int'}, out['step']
    for name, (shape, dtype, spec) in wk.STATE_SPECS.items():
      e = out[name]
      assert e['shape'] == list(shape) and e['dtype'] == dtype, (name, e['shape'], e['dtype'])
      assert e['mesh'] == mesh, (r.process_id, name, e['mesh'])
      assert _strip(e['spec']) == _strip(spec), (name, e['spec'])
      assert e['num_devices'] == n * d, (name, e['num_devices'])
      assert len(e['shards']) == d, (r.process_id, name, len(e['shards']))
      for sh in e['shards']:
        assert sh['process'] == r.process_id
        assert sh['dtype'] == dtype
        index = tuple(tuple(x) for x in sh['index'])
        assert sh['sha'] == _sha(name, index), (key, r.process_id, name, sh)
        covered[name][tuple(slice(a, b) for a, b in index)] = True
        seen_devices.add(sh['device'])
      meshes.add(tuple(sorted(e['mesh'].items())))
  assert len(seen_devices) == n * d
  for name, c in covered.items():
    assert c.all(), f'{key}: the processes\' shards of {name!r} do not cover it'
  return meshes


def _item(ckpt, step):
  return ckpt / str(step) / 'default'


def _records(ckpt, step, n):
  item = _item(ckpt, step)
  out = {}
  for i in range(n):
    path = item / '_pathways' / f'p{i}.msgpack'
    assert path.is_file(), sorted(os.listdir(item / '_pathways'))
    out[i] = records_lib.decode(path.read_bytes(), path=str(path))
  return out


def check_save(results, ckpt, step, *, n, d):
  """Per-process bytes == the share its devices hold, totals == distinct bytes, files exist,
  and every chunk a process recorded lies inside a shard one of its own devices holds."""
  want = expected_state_written(n, d)
  assert sum(want.values()) == DISTINCT_STATE_BYTES
  got = {}
  for r in results:
    p, s = r.process_id, r.result['save']
    key = f'p{p}'
    assert s['transport'] == 'in_process'
    assert set(s['written_bytes']) == {key}, s['written_bytes']  # only its own host key
    got[p] = s['written_bytes'][key]
    assert s['d2h_bytes'] == {key: got[p]}, s  # only the written pieces crossed to the host
    assert s['controller_tensor_bytes'] == (got[p] if p == 0 else 0), s
  assert got == want, f'written bytes per process {got}, expected from the shardings {want}'
  assert sum(got.values()) == DISTINCT_STATE_BYTES  # each distinct shard written exactly once

  item = _item(ckpt, step)
  assert (ckpt / str(step) / 'commit_success.txt').is_file() or (item / 'manifest.ocdbt').is_file()
  assert (item / 'manifest.ocdbt').is_file()
  for i in range(n):
    assert (item / f'ocdbt.process_{i}').is_dir(), sorted(os.listdir(item))
  assert not (item / f'ocdbt.process_{n}').exists()
  records = _records(ckpt, step, n)
  for p, rec in records.items():
    assert rec.writer == f'p{p}' and rec.transport == 'local'
    assert rec.stats['written_bytes'] == got[p]
    for a in rec.arrays:
      shape, dtype, spec = wk.STATE_SPECS[a.name]
      mine = {box for (proc, _), box in device_boxes(shape, spec, (n, d)).items() if proc == p}
      for c in a.chunks:
        # Inside what this process's devices hold (a coalesced small array's chunk may span
        # several of its shards, never another process's).
        stop = tuple(min(o + cs, dim) for o, cs, dim in zip(c.origin, a.chunk_shape, shape))
        held = sum(math.prod(max(0, min(e, s1) - max(o, s0))
                             for o, e, s0, s1 in zip(c.origin, stop, *box)) for box in mine)
        assert held == math.prod(e - o for o, e in zip(c.origin, stop)), (
            p, a.name, c.origin, 'not held by this process')
      assert sum(c.nbytes for c in a.chunks) == expected_written(
          shape, np.dtype(dtype).itemsize, spec, n, d)[p], (p, a.name)
      if a.name == 'global':  # 6 KiB over all devices: each process's band is one chunk
        assert len(a.chunks) == 1 and a.chunk_shape == (shape[0] // n, shape[1]), (p, a)
  return got


# ---- 1. save from every process, same-topology restore ---------------------------------------

def _check_roundtrip(results, ckpt, n, d):
  got = check_save(results, ckpt, STEP, n=n, d=d)
  check_restored(results, 'saved', n=n, d=d)
  check_restored(results, 'restored_no_target', n=n, d=d)
  check_restored(results, 'restored_target', n=n, d=d)
  print(f'{n}x{d} written bytes per process: {got} (distinct {DISTINCT_STATE_BYTES})')
  # Replica-parallel: the 8 MiB array held by every process is written by all of them.
  shape, dtype, spec = wk.STATE_SPECS['local_rep']
  rep = expected_written(shape, 4, spec, n, d)
  assert set(rep.values()) == {math.prod(shape) * 4 // n}, rep
  assert sum(expected_written(shape, 4, spec, n, d, replica_parallel=False).values()) == \
      math.prod(shape) * 4


def test_save_restore_2_processes_x_4_devices(tmp_path):
  ckpt = tmp_path / 'ckpt'
  results = _run(2, 4, 'save_restore', ckpt, f'step={STEP}')
  _check_roundtrip(results, ckpt, 2, 4)


@pytest.fixture(scope='module')
def saved_4x2(tmp_path_factory):
  """4 processes x 2 devices save step STEP and restore it; the checkpoint is reused below."""
  ckpt = tmp_path_factory.mktemp('elastic') / 'ckpt'
  return ckpt, _run(4, 2, 'save_restore', ckpt, f'step={STEP}')


def test_save_restore_4_processes_x_2_devices(saved_4x2):
  ckpt, results = saved_4x2
  _check_roundtrip(results, ckpt, 4, 2)


# ---- 2. elastic: 4 processes -> 3, 2 -> 4 ----------------------------------------------------

@pytest.fixture(scope='module')
def shrunk(saved_4x2):
  ckpt, _ = saved_4x2
  return {
      3: _run(3, 2, 'restore', ckpt, f'step={STEP}'),
      2: _run(2, 2, 'restore', ckpt, f'step={STEP}', f'save_next={STEP + 1}'),
  }


@pytest.mark.parametrize('m', [3, 2])
def test_elastic_restore_4_processes_onto_fewer(shrunk, m):
  results = shrunk[m]
  for key in ('restored_no_target', 'restored_unsharded_target'):
    meshes = check_restored(results, key, n=m, d=2)
    assert meshes == {(('local', 2), ('proc', m))}, meshes  # slice axis 'proc' resized 4 -> m
  for r in results:
    st = r.result['restore_no_target_stats']
    print(f'restore 4->{m} p{r.process_id}: read {st["bytes_read"]} needed {st["bytes_needed"]}')


def test_elastic_resave_from_2_processes(saved_4x2, shrunk):
  ckpt, _ = saved_4x2
  got = check_save(shrunk[2], ckpt, STEP + 1, n=2, d=2)
  print(f'2x2 re-save written bytes per process: {got} (distinct {DISTINCT_STATE_BYTES})')


def test_elastic_saved_record_marks_processes_as_slices(saved_4x2):
  ckpt, _ = saved_4x2
  rec = _records(ckpt, STEP, 4)[0]
  for a in rec.arrays:
    assert a.sharding is not None and a.sharding.kind == 'named'
    assert a.sharding.device_slices == (0, 0, 1, 1, 2, 2, 3, 3), (a.name, a.sharding)
    assert a.sharding.num_slices == 4 and a.sharding.slice_axes == ('proc',), (a.name, a.sharding)


def test_elastic_grow_2_processes_to_4_without_target(saved_4x2, shrunk):
  ckpt, _ = saved_4x2
  results = _run(4, 2, 'restore', ckpt, f'step={STEP + 1}', fail_fast_grace=2)
  for key in ('restored_no_target', 'restored_unsharded_target'):
    assert check_restored(results, key, n=4, d=2) == {(('local', 2), ('proc', 4))}


# ---- 3. bytes read when restoring row-saved data by columns ----------------------------------

SMALL_CHUNK_BYTES = 256 * 1024
METADATA_ALLOWANCE = 64 * 1024


@pytest.fixture(scope='module')
def bytes_run(tmp_path_factory):
  ckpt = tmp_path_factory.mktemp('bytes') / 'ckpt'
  return ckpt, _run(2, 4, 'bytes', ckpt, f'small_chunk_bytes={SMALL_CHUNK_BYTES}')


def _check_bytes(bytes_run, label):
  ckpt, results = bytes_run
  value = wk.value('big', wk.BYTES_SHAPE, 'float32')
  rows, cols = wk.BYTES_SHAPE
  chunk_shape = _records(ckpt / label, 0, 2)[0].arrays[0].chunk_shape
  report = {}
  for r in results:
    p = r.process_id
    out = r.result[label]
    assert out['save']['written_bytes'] == {f'p{p}': rows * cols * 4 // 2}
    e = out['restored']['big']
    assert e['mesh'] == {'a': 2, 'b': 4} and _strip(e['spec']) == [None, 'a']
    half = slice(p * cols // 2, (p + 1) * cols // 2)
    for sh in e['shards']:
      assert [tuple(x) for x in sh['index']] == [(0, rows), (half.start, half.stop)]
      assert sh['sha'] == wk.sha(value[:, half])
    needed = rows * cols * 4 // 2  # one column half, shared by the process's 4 devices
    st = out['restore']
    assert st['bytes_needed'] == {f'p{p}': needed}
    report[p] = (st['bytes_read'][f'p{p}'], needed)
  print(f'bytes read vs needed ({label}, chunk_shape {chunk_shape}): '
        + ', '.join(f'p{p}: {rd} / {nd} ({rd / nd:.2f}x)' for p, (rd, nd) in report.items()))
  for p, (rd, nd) in report.items():
    assert rd <= 1.1 * nd + METADATA_ALLOWANCE, (
        f'p{p} read {rd} bytes for {nd} needed ({rd / nd:.2f}x) with chunk_shape {chunk_shape}')
  return chunk_shape


def test_bytes_read_bound_default_chunks(bytes_run):
  _check_bytes(bytes_run, 'default')


def test_bytes_read_bound_small_chunks(bytes_run):
  chunk_shape = _check_bytes(bytes_run, 'small')
  assert tuple(chunk_shape) == (128, 512)


# ---- 4. a process-local array cannot be saved from several processes -------------------------

def test_process_local_array_raises_save_error(tmp_path):
  ckpt = tmp_path / 'ckpt'
  results = _run(2, 2, 'local_array', ckpt)
  for r in results:
    chain = r.result['raised']
    assert chain, 'save() of a process-local array did not raise'
    err = next((c for c in chain if c['is_save_error']), None)
    assert err is not None, chain
    assert err['type'] == 'SaveError' and err['module'] == 'orbax_pathways.errors'
    msg = err['message']
    assert "'host_local'" in msg and 'multi-process' in msg, msg
    assert 'make_array_from_process_local_data' in msg, msg  # how to fix it
    assert 'host_local_array_to_global_array' in msg, msg
  assert not (ckpt / '1').exists()  # nothing committed


# ---- 5. a restore target on a subset of the processes ----------------------------------------

def test_restore_onto_devices_of_one_process(tmp_path):
  results = _run(2, 2, 'submesh', tmp_path / 'ckpt', fail_fast_grace=2)
  value = wk.value('sub', (16, 8), 'float32')
  r0, r1 = (r.result['restored'] for r in results)
  assert r0['num_devices'] == 2 and r1['num_devices'] == 2
  assert r1['shards'] == []  # process 1 holds none of it
  assert [sh['index'] for sh in r0['shards']] == [[[0, 8], [0, 8]], [[8, 16], [0, 8]]]
  for sh in r0['shards']:
    assert sh['sha'] == wk.sha(value[tuple(slice(a, b) for a, b in sh['index'])])
