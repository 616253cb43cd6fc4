#!/usr/bin/env python3
"""Stock Orbax ArrayHandler vs orbax_pathways' ProxyArrayHandler, same state, same machine.

One run alternates the two handlers (stock, ours, stock, ours, ...) for ``--reps`` repetitions and
prints a table plus JSON (stdout and ``--json-out``) with median / min of every metric and the
ratio ours/stock (< 1 means ours is faster / smaller). See benchmarks/README.md for the metrics.

    .venv/bin/python benchmarks/bench.py --quick              # smoke run, ~1-2 min on 2 cores
    .venv/bin/python benchmarks/bench.py --json-out out.json  # 2 GiB, 3 reps, mode cpu
    .venv/bin/python benchmarks/bench.py --mode gcs           # through fake-gcs-server
    .venv/bin/python benchmarks/bench.py --mode gpu           # default GPU backend, 8 GiB
    .venv/bin/python benchmarks/bench.py --profile restore_fewer  # + py-spy top-15 of ours

Peak RSS is measured in a separate subprocess per (handler, repetition) (this same file, run with
the private ``--_rss-worker`` flag), so allocator state of earlier runs does not leak into it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TESTS = os.path.join(REPO, 'tests')
MiB = 1 << 20
GiB = 1 << 30
IMPLS = ('stock', 'ours')


# ---------------------------------------------------------------------------------------------
# Arguments and environment (must run before jax is imported).
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--mode', choices=('cpu', 'gcs', 'gpu'), default='cpu')
  p.add_argument('--size-gb', type=float, default=None,
                 help='logical (unique) bytes of the state in GiB; default 2 (cpu, gcs), 8 (gpu)')
  p.add_argument('--reps', type=int, default=None, help='repetitions per handler (default 3)')
  p.add_argument('--quick', action='store_true', help='smoke run: 0.25 GiB, 2 reps')
  p.add_argument('--dir', default=None, help='checkpoint root (default: a fresh dir under /tmp)')
  p.add_argument('--json-out', default=None, help='also write the JSON result to this file')
  p.add_argument('--warmup', type=int, default=1,
                 help='untimed rounds of both handlers before the timed reps (default 1)')
  p.add_argument('--tiny-iters', type=int, default=5,
                 help='tiny-checkpoint samples per rep (after one untimed round)')
  p.add_argument('--no-rss', action='store_true', help='skip the peak-RSS subprocesses')
  p.add_argument('--d2h-ref', action='store_true',
                 help='also time a pinned_host device-to-host copy of the state (on in gpu mode)')
  p.add_argument('--profile', default=None,
                 choices=('save', 'commit', 'restore', 'restore_fewer', 'tiny_save', 'tiny_restore'),
                 help='after the benchmark, run one more iteration of this metric with py-spy '
                 'attached and print the top-15 frames (--profile-impl picks the handler)')
  p.add_argument('--profile-impl', choices=IMPLS, default='ours')
  p.add_argument('--profile-native', action='store_true', help='py-spy --native (C++ frames)')
  p.add_argument('--seed', type=int, default=0)
  # private: one peak-RSS measurement in a fresh interpreter
  p.add_argument('--_rss-worker', dest='rss_worker', choices=IMPLS, default=None,
                 help=argparse.SUPPRESS)
  p.add_argument('--_ckpt', dest='worker_ckpt', default=None, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.quick:
    a.size_gb = 0.25 if a.size_gb is None else a.size_gb
    a.reps = 2 if a.reps is None else a.reps
  if a.size_gb is None:
    a.size_gb = 8.0 if a.mode == 'gpu' else 2.0
  if a.reps is None:
    a.reps = 3
  if a.mode == 'gpu':
    a.d2h_ref = True
  return a


def set_platform_env(mode: str) -> None:
  if mode in ('cpu', 'gcs'):
    os.environ['JAX_PLATFORMS'] = 'cpu'
    flags = os.environ.get('XLA_FLAGS', '')
    if 'xla_force_host_platform_device_count' not in flags:
      os.environ['XLA_FLAGS'] = (flags + ' --xla_force_host_platform_device_count=8').strip()
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')


def import_gcs_server():
  """tests/gcs_server.py (FakeGcs), or None with the reason."""
  if not os.path.exists(os.path.join(TESTS, 'gcs_server.py')):
    return None, 'tests/gcs_server.py is absent'
  if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
  try:
    import gcs_server  # pylint: disable=import-outside-toplevel
    return gcs_server, None
  except Exception as e:  # pylint: disable=broad-except
    return None, f'cannot import tests/gcs_server.py: {type(e).__name__}: {e}'


# ---------------------------------------------------------------------------------------------
# Everything below imports jax lazily (after set_platform_env).
# ---------------------------------------------------------------------------------------------

def quiet_logs():
  import logging
  logging.getLogger('absl').setLevel(logging.ERROR)
  logging.getLogger('orbax_pathways').setLevel(logging.WARNING)
  try:
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.ERROR)
  except ImportError:
    pass
  import warnings
  warnings.filterwarnings('ignore', message='.*overriding.*')


def meshes(mode: str):
  """(full mesh, half mesh or None). cpu/gcs: (4,2) over 8 CPU devices, (2,2) over devices[:4]."""
  import jax
  import numpy as np
  from jax.sharding import Mesh
  devs = jax.devices()
  n = len(devs)
  if n >= 2 and n % 2 == 0:
    full = Mesh(np.asarray(devs).reshape(n // 2, 2), ('data', 'model'))
  else:
    full = Mesh(np.asarray(devs).reshape(n, 1), ('data', 'model'))
  half = None
  if n >= 4 and n % 4 == 0:
    half = Mesh(np.asarray(devs[: n // 2]).reshape(n // 4, 2), ('data', 'model'))
  elif n == 2:
    half = Mesh(np.asarray(devs[:1]).reshape(1, 1), ('data', 'model'))
  return full, half


# (name, fraction of the logical bytes, dtype, PartitionSpec)
#   8-way sharded P('data', 'model'), partly replicated P('data', None) (2 copies over 'model'),
#   fully replicated P() (one copy per device).
LAYOUT = (
    ('params.layer0.w', 0.16, 'float32', ('data', 'model')),
    ('params.layer1.w', 0.16, 'float32', ('data', 'model')),
    ('params.layer2.w', 0.16, 'float32', ('data', 'model')),
    ('params.embed', 0.14, 'bfloat16', ('data', 'model')),
    ('params.unembed', 0.14, 'bfloat16', ('data', 'model')),
    ('opt.mu.layer0', 0.10, 'float32', ('data', None)),
    ('opt.mu.embed', 0.10, 'bfloat16', ('data', None)),
    ('params.pos_table', 0.02, 'float32', (None, None)),
    ('params.ln_table', 0.02, 'bfloat16', (None, None)),
)  # fractions sum to 1
N_SMALL = 16  # small leaves, 1-64 KiB, mixed layouts
COLS = 4096


def _fill(rng, n: int, dtype):
  """n random N(0,1)-distributed values: a 16 MiB pool of fresh normals per array, rotated by a
  random offset and scaled by a random factor per block (4x faster than fresh normals, and
  bitwise different in every block so chunk compression sees realistic float data)."""
  import numpy as np
  pool_n = min(n, 4 * MiB)
  pool = rng.standard_normal(pool_n, dtype=np.float32)
  out = np.empty(n, dtype=dtype)
  for i in range(0, n, pool_n):
    j = min(n, i + pool_n)
    blk = np.roll(pool, int(rng.integers(pool_n)))[: j - i]
    blk *= np.float32(rng.uniform(0.02, 2.0))
    out[i:j] = blk.astype(dtype, copy=False)
  return out


def build_state(mesh, size_gb: float, seed: int = 0):
  """The benchmark state: a nested dict of jax.Arrays (+ one python int)."""
  import jax
  import ml_dtypes
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  dtypes = {'float32': np.float32, 'bfloat16': ml_dtypes.bfloat16}
  total = size_gb * GiB
  rows_mult = 8 * int(np.prod(mesh.devices.shape))
  state: dict = {}

  def put(path, value):
    d = state
    parts = path.split('.')
    for p in parts[:-1]:
      d = d.setdefault(p, {})
    d[parts[-1]] = value

  for k, (name, frac, dt, spec) in enumerate(LAYOUT):
    dtype = dtypes[dt]
    itemsize = np.dtype(dtype).itemsize
    rows = max(rows_mult, round(total * frac / (COLS * itemsize) / rows_mult) * rows_mult)
    host = _fill(np.random.default_rng([seed, k]), rows * COLS, dtype).reshape(rows, COLS)
    put(name, jax.device_put(host, NamedSharding(mesh, P(*spec))))
    del host
  rng = np.random.default_rng([seed, 999])
  specs = [('data', 'model'), ('data', None), (None, 'model'), (None, None)]
  for i in range(N_SMALL):
    nbytes = int(2 ** rng.integers(10, 17))  # 1 KiB .. 64 KiB
    dtype = dtypes['float32' if i % 2 == 0 else 'bfloat16']
    n = nbytes // np.dtype(dtype).itemsize
    shape = (64, n // 64)
    put(f'small.s{i:02d}', jax.device_put(_fill(rng, n, dtype).reshape(shape),
                                          NamedSharding(mesh, P(*specs[i % 4]))))
  state['step'] = 7
  jax.block_until_ready(state)
  return state


def tiny_state(mesh, seed: int = 0):
  """10 float32 arrays of 1 KiB (256 elements), 8-way sharded."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  n = int(np.prod(mesh.devices.shape))
  spec = P(('data', 'model')) if 256 % n == 0 else P()
  rng = np.random.default_rng([seed, 7])
  return {f't{i}': jax.device_put(rng.standard_normal(256, dtype=np.float32),
                                  NamedSharding(mesh, spec)) for i in range(10)}


