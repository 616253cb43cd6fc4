"""orbax_pathways on gs://: real Orbax CheckpointManager, tensorstore and gcsfs against
fake-gcs-server (tests/support/gcs_fixtures.py), optionally through the fault-injecting proxy.
Loopback only, no mocks. The proxy's per-request decision (``FaultProxy._choose``) is wrapped
in some tests only to *record* (method, target) of each request; nothing is faked.

Measurements that go into the closing note are printed (run with ``-s`` to see them):
request counts of a 20-array save, and the timing / error text of a storage outage.
"""

from __future__ import annotations

import collections
import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec as P

import orbax_pathways
from orbax_pathways.sharding import elastic
from orbax_pathways import preemption

from support import procs
from support.arrays import abstract, assert_bit_identical, mesh, put, random_state
from support.ckpt import save_with_options
from support.mp_harness import run_processes
from support.procs import run_limited
from support.workers import gcs_mp_worker, gcs_second_writer_worker

# An exception nobody could raise (a callback into a closed event loop) or a coroutine never
# awaited fails the test.
pytestmark = [pytest.mark.gcs, pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning'),
              pytest.mark.filterwarnings('error:coroutine .* was never awaited:RuntimeWarning')]

TMP_SUFFIX = '.orbax-checkpoint-tmp'


# ---- helpers -------------------------------------------------------------------------------

def _record_requests(monkeypatch, proxy) -> list[tuple[str, str]]:
  """Records (method, target) of every request the proxy sees; the proxy behaves as before."""
  seen: list[tuple[str, str]] = []
  original = proxy._choose  # pylint: disable=protected-access

  def choose(method, target):
    seen.append((method, target))
    return original(method, target)

  monkeypatch.setattr(proxy, '_choose', choose)
  return seen


def _steps_objects(objects, step) -> list[str]:
  return [o for o in objects if o.startswith(f'ckpt/{step}/')]



def _classify(method: str, target: str) -> str:
  """Rough request category from the JSON API target (client, then operation)."""
  client = 'ts' if ('tensorstore=' in target or 'uploadType=media' in target) else 'gcsfs'
  path, _, query = target.partition('?')
  if method == 'DELETE':
    op = 'delete'
  elif path.startswith('/batch/'):
    op = 'batch'
  elif path.startswith('/upload/'):
    op = 'upload:' + (re.search(r'uploadType=(\w+)', query) or ['', '?'])[1]
  elif method == 'GET' and 'alt=media' in query:
    op = 'read'
  elif method == 'GET' and path.endswith('/o'):
    op = 'list'
  elif method == 'GET':
    op = 'stat'
  else:
    op = f'{method.lower()}:other'
  return f'{client}:{op}'


def _object_of(target: str) -> str:
  """Object name a request is about (URL-decoded; '' for bucket-level requests)."""
  from urllib.parse import parse_qs, unquote, urlsplit  # pylint: disable=g-import-not-at-top
  u = urlsplit(target)
  q = parse_qs(u.query)
  if 'name' in q:
    return unquote(q['name'][0])
  m = re.match(r'^/(?:download/)?storage/v1/b/[^/]+/o/(.+)$', u.path)
  if m:
    return unquote(m.group(1))
  return 'prefix=' + q['prefix'][0] if 'prefix' in q else ''


# ---- 1. core round trip ----------------------------------------------------------------------

