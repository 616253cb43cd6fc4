#!/usr/bin/env python3
"""Simulated fleets: stock Orbax, ours (in-process transport) and ours (colocated transport, with the
node-local tier and without) at 32 / 64 / 128 / 256 (or 1024) CPU devices in one process, on
local disk or through fake-gcs-server.

    .venv/bin/python benchmarks/fleet.py                       # 32,64,128,256 devices, local disk
    .venv/bin/python benchmarks/fleet.py --devices 64,256,1024 --json-out /tmp/fleet.json
    .venv/bin/python benchmarks/fleet.py --storage gcs --devices 64,256   # requests counted
    .venv/bin/python benchmarks/fleet.py --impls colocated,colocated_notier  # the colocated record

Each device count runs in its own interpreter (``--_child``), started with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``: jax reads it only at import. The child
runs stock, ours-local and ours-colocated one after another on the same state (20 arrays of
``--mib`` MiB in all, over a (N/4, 4) mesh) and reports, per implementation:

- first ``save()`` blocking and save -> committed; the same for a second save (step 1);
- restore of step 1 with a target, and without one, each in a fresh ``CheckpointManager``
  (in a fresh interpreter on gcs, so no client cache helps); on local disk also the restore with
  a target in a fresh interpreter (``restore_fresh_s``: what a restarted job does);
- files (objects) in step 1, and the ``_pathways/`` files one restore opens (local disk: an
  audit hook on ``open``; gcs: the proxy's requests naming ``_pathways/``);
- gcs: requests of the second save (save() to committed) and of the restore with a target,
  counted by ``tests/support/fault_proxy.py`` in front of fake-gcs-server;
- colocated: the bytes of the function each worker call ships, as colocated Python pickles it
  (``jax.experimental.colocated_python.serialization``), beyond the output specs it ships
  anyway, and the bytes of the per-device payload arrays (largest row);
- planning time of the 20 save plans with an empty plan cache (the first save's share);
- colocated: the worker calls themselves (``colocated_calls.call_with_deadline``, timed around):
  seconds of the second save's calls and of the fresh restore's, and those per simulated host
  (a call's cost per worker: flat when nothing per worker grows with the fleet), and the tier
  manifests the fresh restore opened (one per entry when the node's tier is listed once per
  call).

``colocated`` runs with the node-local tier on, in a fresh tmpfs directory per device count
(``/dev/shm``; removed after), ``colocated_notier`` with it off (``tier_dir='off'``); ``local``
uses the same tier directory. After the per-count tables, one table across the device counts:
the record of how the colocated cost grows (the state's bytes are the same at every count).

The colocated transport treats each CPU device as its own worker host (``w<id>``); on the CPU
backend colocated Python runs in this process, with the simulated hosts of one call run
concurrently (bounded by ``colocated_worker.MAX_CONCURRENT_HOSTS``). Timings are wall clock on a
shared machine: compare ratios within one run. Values read back are checked against the saved
ones. The tables go to stdout; ``--json-out`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import fleet_report  # noqa: E402  pylint: disable=wrong-import-position
REPO = os.path.dirname(HERE)
TESTS = os.path.join(REPO, 'tests')
IMPLS = ('stock', 'local', 'colocated', 'colocated_notier')
N_ARRAYS = 20
SPECS = (('data', 'model'), (('data', 'model'),), ('data', None), ('model', 'data'))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--devices', default='32,64,128,256',
                 help='comma-separated device counts (multiples of 16)')
  p.add_argument('--impls', default=','.join(IMPLS), help=f'subset of {",".join(IMPLS)}')
  p.add_argument('--mib', type=float, default=40.0, help='MiB of the whole state (20 arrays)')
  p.add_argument('--storage', choices=('local', 'gcs'), default='local')
  p.add_argument('--dir', default=None, help='local checkpoint root (default a fresh /tmp dir)')
  p.add_argument('--json-out', default=None)
  p.add_argument('--timeout', type=float, default=3600, help='seconds per device count')
  p.add_argument('--_child', dest='child', type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument('--_restore', dest='restore', default=None, help=argparse.SUPPRESS)
  p.add_argument('--_root', dest='root', default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _options(impl: str):
  """The orbax_pathways options of an implementation (not 'stock'): the environment's
  (``ORBAX_PATHWAYS_*``, e.g. ``ORBAX_PATHWAYS_PEER_TIMEOUT_S``), with its transport."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  import orbax_pathways  # pylint: disable=import-outside-toplevel
  env = orbax_pathways.Options.from_env()
  if impl == 'colocated_notier':
    return dataclasses.replace(env, transport='colocated', tier_dir='off')
  return dataclasses.replace(env, transport=impl)