def jax_leaves(tree):
  import jax
  return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def logical_bytes(tree) -> int:
  return sum(x.nbytes for x in jax_leaves(tree))


def device_bytes(tree) -> int:
  return sum(s.data.nbytes for x in jax_leaves(tree) for s in x.addressable_shards)


def abstract(tree, mesh=None):
  """ShapeDtypeStructs with the same PartitionSpecs, on `mesh` (default: the arrays' own)."""
  import jax
  from jax.sharding import NamedSharding

  def f(x):
    if not isinstance(x, jax.Array):
      return x
    sh = x.sharding if mesh is None else NamedSharding(mesh, x.sharding.spec)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
  return jax.tree.map(f, tree)


# ---------------------------------------------------------------------------------------------
# Handler selection and verification
# ---------------------------------------------------------------------------------------------

def use_handler(impl: str):
  import jax
  import orbax.checkpoint as ocp
  import orbax_pathways
  if impl == 'stock':
    orbax_pathways.uninstall()
    name = type(ocp.type_handlers.get_type_handler(jax.Array)).__name__
    if name != 'ArrayHandler':
      raise RuntimeError(f'stock run but jax.Array is handled by {name}')
  else:
    orbax_pathways.install()
    h = ocp.type_handlers.get_type_handler(jax.Array)
    if not isinstance(h, orbax_pathways.ProxyArrayHandler):
      raise RuntimeError(f'ours run but jax.Array is handled by {type(h).__name__}')
  gc.collect()