def test_sharded_state_round_trip_on_gcs_with_our_handler(faulty_gcs, monkeypatch):
  seen = _record_requests(monkeypatch, faulty_gcs.proxy)  # rate 0: a plain relay
  m = mesh()
  state = random_state(m)
  state['rng'] = jax.random.key(42)  # PRNG key: a 0-d key array
  state['scalar'] = put(np.float32(3.25), m)  # 0-d array replicated over the mesh
  path = faulty_gcs.path('ckpt')
  with ocp.CheckpointManager(path) as mngr:
    assert mngr.save(1, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    st = orbax_pathways.stats.last_save()
    assert st.transport == 'in_process' and st.arrays == 6, st
    assert st.written_bytes['p0'] == sum(x.nbytes for x in jax.tree.leaves(state)
                                         if isinstance(x, jax.Array)
                                         and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                                         ) + jax.random.key_data(state['rng']).nbytes
  with ocp.CheckpointManager(path) as mngr:
    assert mngr.all_steps() == [1]
    with_target = mngr.restore(1, args=ocp.args.StandardRestore(abstract(state)))
    rst = orbax_pathways.stats.last_restore()
    assert rst.transport == 'in_process' and rst.arrays == 6 and rst.chunks_verified > 0, rst
    no_target = mngr.restore(1)
  assert_bit_identical(with_target, state)
  assert_bit_identical(no_target, state)

  objs = faulty_gcs.objects()
  for name in ('ckpt/1/default/_pathways/p0.msgpack', 'ckpt/1/commit_success.txt',
               'ckpt/1/default/commit_success.txt', 'ckpt/1/default/manifest.ocdbt'):
    assert name in objs, (name, objs)
  # Orbax's gs:// protocol: write in place, commit with commit_success.txt; never a temporary
  # name, neither in the final listing nor in any request made during the save.
  assert not [o for o in objs if TMP_SUFFIX in o], objs
  assert not [t for _, t in seen if 'orbax-checkpoint-tmp' in t]


# ---- 2. object-store commit semantics ---------------------------------------------------------

def _small_state(m, step):
  rng = np.random.default_rng(step)
  return {'w': put(rng.standard_normal((32, 16), dtype=np.float32), m, 'data', 'model'),
          'b': put(rng.standard_normal((16,), dtype=np.float32), m, None)}


def test_step_without_commit_marker_is_not_listed_and_resume_skips_it(gcs_bucket):
  m = mesh()
  path = gcs_bucket.path('ckpt')
  states = {s: _small_state(m, s) for s in (1, 2)}
  with ocp.CheckpointManager(path) as mngr:
    for s, st in states.items():
      mngr.save(s, args=ocp.args.StandardSave(st))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1, 2]
  # A save killed before its marker: everything of step 2 is there except commit_success.txt.
  epath.Path(gcs_bucket.path('ckpt', '2', 'commit_success.txt')).unlink()
  assert 'ckpt/2/default/_pathways/p0.msgpack' in gcs_bucket.objects()

  with ocp.CheckpointManager(path) as fresh:
    assert fresh.all_steps() == [1]
    assert fresh.latest_step() == 1

  calls = []
  with ocp.CheckpointManager(path) as fresh:
    step, restored = preemption.resume(fresh, lambda: calls.append('init') or {},
                                       abstract_state=abstract(states[1]))
    assert (step, calls) == (1, [])
    assert_bit_identical(restored, states[1])
    assert fresh.all_steps() == [1]
  # On gs:// an unmarked step is a temporary. A fresh one may be another process's save in
  # progress (a trainer next to this resuming evaluator): resume() leaves it alone ...
  assert _steps_objects(gcs_bucket.objects(), 2)
  # ... and removes it once nothing in it changed for the lease (an hour by default).
  from orbax_pathways.manager import retention  # pylint: disable=g-import-not-at-top
  retention.install(abandoned_after_s=0.001)  # the autouse fixture puts the default back
  with ocp.CheckpointManager(path) as fresh:
    assert preemption.resume(fresh, dict, abstract_state=abstract(states[1]))[0] == 1
  assert not _steps_objects(gcs_bucket.objects(), 2), gcs_bucket.objects()