def _tier_dir() -> str | None:
  """A fresh tier directory on tmpfs for one device count (None: no /dev/shm here)."""
  if not os.path.isdir('/dev/shm'):
    return None
  return tempfile.mkdtemp(prefix='fleet-tier-', dir='/dev/shm')


# ---- parent ------------------------------------------------------------------------------------

def child_env(n: int) -> dict:
  env = dict(os.environ)
  env['JAX_PLATFORMS'] = 'cpu'
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={n}'
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  return env


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.child is not None:
    return child_main(args)
  if args.restore is not None:
    return restore_main(args)
  counts = [int(x) for x in args.devices.split(',')]
  results = []
  for n in counts:
    root = args.dir or tempfile.mkdtemp(prefix=f'fleet-{n}-', dir='/tmp')
    cmd = [sys.executable, os.path.abspath(__file__), '--_child', str(n), '--impls', args.impls,
           '--mib', str(args.mib), '--storage', args.storage, '--_root', root]
    env = child_env(n)
    tier = _tier_dir()
    env['ORBAX_PATHWAYS_TIER_DIR'] = tier or 'off'
    t0 = time.monotonic()
    try:
      proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=args.timeout)
    finally:
      if tier:
        subprocess.run(['rm', '-rf', tier], check=False)
    if proc.returncode != 0:
      print(proc.stdout[-4000:], proc.stderr[-8000:], file=sys.stderr)
      return proc.returncode
    out = [json.loads(line[len('RESULT '):]) for line in proc.stdout.splitlines()
           if line.startswith('RESULT ')]
    results += out
    print(f'[{n} devices, {args.storage}] {time.monotonic() - t0:.0f} s', file=sys.stderr)
    if not args.dir:
      subprocess.run(['rm', '-rf', root], check=False)
  fleet_report.print_tables(results, args.storage, IMPLS)
  fleet_report.print_scaling(results, args.storage)
  if args.json_out:
    with open(args.json_out, 'w') as f:
      json.dump({'storage': args.storage, 'mib': args.mib, 'results': results}, f, indent=1)
  return 0


# ---- child: one device count -------------------------------------------------------------------

_opened: list[str] = []
_tier_manifests: list[str] = []


def _audit(event, args):
  if event == 'open' and args and isinstance(args[0], str):
    if '/_pathways/' in args[0]:
      _opened.append(args[0])
    tier = os.environ.get('ORBAX_PATHWAYS_TIER_DIR', '')
    if tier.startswith('/') and args[0].startswith(tier) and args[0].endswith('manifest.msgpack'):
      _tier_manifests.append(args[0])


class _Calls:
  """Times every colocated worker call (``colocated_calls.call_with_deadline``, wrapped): its
  seconds and how many simulated hosts (CPU devices) it spans."""

  def __init__(self):
    self.calls: list[tuple[float, int]] = []
    self._undo = None

  def install(self):
    from orbax_pathways.transports import colocated_calls  # pylint: disable=import-outside-toplevel
    orig = colocated_calls.call_with_deadline

    async def timed(call, cpu_devices, *a, **kw):
      t0 = time.perf_counter()
      try:
        return await orig(call, cpu_devices, *a, **kw)
      finally:
        self.calls.append((time.perf_counter() - t0, len(cpu_devices)))

    colocated_calls.call_with_deadline = timed
    self._undo = (colocated_calls, orig)
    return self

  def uninstall(self):
    if self._undo is not None:
      mod, orig = self._undo
      mod.call_with_deadline = orig
      self._undo = None

  def report(self, prefix: str) -> dict:
    if not self.calls:
      return {}
    seconds = sum(c[0] for c in self.calls)
    hosts = max(c[1] for c in self.calls)
    return {f'{prefix}_calls': len(self.calls), f'{prefix}_call_s': seconds,
            f'{prefix}_call_per_host_ms': 1e3 * seconds / hosts}