class Served:
  """Checks which handler served a save / restore, through orbax_pathways.stats."""

  def __init__(self, impl: str, kind: str):
    import orbax_pathways
    self.impl, self.kind = impl, kind
    self.getter = (orbax_pathways.stats.last_save if kind == 'save'
                   else orbax_pathways.stats.last_restore)
    self.before = self.getter()
    self.after = None

  def check(self):
    self.after = self.getter()
    if self.impl == 'ours' and (self.after is None or self.after is self.before):
      raise RuntimeError(f'ours {self.kind}: orbax_pathways.stats did not change: '
                         'our handler did not serve it')
    if self.impl == 'stock' and self.after is not self.before:
      raise RuntimeError(f'stock {self.kind}: orbax_pathways.stats changed: our handler served it')
    return self.after if self.impl == 'ours' else None


# ---------------------------------------------------------------------------------------------
# Storage: where checkpoints go, how they are removed, and the bytes-read counter
# ---------------------------------------------------------------------------------------------

class Storage:

  def __init__(self, root: str, gcs_bucket: str | None = None):
    self.root = root.rstrip('/')
    self.bucket = gcs_bucket

  def new_dir(self, tag: str) -> str:
    return f'{self.root}/{tag}-{uuid.uuid4().hex[:8]}'

  def remove(self, path: str) -> None:
    if self.bucket is None:
      shutil.rmtree(path, ignore_errors=True)
      return
    import tensorstore as ts
    prefix = path[len(f'gs://{self.bucket}/'):].rstrip('/') + '/'
    kv = ts.KvStore.open({'driver': 'gcs', 'bucket': self.bucket}).result()
    kv.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord('/') + 1))).result()


def ts_bytes_read() -> tuple[int, list[str]]:
  """Sum of tensorstore's per-driver kvstore bytes_read counters (file, gcs, ...): the bytes
  that came off storage (compressed, as stored), the same counter for both handlers."""
  import tensorstore as ts
  total, names = 0, []
  for m in ts.experimental_collect_matching_metrics('/tensorstore/kvstore/'):
    name = m['name']
    parts = name.split('/')
    if len(parts) == 5 and parts[4] == 'bytes_read' and parts[3] not in ('ocdbt', 'memory'):
      total += sum(int(v.get('value', 0)) for v in m['values'])
      names.append(name)
  return total, names


# ---------------------------------------------------------------------------------------------
# The measurements
# ---------------------------------------------------------------------------------------------

LAST_CPU = {}  # CPU seconds (all threads of this process) of the last timed save / restore