def test_retention_keeps_two_newest_and_deletes_commit_marker_first(faulty_gcs, monkeypatch):
  seen = _record_requests(monkeypatch, faulty_gcs.proxy)
  m = mesh()
  path = faulty_gcs.path('ckpt')
  states = {s: _small_state(m, s) for s in range(4)}
  opts = ocp.CheckpointManagerOptions(max_to_keep=2)
  with ocp.CheckpointManager(path, options=opts) as mngr:
    for s, st in states.items():
      mngr.save(s, args=ocp.args.StandardSave(st))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 3]
  deadline = time.monotonic() + 10
  while True:  # deletion may finish in the background
    objs = faulty_gcs.objects()
    if not _steps_objects(objs, 0) and not _steps_objects(objs, 1):
      break
    assert time.monotonic() < deadline, objs
    time.sleep(0.1)
  assert _steps_objects(objs, 2) and _steps_objects(objs, 3)
  for s in (2, 3):
    assert f'ckpt/{s}/commit_success.txt' in objs
  with ocp.CheckpointManager(path) as fresh:
    assert fresh.all_steps() == [2, 3]
    assert_bit_identical(fresh.restore(2, args=ocp.args.StandardRestore(abstract(states[2]))),
                          states[2])
  # Retention deleted the commit marker of each old step before any other object of it. (Orbax
  # also sends DELETEs of a step's metadata files while saving it, before writing them; only
  # deletions after the step's last upload belong to the retention delete.)
  for s in (0, 1):
    prefix = f'ckpt/{s}/'
    last_upload = max(i for i, (meth, t) in enumerate(seen)
                      if t.startswith('/upload/') and _object_of(t).startswith(prefix))
    deletes = [_object_of(t) for i, (meth, t) in enumerate(seen)
               if i > last_upload and meth == 'DELETE'
               and (_object_of(t) + '/').startswith(prefix)]
    assert deletes[:2] == [prefix + 'commit_success.txt', prefix + '_CHECKPOINT_METADATA'], deletes
    assert prefix + 'default/manifest.ocdbt' in deletes, deletes
    assert not [t for _, t in seen if t.startswith('/batch/')]  # each DELETE is visible above


# ---- 3. elastic restore -----------------------------------------------------------------------

def _elastic_state(m):
  rng = np.random.default_rng(0)
  return {
      'sharded': put(rng.standard_normal((24, 8), dtype=np.float32), m, 'data', 'model'),
      'slice_only': put(rng.standard_normal((12, 3), dtype=np.float32), m, 'data'),
      'model_only': put(rng.standard_normal((5, 8), dtype=np.float32), m, None, 'model'),
      'replicated': put(rng.standard_normal((7,), dtype=np.float32), m),
      'bf16': put(rng.standard_normal((24, 4)).astype(jnp.bfloat16), m, 'data', 'model'),
  }


def test_elastic_restore_four_slices_onto_two_on_gcs(gcs_bucket):
  state = _elastic_state(mesh((4, 2)))
  path = gcs_bucket.path('ckpt')
  save_with_options(path, state, num_slices=4)
  four = set(jax.devices()[:4])
  with elastic.topology(jax.devices()[:4], num_slices=2):
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      with ocp.CheckpointManager(path) as mngr:
        restored = mngr.restore(0)
  assert_bit_identical(restored, state, same_sharding=False)
  for k, v in restored.items():
    assert v.sharding.device_set <= four, k
  assert restored['sharded'].sharding.mesh.shape == {'data': 2, 'model': 2}
  assert restored['sharded'].sharding.spec == P('data', 'model')


# ---- 4. preemption --------------------------------------------------------------------------

def test_preemption_notice_saves_and_commits_on_gcs(gcs_bucket):
  assert jax.process_count() == 1
  preemption.clear_notice()
  path = gcs_bucket.path('ckpt')
  m = mesh()
  try:
    mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(
        save_interval_steps=100))
    assert mngr.save(0, args=ocp.args.StandardSave(_small_state(m, 0)))
    mngr.wait_until_finished()
    assert not mngr.should_save(5)
    preemption.notify_preemption('test_gcs')
    assert mngr.reached_preemption(6)
    st6 = _small_state(m, 6)
    assert mngr.save(6, args=ocp.args.StandardSave(st6))
    assert mngr.reached_preemption(6)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [0, 6]
    mngr.close()
  finally:
    preemption.clear_notice()
  assert 'ckpt/6/commit_success.txt' in gcs_bucket.objects()
  with ocp.CheckpointManager(path) as fresh:
    assert fresh.latest_step() == 6
    assert_bit_identical(fresh.restore(6, args=ocp.args.StandardRestore(abstract(st6))), st6)


# ---- 5. faults ------------------------------------------------------------------------------

def _eight_mib_state(m):
  rng = np.random.default_rng(5)
  return {
      'w': put(rng.standard_normal((1024, 1024), dtype=np.float32), m, 'data', 'model'),  # 4 MiB
      'mu': put(rng.standard_normal((512, 1024), dtype=np.float32), m, 'data', None),  # 2 MiB
      'e': put(rng.standard_normal((768, 512), dtype=np.float32), m, None, 'model'),  # 1.5 MiB
      'b': put(rng.standard_normal((256, 1024)).astype(jnp.bfloat16), m, 'data'),  # 0.5 MiB
      'rng': jax.random.key(7),
  }