def _tier_entries() -> int | None:
  tier = os.environ.get('ORBAX_PATHWAYS_TIER_DIR', '')
  if not tier.startswith('/'):
    return None
  return sum(1 for _, _, files in os.walk(tier) for f in files if f == 'manifest.msgpack')


def _state(n: int, mib: float):
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.asarray(jax.devices()).reshape(n // 4, 4), ('data', 'model'))
  per = int(mib * 2**20 / N_ARRAYS / 4)  # float32 elements per array
  cols = 512
  rows = max(n, per // cols // n * n)
  rng = np.random.default_rng(0)
  state, values = {}, {}
  for i in range(N_ARRAYS):
    v = rng.standard_normal((rows, cols), dtype=np.float32)
    values[f'a{i:02d}'] = v
    state[f'a{i:02d}'] = jax.device_put(v, NamedSharding(mesh, P(*SPECS[i % len(SPECS)])))
  return state, values


def _abstract(state):
  import jax
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}


class _Payloads:
  """Captures the functions the colocated transport builds, and the serialized size of each as
  colocated Python ships it (beyond the output specs it ships in the same pickle anyway)."""

  def __init__(self):
    self.save, self.restore, self.rows = [], [], []
    self._undo = []

  def install(self):
    from orbax_pathways.transports import colocated
    from orbax_pathways.transports import colocated_worker
    for name, sink in (('make_worker_save', self.save), ('make_worker_restore', self.restore)):
      orig = getattr(colocated_worker, name)

      def wrapped(task, *a, _orig=orig, _sink=sink, **kw):
        fn = _orig(task, *a, **kw)
        specs = tuple(t.sharding for t in getattr(task, 'targets', ()))
        _sink.append(_shipped_bytes(fn, specs))
        return fn

      setattr(colocated_worker, name, wrapped)
      self._undo.append((colocated_worker, name, orig))
    rows = getattr(colocated, 'payload_row_bytes', None)
    if rows is not None:
      self.rows = rows  # a list the transport appends the largest row of each call to
      rows.clear()

  def uninstall(self):
    for mod, name, orig in self._undo:
      setattr(mod, name, orig)
    self._undo.clear()


def _shipped_bytes(fn, specs: tuple) -> int:
  """Bytes ``fn`` adds to the pickle colocated Python ships to every worker of a call. That
  pickle also holds the call's output specs, and colocated Python's pickler writes an equal
  sharding once, so shardings the function shares with the outputs (``specs``) cost nothing."""
  from jax.experimental.colocated_python import serialization
  ser = serialization._serialize  # pylint: disable=protected-access
  return len(ser((fn, specs))) - len(ser((None, specs)))


def _by_kind(seen) -> dict:
  """GCS JSON-API requests by kind: object reads (GET media), writes (uploads), listings,
  metadata gets and deletes."""
  out = {'gets': 0, 'puts': 0, 'lists': 0, 'stats': 0, 'deletes': 0}
  for method, target in seen:
    path, _, query = target.partition('?')
    if method == 'DELETE':
      out['deletes'] += 1
    elif path.startswith('/upload/') or method in ('POST', 'PUT'):
      out['puts'] += 1
    elif 'alt=media' in query:
      out['gets'] += 1
    elif path.endswith('/o'):
      out['lists'] += 1
    else:
      out['stats'] += 1
  return out


def _clear_metadata_cache() -> None:
  try:
    from orbax_pathways.storage import meta_io
  except ImportError:
    return
  getattr(meta_io, 'clear_cache', lambda: None)()


def _metadata_reads() -> int | None:
  """Objects read from ``_pathways/`` so far (orbax_pathways' own counter, where it has one:
  tensorstore's reads do not go through Python's ``open``)."""
  try:
    from orbax_pathways.storage import meta_io
  except ImportError:
    return None
  counts = getattr(meta_io, 'read_counts', None)
  if counts is None:
    return None
  c = counts()
  return c.get('index', 0) + c.get('record', 0)


def _count_files(path) -> tuple[int, int]:
  from etils import epath
  p = epath.Path(path)
  if str(p).startswith('gs://'):
    from etils.epath import backend
    fs = backend.fsspec_backend.fs(str(p))
    fs.invalidate_cache()
    names = fs.find(str(p))
  else:
    names = [os.path.join(dp, f) for dp, _, fs in os.walk(str(p)) for f in fs]
  return len(names), sum(1 for x in names if '/_pathways/' in x)


def child_main(args) -> int:
  import logging
  logging.getLogger('absl').setLevel(logging.ERROR)
  logging.getLogger('orbax_pathways').setLevel(logging.WARNING)
  import warnings
  warnings.filterwarnings('ignore')
  sys.addaudithook(_audit)
  n = args.child
  proxy = server = None
  if args.storage == 'gcs':
    sys.path.insert(0, TESTS)
    from support import gcs_server  # pylint: disable=import-outside-toplevel
    from support.fault_proxy import FaultProxy  # pylint: disable=import-outside-toplevel
    server = gcs_server.FakeGcs(backend='memory').start()
    bucket = server.new_bucket('fleet')
    proxy = FaultProxy(server.url, rate=0.0).start()
    for k, v in server.env(proxy.url).items():
      os.environ[k] = v
    for k in gcs_server.FakeGcs.unset_keys():
      os.environ.pop(k, None)
    gcs_server.configure_fsspec_anon()
    root = f'gs://{bucket}/fleet'
  else:
    root = args.root
  try:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    import orbax_pathways
    from orbax_pathways.sharding import layout
    state, values = _state(n, args.mib)
    for impl in args.impls.split(','):
      r = {'devices': n, 'impl': impl, 'storage': args.storage,
           'mib': sum(v.nbytes for v in values.values()) / 2**20}
      if impl == 'stock':
        orbax_pathways.uninstall()
      else:
        orbax_pathways.install(_options(impl))
        layout.plan_writes.cache_clear()
        t0 = time.perf_counter()
        for a in state.values():
          layout.plan_writes(a.sharding, a.shape, 4, lambda d: f'w{d.id}', max_chunk_bytes=16 << 20,
                             replica_parallel=True, coalesce_bytes=1 << 20)
        r['plan_s'] = time.perf_counter() - t0
      payloads = _Payloads()
      calls = _Calls()
      if impl.startswith('colocated'):
        payloads.install()
      d = f'{root}/{impl}'
      with ocp.CheckpointManager(d) as mngr:
        for step, tag in ((0, 'save1'), (1, 'save2')):
          if step == 1 and impl.startswith('colocated'):
            calls.install()
          seen_save = []
          if proxy is not None:
            proxy.reset_stats()
            orig = proxy._choose  # pylint: disable=protected-access
            proxy._choose = lambda m, t, _o=orig, _s=seen_save: (_s.append((m, t)), _o(m, t))[1]  # pylint: disable=protected-access
          t0 = time.perf_counter()
          mngr.save(step, args=ocp.args.StandardSave(state))
          r[f'{tag}_blocking_s'] = time.perf_counter() - t0
          mngr.wait_until_finished()
          r[f'{tag}_commit_s'] = time.perf_counter() - t0
          if proxy is not None:
            proxy._choose = orig  # pylint: disable=protected-access
            if step == 1:
              r['save_requests'] = proxy.stats()['requests']
              r.update({f'save_{k}': v for k, v in _by_kind(seen_save).items()})
        calls.uninstall()
        r.update(calls.report('save'))
      r['files'], r['pathways_files_written'] = _count_files(f'{d}/1')
      if proxy is None:
        for key, target in (('restore', _abstract(state)), ('notarget', None)):
          _opened.clear()
          _clear_metadata_cache()  # each restore cold, as in a fresh process
          reads0 = _metadata_reads()
          with ocp.CheckpointManager(d) as fresh:
            t0 = time.perf_counter()
            out = fresh.restore(1, args=ocp.args.StandardRestore(target) if target else None)
            jax.block_until_ready(out)
            r['restore_s' if key == 'restore' else 'restore_notarget_s'] = time.perf_counter() - t0
          reads = _metadata_reads()
          r['pathways_reads_' + key] = len(_opened) if reads is None else reads - reads0
          for k, v in values.items():
            if not np.array_equal(np.asarray(out[k]), v):
              raise AssertionError(f'{impl}: {k} differs after restore')
        del out
        res = _fresh_restore(d, impl, args.mib, 'target', dict(os.environ))
        r['restore_fresh_s'] = res['restore_s']
        r.update({k: v for k, v in res.items() if k.startswith('restore_')
                  and k != 'restore_s'})
      else:
        for key, target in (('restore', True), ('notarget', False)):
          _opened.clear()
          proxy.reset_stats()
          seen = []
          orig = proxy._choose  # pylint: disable=protected-access
          proxy._choose = lambda m, t, _o=orig: (seen.append((m, t)), _o(m, t))[1]  # pylint: disable=protected-access
          res = _fresh_restore(d, impl, args.mib, 'target' if target else 'none',
                               dict(os.environ))
          proxy._choose = orig  # pylint: disable=protected-access
          suffix = '' if target else '_notarget'
          r['restore_s' if target else 'restore_notarget_s'] = res['restore_s']
          if target:
            r.update({k: v for k, v in res.items() if k.startswith('restore_')
                      and k != 'restore_s'})
          r['restore_requests' + suffix] = len(seen)
          r['restore_pathways_requests' + suffix] = sum(
              1 for _, t in seen if '_pathways' in t.replace('%2F', '/'))
          if target:
            r.update({f'restore_{k}': v for k, v in _by_kind(seen).items()})
          r['pathways_reads_' + key] = r['restore_pathways_requests' + suffix]
      if impl.startswith('colocated'):
        r['save_worker_fn_bytes'] = max(payloads.save, default=None)
        r['restore_worker_fn_bytes'] = max(payloads.restore, default=None)
        r['restore_payload_row_bytes'] = max(payloads.rows, default=None)
        payloads.uninstall()
      print('RESULT ' + json.dumps(r), flush=True)
  finally:
    if proxy is not None:
      proxy.stop()
    if server is not None:
      server.stop()
  return 0


def _fresh_restore(d: str, impl: str, mib: float, target: str, env: dict) -> dict:
  """Restores step 1 of ``d`` in a fresh interpreter (``restore_main``); returns its report."""
  cmd = [sys.executable, os.path.abspath(__file__), '--_restore', d, '--impls', impl,
         '--mib', str(mib), '--_root', target]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
  if proc.returncode != 0:
    raise RuntimeError(proc.stderr[-4000:])
  return json.loads(proc.stdout.strip().splitlines()[-1])


def restore_main(args) -> int:
  """One restore in a fresh interpreter (a restarted job; on gcs the parent's proxy counts its
  requests); reports its seconds and, colocated, its worker calls and tier manifests opened."""
  import logging
  logging.getLogger('absl').setLevel(logging.ERROR)
  import warnings
  warnings.filterwarnings('ignore')
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  sys.path.insert(0, TESTS)
  from support import gcs_server  # pylint: disable=import-outside-toplevel
  gcs_server.configure_fsspec_anon()
  import orbax_pathways
  impl = args.impls
  if impl == 'stock':
    orbax_pathways.uninstall()
  else:
    orbax_pathways.install(_options(impl))
  calls = _Calls().install() if impl.startswith('colocated') else None
  sys.addaudithook(_audit)
  n = jax.device_count()
  state, values = _state(n, args.mib)
  target = _abstract(state) if args.root == 'target' else None
  del state
  with ocp.CheckpointManager(args.restore) as mngr:
    t0 = time.perf_counter()
    out = mngr.restore(1, args=ocp.args.StandardRestore(target) if target else None)
    jax.block_until_ready(out)
    dt = time.perf_counter() - t0
  for k, v in values.items():
    if not np.array_equal(np.asarray(out[k]), v):
      raise AssertionError(f'{impl}: {k} differs after restore')
  report = {'restore_s': dt}
  if calls is not None:
    report.update(calls.report('restore'))
    if impl == 'colocated':
      report.update(restore_tier_manifests=len(_tier_manifests),
                    restore_tier_entries=_tier_entries())
  print(json.dumps(report))
  return 0


if __name__ == '__main__':
  sys.exit(main())