def timed_save(mngr, step, tree):
  import orbax.checkpoint as ocp
  c0 = time.process_time()
  t0 = time.perf_counter()
  mngr.save(step, args=ocp.args.StandardSave(tree))
  t1 = time.perf_counter()
  mngr.wait_until_finished()
  t2 = time.perf_counter()
  LAST_CPU['save'] = time.process_time() - c0
  return t1 - t0, t2 - t0


def timed_restore(mngr, step, target):
  import jax
  import orbax.checkpoint as ocp
  c0 = time.process_time()
  t0 = time.perf_counter()
  out = mngr.restore(step, args=ocp.args.StandardRestore(target))
  jax.block_until_ready(out)
  dt = time.perf_counter() - t0
  LAST_CPU['restore'] = time.process_time() - c0
  return out, dt


def check_restored(out, ref_tree, mesh) -> None:
  """Cheap correctness: shapes, dtypes, target mesh, and a checksum of one small leaf."""
  import jax
  import numpy as np
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref_tree)):
    if isinstance(b, jax.Array):
      assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
      assert set(a.sharding.device_set) == set(mesh.devices.flat), 'restored on the wrong devices'
  small_a = out['small']['s00']
  small_b = ref_tree['small']['s00']
  np.testing.assert_array_equal(np.asarray(small_a), np.asarray(small_b))


def run_main_rep(impl, state, mesh, half, storage, rep, tiny_iters, tiny):
  import orbax.checkpoint as ocp
  res: dict = {}
  extra: dict = {}
  use_handler(impl)
  n_arrays = len(jax_leaves(state))
  path = storage.new_dir(f'{impl}-r{rep}')
  try:
    with ocp.CheckpointManager(path) as mngr:
      sv = Served(impl, 'save')
      res['save_blocking_s'], res['commit_s'] = timed_save(mngr, 1, state)
      res['commit_cpu_s'] = LAST_CPU['save']
      extra['loadavg_1m'] = os.getloadavg()[0]
      st = sv.check()
      if st is not None:
        extra['ours_save_blocking_s'] = st.blocking_s
        extra['ours_write_s'] = st.write_s
        extra['ours_arrays_per_serialize'] = st.arrays
        extra['ours_written_bytes'] = st.total_written
        if st.arrays != n_arrays:
          extra['note'] = f'last serialize saw {st.arrays} of {n_arrays} arrays'
      gc.collect()

      rv = Served(impl, 'restore')
      out, res['restore_s'] = timed_restore(mngr, 1, abstract(state))
      res['restore_cpu_s'] = LAST_CPU['restore']
      rv.check()
      check_restored(out, state, mesh)
      del out
      gc.collect()

      if half is not None:
        rv = Served(impl, 'restore')
        b0, names = ts_bytes_read()
        out, res['restore_fewer_s'] = timed_restore(mngr, 1, abstract(state, half))
        res['restore_fewer_cpu_s'] = LAST_CPU['restore']
        b1, _ = ts_bytes_read()
        rst = rv.check()
        check_restored(out, state, half)
        res['reshard_bytes_read'] = b1 - b0
        extra['bytes_read_counters'] = names
        if rst is not None:
          extra['ours_stats_bytes_read'] = sum(rst.bytes_read.values())
          extra['ours_stats_bytes_needed'] = sum(rst.bytes_needed.values())
          extra['ours_chunks_verified'] = rst.chunks_verified
        del out
        gc.collect()
  finally:
    storage.remove(path)

  # Tiny checkpoint: fixed cost of one save+commit and one restore of 10 x 1 KiB, in steady
  # state (a training loop saves many steps on one manager): one untimed round first.
  path = storage.new_dir(f'tiny-{impl}-r{rep}')
  res['tiny_save_commit_s'], res['tiny_restore_s'] = [], []
  try:
    with ocp.CheckpointManager(path) as mngr:
      timed_save(mngr, 0, tiny)
      timed_restore(mngr, 0, abstract(tiny))
      for i in range(tiny_iters):
        sv = Served(impl, 'save')
        _, c = timed_save(mngr, i + 1, tiny)
        sv.check()
        rv = Served(impl, 'restore')
        out, r = timed_restore(mngr, i + 1, abstract(tiny))
        rv.check()
        res['tiny_save_commit_s'].append(c)
        res['tiny_restore_s'].append(r)
        del out
  finally:
    storage.remove(path)

  # The floor under any handler: the same manager protocol for 10 Python floats (Orbax's
  # scalar handler, no jax.Array at all), so the array handler's share of the tiny cost shows.
  path = storage.new_dir(f'floor-{impl}-r{rep}')
  res['tiny_floor_save_commit_s'] = []
  floats = {f't{i}': float(i) for i in range(10)}
  try:
    with ocp.CheckpointManager(path) as mngr:
      timed_save(mngr, 0, floats)
      for i in range(tiny_iters):
        res['tiny_floor_save_commit_s'].append(timed_save(mngr, i + 1, floats)[1])
  finally:
    storage.remove(path)
  gc.collect()
  return res, extra


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