def test_save_restore_8mib_through_mixed_faults(faulty_gcs):
  m = mesh()
  state = _eight_mib_state(m)
  nbytes = sum(x.nbytes for k, x in state.items() if k != 'rng')
  assert nbytes == 8 << 20
  proxy = faulty_gcs.proxy
  proxy.set_rate(0.05, kinds=('429', '503', 'reset'))
  path = faulty_gcs.path('ckpt')
  t0 = time.monotonic()
  with ocp.CheckpointManager(path) as mngr:
    assert mngr.save(0, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
  t_save = time.monotonic() - t0
  with ocp.CheckpointManager(path) as mngr:
    assert mngr.all_steps() == [0]
    restored = mngr.restore(0, args=ocp.args.StandardRestore(abstract(state)))
  t_total = time.monotonic() - t0
  assert orbax_pathways.stats.last_restore().chunks_verified > 0
  assert_bit_identical(restored, state)
  stats = proxy.stats()
  print(f'\n[faults 5%] save {t_save:.1f}s, save+restore {t_total:.1f}s, {stats}')
  assert stats['faults_total'] > 0, stats
  assert set(stats['faults']) <= {'429', '503', 'reset'}, stats
  proxy.set_rate(0.0)
  assert 'ckpt/0/commit_success.txt' in faulty_gcs.objects()


class StorageErrorLacksContext(AssertionError):
  """A regression of an error-context guarantee (fixed; was a known bug)."""


class SaveNotBoundedByStorageRetries(AssertionError):
  """A regression of the storage_retries bound (fixed; was a known bug)."""


def _save_then_wait(mngr, step, state, where: dict):
  where['phase'] = 'save'
  mngr.save(step, args=ocp.args.StandardSave(state))
  where['phase'] = 'wait_until_finished'
  mngr.wait_until_finished()
  where['phase'] = 'done'


def _check_step1_survives(faulty_gcs, state):
  faulty_gcs.proxy.set_rate(0.0)
  with ocp.CheckpointManager(faulty_gcs.path('ckpt')) as fresh:
    assert fresh.all_steps() == [1]
    assert fresh.latest_step() == 1
    assert_bit_identical(fresh.restore(1, args=ocp.args.StandardRestore(abstract(state))), state)
  assert 'ckpt/2/commit_success.txt' not in faulty_gcs.objects()


def test_storage_outage_all_503_fails_and_keeps_previous_step(faulty_gcs):
  m = mesh()
  state = random_state(m)
  path = faulty_gcs.path('ckpt')
  mngr = ocp.CheckpointManager(path)
  try:
    mngr.save(1, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    orbax_pathways.install(orbax_pathways.Options(storage_retries=1))
    faulty_gcs.proxy.reset_stats()
    faulty_gcs.proxy.set_rate(1.0, kinds=('503',))
    where: dict = {}
    th, res = run_limited(lambda: _save_then_wait(mngr, 2, state, where), 55)
    stats = faulty_gcs.proxy.stats()
    if th.is_alive():
      faulty_gcs.proxy.set_rate(0.0)
      th.join(60)
      pytest.fail(f'save(2) under a total outage did not fail within 55 s ({where}, {stats})')
    err = res.get('error')
    print(f'\n[outage all-503] failed in {where.get("phase")} after {res["elapsed"]:.1f}s '
          f'({stats["requests"]} requests, {stats["by_method"]}): {type(err).__name__}: {err}')
    assert err is not None, f'save(2) succeeded under a total outage: {where}'
    assert res['elapsed'] < 55
  finally:
    faulty_gcs.proxy.set_rate(0.0)
    orbax_pathways.install(orbax_pathways.Options.from_env())
    try:
      mngr.close()
    except Exception:  # pylint: disable=broad-except  (the failed save may re-raise here)
      pass
  _check_step1_survives(faulty_gcs, state)
  text = f'{type(err).__name__}: {err}'
  if not ('gs://' in text or 'ckpt/2' in text or any(n in text for n in ('params.w', 'opt.mu'))):
    raise StorageErrorLacksContext(f'error names neither the array nor the path: {text!r}')


@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_storage_retries_bound_a_tensorstore_outage(faulty_gcs):
  """Only tensorstore uploads fail (gcsfs metadata goes through): storage_retries=1 should make
  the save fail within seconds with an error naming the array."""
  m = mesh()
  state = random_state(m)
  path = faulty_gcs.path('ckpt')
  mngr = ocp.CheckpointManager(path)
  limit = 10
  try:
    mngr.save(1, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    orbax_pathways.install(orbax_pathways.Options(storage_retries=1))
    faulty_gcs.proxy.match = lambda method, target: 'uploadType=media' in target
    faulty_gcs.proxy.set_rate(1.0, kinds=('503',))
    where: dict = {}
    th, res = run_limited(lambda: _save_then_wait(mngr, 2, state, where), limit)
    hung = th.is_alive()
    faulty_gcs.proxy.set_rate(0.0)
    th.join(45)
    assert not th.is_alive(), f'save(2) still running 45 s after the outage ended ({where})'
    err = res.get('error')
    print(f'\n[outage ts-only] hung past {limit}s: {hung}; phase {where.get("phase")}, '
          f'finished after {res["elapsed"]:.1f}s: {type(err).__name__}: {str(err)[:400]}')
  finally:
    faulty_gcs.proxy.set_rate(0.0)
    faulty_gcs.proxy.match = None
    orbax_pathways.install(orbax_pathways.Options.from_env())
    try:
      mngr.close()
    except Exception:  # pylint: disable=broad-except
      pass
  assert err is not None, 'save(2) succeeded although every tensorstore upload failed'
  _check_step1_survives(faulty_gcs, state)
  if hung:
    raise SaveNotBoundedByStorageRetries(
        f'save(2) not failed {limit} s into the outage with storage_retries=1 (phase '
        f'{where.get("phase")}); it failed {res["elapsed"]:.1f} s in, after the outage ended')
  text = f'{type(err).__name__}: {err}'
  assert f'{path}/2' in text or re.search(r"'(params\.\w|opt\.mu)'", text), text


# ---- 6. request count -----------------------------------------------------------------------

def _save_counting(faulty_gcs, seen, subdir, state):
  n_start = len(seen)
  mngr = ocp.CheckpointManager(faulty_gcs.path(subdir))
  n_init = len(seen)
  t0 = time.monotonic()
  mngr.save(0, args=ocp.args.StandardSave(state))
  n_blocking = len(seen) - n_init
  mngr.wait_until_finished()
  elapsed = time.monotonic() - t0
  reqs = seen[n_init:]
  mngr.close()
  return reqs, n_blocking, n_init - n_start, elapsed


def test_request_count_of_a_20_array_save(faulty_gcs, monkeypatch):
  seen = _record_requests(monkeypatch, faulty_gcs.proxy)
  m = mesh()
  rng = np.random.default_rng(6)
  specs = [('data', 'model'), ('data', None), (None, 'model'), ()]
  state = {f'a{i:02d}': put(rng.standard_normal((64, 32), dtype=np.float32), m, *specs[i % 4])
           for i in range(20)}
  one = {'a00': state['a00']}
  base_reqs, _, _, _ = _save_counting(faulty_gcs, seen, 'one', one)
  save_reqs, n_blocking, n_init, t_save = _save_counting(faulty_gcs, seen, 'ckpt', state)
  with ocp.CheckpointManager(faulty_gcs.path('ckpt')) as fresh:
    n0 = len(seen)
    restored = fresh.restore(0, args=ocp.args.StandardRestore(abstract(state)))
    restore_reqs = seen[n0:]
  assert_bit_identical(restored, state)

  by_cat = collections.Counter(_classify(meth, t) for meth, t in save_reqs)
  by_obj = collections.Counter(_object_of(t).replace('ckpt/0/', '') for _, t in save_reqs)
  by_cat_r = collections.Counter(_classify(meth, t) for meth, t in restore_reqs)
  objs = [o for o in faulty_gcs.objects() if o.startswith('ckpt/')]
  print(f'\n[requests] save(0) of 20 arrays (64x32 f32): {len(save_reqs)} requests '
        f'({n_blocking} before save() returned; manager init {n_init} more), {t_save:.2f}s, '
        f'{len(objs)} objects; same save of 1 array: {len(base_reqs)}; by method '
        f'{dict(collections.Counter(meth for meth, _ in save_reqs))}')
  print(f'[requests] save by category: {dict(by_cat.most_common())}')
  print(f'[requests] save top objects: {by_obj.most_common(10)}')
  print(f'[requests] restore with target: {len(restore_reqs)} ({dict(by_cat_r.most_common())})')
  assert faulty_gcs.proxy.stats()['requests'] >= len(base_reqs) + len(save_reqs)
  # The bound: < 10 requests per array.
  assert len(save_reqs) < 10 * len(state), len(save_reqs)
  # What the bound really rests on: the cost is a fixed ~100 requests of Orbax's step protocol
  # over gcsfs (exists = stat + list; each small file of a manager save one multipart upload,
  # never read back, _compat/orbax_small_writes.py, where stock Orbax sends a delete and a
  # 2-request resumable upload and reads some back; _CHECKPOINT_METADATA written three times), while all arrays share one OCDBT database (a few data
  # files + manifests). Measured: 1 array 43, 20 arrays 55 (2026-12-05; ~97 and ~105 before a
  # save's own small files took one request each and were read back from memory; stock
  # Orbax: 92 / 113). A per-array round trip would add >= 19 requests over the 1-array save.
  assert len(save_reqs) - len(base_reqs) < 1.5 * (len(state) - 1), (len(save_reqs), len(base_reqs))


@pytest.mark.gcs
def test_long_lived_reader_sees_steps_written_by_another_process(gcs_bucket):
  """gcsfs caches listings forever; a reader (an evaluator polling for steps) must still see a
  step another process committed after the reader first listed the directory."""
  path = gcs_bucket.path('ckpt')
  value = np.arange(64, dtype=np.float32).reshape(8, 8)
  state = {'w': jax.device_put(value, NamedSharding(mesh(), P('data')))}
  with ocp.CheckpointManager(path) as writer:
    writer.save(0, args=ocp.args.StandardSave(state))
    writer.wait_until_finished()
  reader = ocp.CheckpointManager(path)
  assert reader.all_steps() == [0]
  np.testing.assert_array_equal(np.asarray(reader.restore(0)['w']), value)  # caches listings
  procs.run_worker(gcs_second_writer_worker, path)
  reader.reload()
  assert reader.all_steps() == [0, 1]
  np.testing.assert_array_equal(np.asarray(reader.restore(1)['w']), value + 1)
  reader.close()


@pytest.mark.gcs
@pytest.mark.multiprocess
def test_two_processes_save_and_restore_on_gcs(gcs_bucket):
  """Two jax.distributed processes write their own shards to gs:// (one OCDBT database each,
  merged by process 0) and read them back without a target."""
  import os  # pylint: disable=g-import-not-at-top
  path = gcs_bucket.path('ckpt')
  env = {k: v for k, v in os.environ.items() if k.startswith(
      ('STORAGE_EMULATOR', 'TENSORSTORE_GCS', 'GCE_', 'NO_GCE', 'CLOUDSDK', 'FSSPEC', 'GCSFS'))}
  saved = run_processes(gcs_mp_worker.__file__, 2, 2, args=[path, 'save'], env=env,
                        timeout=180)
  assert [r.result['written'] for r in saved] == [{'p0': 4096}, {'p1': 4096}]
  objects = gcs_bucket.objects()
  assert {'ckpt/0/default/ocdbt.process_0/manifest.ocdbt', 'ckpt/0/default/ocdbt.process_1/manifest.ocdbt',
          'ckpt/0/default/manifest.ocdbt', 'ckpt/0/commit_success.txt',
          'ckpt/0/default/_pathways/p0.msgpack', 'ckpt/0/default/_pathways/p1.msgpack'} <= set(objects)
  restored = run_processes(gcs_mp_worker.__file__, 2, 2, args=[path, 'restore'], env=env,
                           timeout=180)
  import hashlib  # pylint: disable=g-import-not-at-top
  value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  for r in restored:
    assert len(r.result['shards']) == 2  # each process holds its two devices' shards
    for sh in r.result['shards']:
      (r0, r1), (c0, c1) = sh['index']
      block = value[r0:r1, c0:c1]
      assert block.shape == (32, 16) and sh['process'] == r.process_id
      assert sh['sha'] == hashlib.sha256(np.ascontiguousarray(block).tobytes()).hexdigest()
    assert r.result['spec'] == ['proc', 'local']