def run_rss_subprocess(impl, args, storage, rep) -> dict:
  path = storage.new_dir(f'rss-{impl}-r{rep}')
  cmd = [sys.executable, os.path.abspath(__file__), '--mode', args.mode, '--size-gb',
         str(args.size_gb), '--seed', str(args.seed), '--_rss-worker', impl, '--_ckpt', path]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
  finally:
    storage.remove(path)
  for line in proc.stdout.splitlines():
    if line.startswith('RSS_RESULT '):
      return json.loads(line[len('RSS_RESULT '):])
  raise RuntimeError(f'rss worker ({impl}) failed rc={proc.returncode}:\n{proc.stdout[-2000:]}\n'
                     f'{proc.stderr[-4000:]}')


def disk_reference(root: str, nbytes: int, n: int = 2) -> list[float]:
  """Seconds to write ``nbytes`` sequentially in 16 MiB blocks to a new file under ``root`` and
  fsync it (like ``dd conv=fsync``): the local disk's limit for a commit of that many bytes."""
  block = os.urandom(1 << 20) * 16
  times = []
  for i in range(n):
    path = os.path.join(root, f'disk-ref-{i}')
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      left = nbytes
      while left > 0:
        left -= os.write(fd, block if left >= len(block) else block[:left])
      os.fsync(fd)
    finally:
      os.close(fd)
    times.append(time.perf_counter() - t0)
    os.remove(path)
  return times


def d2h_reference(state, n=4) -> list[float]:
  """Seconds of a pinned_host copy of every array of the state (2nd.. n-th transfer)."""
  import jax
  arrays = jax_leaves(state)
  times = []
  for i in range(n):
    gc.collect()
    t0 = time.perf_counter()
    outs = [jax.device_put(x, x.sharding.with_memory_kind('pinned_host')) for x in arrays]
    jax.block_until_ready(outs)
    dt = time.perf_counter() - t0
    del outs
    if i > 0:
      times.append(dt)
  return times


# ---------------------------------------------------------------------------------------------
# Profiling one metric of one handler with py-spy attached to this process
# ---------------------------------------------------------------------------------------------

def find_py_spy() -> str | None:
  cand = os.path.join(os.path.dirname(sys.executable), 'py-spy')
  return cand if os.path.exists(cand) else shutil.which('py-spy')


@contextlib.contextmanager
def py_spy(out_path: str, native: bool):
  exe = find_py_spy()
  if exe is None:
    raise RuntimeError('py-spy not found: `.venv/bin/pip install py-spy`')
  cmd = [exe, 'record', '--pid', str(os.getpid()), '--rate', '250', '--format', 'raw',
         '--output', out_path]
  # --native needs to pause the process to unwind C++ stacks; py-spy refuses it with
  # --nonblocking, which we use otherwise so sampling does not slow the measured code.
  cmd.append('--native' if native else '--nonblocking')
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  time.sleep(1.5)  # attach
  if proc.poll() is not None:
    raise RuntimeError(f'py-spy exited: {proc.stderr.read()}')
  try:
    yield
  finally:
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    try:
      proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()


def _short(frame: str) -> str:
  # "func (path/to/file.py:123)" -> "func (file.py:123)" but keep package for site-packages
  if '(' not in frame:
    return frame
  fn, loc = frame.rsplit(' (', 1)
  loc = loc.rstrip(')')
  for marker in ('site-packages/', '/work/main/'):
    if marker in loc:
      loc = loc.split(marker, 1)[1]
  return f'{fn} ({loc})'


def top_frames(raw_path: str, k: int = 15) -> dict:
  """Top-k by self samples and by inclusive samples from py-spy raw (collapsed) output."""
  self_c, incl_c, total = collections.Counter(), collections.Counter(), 0
  with open(raw_path) as f:
    for line in f:
      line = line.rstrip('\n')
      if not line.strip():
        continue
      stack, _, cnt = line.rpartition(' ')
      try:
        n = int(cnt)
      except ValueError:
        continue
      frames = [_short(x) for x in stack.split(';') if x]
      # drop the per-thread root ("process ..."/"thread ...") if present
      frames = [x for x in frames if not x.startswith(('process ', 'thread '))]
      if not frames:
        continue
      total += n
      self_c[frames[-1]] += n
      for fr in set(frames):
        incl_c[fr] += n
  return {'total_samples': total,
          'self': [(f, c, c / max(total, 1)) for f, c in self_c.most_common(k)],
          'inclusive': [(f, c, c / max(total, 1)) for f, c in incl_c.most_common(k)]}


def profile_metric(metric, impl, state, mesh, half, tiny, storage, native) -> dict:
  import orbax.checkpoint as ocp
  use_handler(impl)
  raw = os.path.join(tempfile.mkdtemp(prefix='bench-pyspy-'), f'{impl}-{metric}.txt')
  is_tiny = metric.startswith('tiny')
  tree = tiny if is_tiny else state
  path = storage.new_dir(f'profile-{impl}')
  wall = None
  try:
    with ocp.CheckpointManager(path) as mngr:
      if metric in ('save', 'commit', 'tiny_save'):
        import orbax.checkpoint as _  # noqa: F401
        with py_spy(raw, native):
          t0 = time.perf_counter()
          mngr.save(1, args=ocp.args.StandardSave(tree))
          if metric != 'save':
            mngr.wait_until_finished()
          wall = time.perf_counter() - t0
        mngr.wait_until_finished()
      else:
        mngr.save(1, args=ocp.args.StandardSave(tree))
        mngr.wait_until_finished()
        target = abstract(tree, half if metric == 'restore_fewer' else None)
        gc.collect()
        with py_spy(raw, native):
          out, wall = timed_restore(mngr, 1, target)
        del out
  finally:
    storage.remove(path)
  top = top_frames(raw)
  top.update({'metric': metric, 'impl': impl, 'wall_s': wall, 'raw': raw, 'native': native})
  return top


# ---------------------------------------------------------------------------------------------
# Summary and output
# ---------------------------------------------------------------------------------------------

METRICS = (  # key, label, unit
    ('save_blocking_s', 'save() blocking', 's'),
    ('commit_s', 'save start -> committed', 's'),
    ('commit_cpu_s', 'CPU time, save+commit', 's'),
    ('restore_s', 'restore, same mesh', 's'),
    ('restore_cpu_s', 'CPU time, restore same mesh', 's'),
    ('restore_fewer_s', 'restore, half the devices', 's'),
    ('restore_fewer_cpu_s', 'CPU time, restore half', 's'),
    ('reshard_bytes_read', 'bytes read/host, reshard', 'B'),
    ('peak_rss_delta_bytes', 'peak RSS - before, save', 'B'),
    ('peak_rss_over_state', 'peak RSS / state dev bytes', 'x'),
    ('cold_save_blocking_s', 'save() blocking, 1st in process', 's'),
    ('cold_commit_s', 'save -> committed, 1st in process', 's'),
    ('tiny_save_commit_s', 'tiny ckpt save+commit', 's'),
    ('tiny_restore_s', 'tiny ckpt restore', 's'),
    ('tiny_floor_save_commit_s', 'no-array ckpt save+commit (floor)', 's'),
)


def summarize(samples: dict) -> dict:
  out = {}
  for key, label, unit in METRICS:
    row = {'label': label, 'unit': unit}
    ok = True
    for impl in IMPLS:
      v = samples[impl].get(key, [])
      if not v:
        ok = False
        continue
      row[impl] = {'median': statistics.median(v), 'min': min(v), 'n': len(v)}
    if ok:
      for stat in ('median', 'min'):
        s = row['stock'][stat]
        row[f'ratio_{stat}'] = row['ours'][stat] / s if s else None
    out[key] = row
  return out


def fmt(v, unit):
  if v is None:
    return '-'
  if unit == 's':
    return f'{v * 1e3:.1f} ms' if v < 1 else f'{v:.3f} s'
  if unit == 'B':
    return f'{v / MiB:.1f} MiB'
  return f'{v:.3f}'


def table(summary: dict) -> str:
  hdr = ('metric', 'stock median', 'stock min', 'ours median', 'ours min', 'ours/stock med',
         'ours/stock min')
  rows = [hdr]
  for key, row in summary.items():
    u = row['unit']
    g = lambda impl, st: fmt(row[impl][st], u) if impl in row else 'n/a'
    r = lambda st: f"{row[f'ratio_{st}']:.2f}" if row.get(f'ratio_{st}') is not None else 'n/a'
    rows.append((row['label'], g('stock', 'median'), g('stock', 'min'), g('ours', 'median'),
                 g('ours', 'min'), r('median'), r('min')))
  w = [max(len(r[i]) for r in rows) for i in range(len(hdr))]
  line = lambda r: '| ' + ' | '.join(c.ljust(w[i]) if i == 0 else c.rjust(w[i])
                                     for i, c in enumerate(r)) + ' |'
  sep = '|' + '|'.join('-' * (x + 2) if i == 0 else '-' * (x + 1) + ':' for i, x in enumerate(w)) + '|'
  return '\n'.join([line(rows[0]), sep] + [line(r) for r in rows[1:]])


def versions() -> dict:
  import importlib.metadata as md
  out = {'python': platform.python_version()}
  for pkg in ('jax', 'jaxlib', 'orbax-checkpoint', 'tensorstore', 'numpy', 'orbax-pathways'):
    try:
      out[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
      out[pkg] = None
  return out


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
  args = parse_args(argv)
  set_platform_env(args.mode)
  gcs_mod, gcs_note = (import_gcs_server() if args.mode == 'gcs' else (None, None))
  if args.rss_worker:
    if args.mode == 'gcs' and gcs_mod is not None:
      gcs_mod.configure_fsspec_anon()
    rss_worker(args)
    return 0
  if args.mode == 'gcs' and gcs_mod is None:
    print(f'--mode gcs: {gcs_note}; cannot run against fake-gcs-server.', file=sys.stderr)
    return 2

  with contextlib.ExitStack() as stack:
    bucket = None
    notes = []
    if args.mode == 'gcs':
      server = stack.enter_context(gcs_mod.FakeGcs(backend='memory'))
      bucket = server.new_bucket('bench')
      stack.enter_context(gcs_mod.applied_env(server.env()))
      root = f'gs://{bucket}/bench'
      notes.append(f'fake-gcs-server at {server.url} (memory backend), bucket {bucket}')
    else:
      if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        root = tempfile.mkdtemp(prefix='bench-', dir=args.dir)
      else:
        root = tempfile.mkdtemp(prefix='orbax-bench-', dir='/tmp')
      stack.callback(shutil.rmtree, root, True)
    storage = Storage(root, bucket)

    import jax
    quiet_logs()
    import orbax.checkpoint as ocp  # noqa: F401
    import orbax_pathways
    mesh, half = meshes(args.mode)
    if half is None:
      notes.append(f'{len(jax.devices())} device(s): no half mesh, restore onto fewer slices '
                   'and reshard bytes skipped')

    t_build = time.perf_counter()
    state = build_state(mesh, args.size_gb, args.seed)
    t_build = time.perf_counter() - t_build
    tiny = tiny_state(mesh, args.seed)
    meta = {
        'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'), 'mode': args.mode, 'reps': args.reps,
        'size_gb_arg': args.size_gb, 'logical_bytes': logical_bytes(state),
        'device_bytes': device_bytes(state), 'n_arrays': len(jax_leaves(state)),
        'devices': [str(d) for d in jax.devices()], 'mesh': dict(mesh.shape),
        'half_mesh': dict(half.shape) if half is not None else None, 'root': root,
        'hostname': platform.node(), 'nproc': os.cpu_count(), 'versions': versions(),
        'order': 'alternating: per rep, stock then ours (main metrics), then stock then ours '
                 '(peak-RSS subprocesses)', 'warmup_rounds': args.warmup,
        'state_build_s': t_build, 'notes': notes,
    }
    print(f"# state: {meta['logical_bytes'] / GiB:.3f} GiB logical, "
          f"{meta['device_bytes'] / GiB:.3f} GiB on devices, {meta['n_arrays']} arrays, "
          f"built in {t_build:.1f} s; mesh {meta['mesh']}, half {meta['half_mesh']}; root {root}",
          flush=True)

    samples = {impl: collections.defaultdict(list) for impl in IMPLS}
    extras = {impl: [] for impl in IMPLS}
    rss_raw = {impl: [] for impl in IMPLS}
    t_all = time.perf_counter()
    for w in range(args.warmup):  # untimed: first-use costs (compilation, thread pools) of both
      for impl in IMPLS:
        t0 = time.perf_counter()
        res, _ = run_main_rep(impl, state, mesh, half, storage, f'w{w}', 1, tiny)
        print(f'# warm-up {impl:5s}: save_blocking {fmt(res["save_blocking_s"], "s")}, commit '
              f'{fmt(res["commit_s"], "s")} (discarded; {time.perf_counter() - t0:.1f} s)', flush=True)
    for rep in range(args.reps):
      for impl in IMPLS:
        t0 = time.perf_counter()
        res, extra = run_main_rep(impl, state, mesh, half, storage, rep, args.tiny_iters, tiny)
        for k, v in res.items():
          samples[impl][k].extend(v if isinstance(v, list) else [v])
        extras[impl].append(extra)
        print(f'# rep {rep} {impl:5s}: ' + ', '.join(
            f'{k}={fmt(statistics.median(v) if isinstance(v, list) else v, "B" if "bytes" in k else "s")}'
            for k, v in res.items()) + f'  ({time.perf_counter() - t0:.1f} s)', flush=True)
      if not args.no_rss:
        for impl in IMPLS:
          r = run_rss_subprocess(impl, args, storage, rep)
          rss_raw[impl].append(r)
          for k in ('peak_rss_delta_bytes', 'peak_rss_over_state'):
            samples[impl][k].append(r[k])
          samples[impl]['cold_save_blocking_s'].append(r['save_blocking_s'])
          samples[impl]['cold_commit_s'].append(r['commit_s'])
          print(f"# rep {rep} {impl:5s} rss: before {r['rss_before'] / GiB:.2f} GiB, "
                f"peak {r['rss_peak'] / GiB:.2f} GiB, delta {r['peak_rss_delta_bytes'] / MiB:.0f} MiB "
                f"(VmHWM delta {(r['vm_hwm_delta_bytes'] or 0) / MiB:.0f} MiB), "
                f"{r['samples']} samples", flush=True)
    meta['bench_s'] = time.perf_counter() - t_all

    d2h = None
    if args.d2h_ref:
      try:
        d2h = d2h_reference(state)
        notes.append('d2h_pinned_host_s: jax.device_put of every array to its sharding with '
                     "memory_kind='pinned_host', 2nd+ transfers")
      except Exception as e:  # pylint: disable=broad-except
        notes.append(f'pinned_host copy failed: {type(e).__name__}: {e}')

    disk = None
    if storage.bucket is None:
      disk = disk_reference(root, logical_bytes(state))
      notes.append('disk_write_fsync_s: the state\'s logical bytes written in 16 MiB blocks to '
                   'one file in the checkpoint root and fsynced (dd conv=fsync)')

    profile = None
    if args.profile:
      try:
        profile = profile_metric(args.profile, args.profile_impl, state, mesh, half, tiny,
                                 storage, args.profile_native)
      except Exception as e:  # pylint: disable=broad-except
        profile = {'error': f'{type(e).__name__}: {e}'}

    orbax_pathways.install()  # leave the process as `import orbax_pathways` left it

  summary = summarize({impl: dict(v) for impl, v in samples.items()})
  result = {'meta': meta, 'summary': summary,
            'samples': {impl: dict(v) for impl, v in samples.items()},
            'extras': extras, 'rss_runs': rss_raw,
            'd2h_pinned_host_s': ({'median': statistics.median(d2h), 'min': min(d2h),
                                   'samples': d2h} if d2h else None),
            'disk_write_fsync_s': ({'median': statistics.median(disk), 'min': min(disk),
                                    'samples': disk} if disk else None),
            'profile': profile}

  print()
  print(table(summary))
  if disk:
    commit = summary['commit_s']['ours']['median']
    print(f"\ndisk write+fsync of the state's logical bytes: median {fmt(statistics.median(disk), 's')}, "
          f"min {fmt(min(disk), 's')}; ours commit / disk median = "
          f"{commit / statistics.median(disk):.2f}")
  if d2h:
    print(f"\npinned_host device-to-host copy of the state: median {fmt(statistics.median(d2h), 's')}, "
          f"min {fmt(min(d2h), 's')} (compare with save() blocking)")
  ex = [e for e in extras['ours'] if 'ours_stats_bytes_read' in e]
  if ex:
    print(f"\nours, reshard restore (orbax_pathways.stats): bytes_read (decoded) "
          f"{ex[-1]['ours_stats_bytes_read'] / MiB:.1f} MiB, bytes_needed "
          f"{ex[-1]['ours_stats_bytes_needed'] / MiB:.1f} MiB; tensorstore counters "
          f"{ex[-1].get('bytes_read_counters')}")
  if profile:
    print_profile(profile)
  for n in notes:
    print(f'note: {n}')
  text = json.dumps(result, indent=1, default=str)
  print('\nJSON:')
  print(text)
  if args.json_out:
    with open(args.json_out, 'w') as f:
      f.write(text + '\n')
  return 0


def print_profile(p: dict) -> None:
  if 'error' in p:
    print(f"\nprofile failed: {p['error']}")
    return
  print(f"\npy-spy profile of {p['impl']} / {p['metric']} (wall {fmt(p['wall_s'], 's')}, "
        f"{p['total_samples']} samples, native={p['native']}; raw: {p['raw']})")
  for kind in ('self', 'inclusive'):
    print(f'  top-15 by {kind} samples:')
    for f, c, frac in p[kind]:
      print(f'    {frac * 100:5.1f}%  {c:6d}  {f}')


if __name__ == '__main__':
  sys.exit(main())
