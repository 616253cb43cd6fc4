"""The GCS test infrastructure, proven with real parts: stock Orbax, tensorstore, gcsfs and
fake-gcs-server, optionally behind the fault-injecting proxy. Loopback only, no mocks."""

from __future__ import annotations

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from support.arrays import abstract, assert_bit_identical, mesh, put
from support.fault_proxy import FaultProxy

# An exception nobody could raise (a callback into a closed event loop) or a coroutine never
# awaited fails the test.
pytestmark = [pytest.mark.gcs, pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning'),
              pytest.mark.filterwarnings('error:coroutine .* was never awaited:RuntimeWarning')]


def _state(seed: int = 0) -> dict:
  m = mesh()
  rng = np.random.default_rng(seed)
  return {
      'w': put(rng.standard_normal((64, 32), dtype=np.float32), m, 'data', 'model'),
      'b': put(rng.standard_normal((32,), dtype=np.float32).astype(jnp.bfloat16), m, 'model'),
      'emb': put(rng.integers(0, 1 << 30, (128, 16), dtype=np.int32), m, 'data', None),
      'rep': put(np.arange(10, dtype=np.float64 if jax.config.x64_enabled else np.float32), m),
      'step': put(np.int32(7), m),
  }


def _save_restore(path: str, state: dict) -> dict:
  opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
  with ocp.CheckpointManager(path, options=opts) as mgr:
    assert mgr.save(3, args=ocp.args.StandardSave(state))
    mgr.wait_until_finished()
  with ocp.CheckpointManager(path) as mgr2:
    assert mgr2.all_steps() == [3]
    return mgr2.restore(3, args=ocp.args.StandardRestore(abstract(state)))


def test_env_points_only_at_loopback(gcs_bucket):
  for k in ('STORAGE_EMULATOR_HOST', 'TENSORSTORE_GCS_HTTP_URL'):
    assert os.environ[k].startswith('http://127.0.0.1:'), k
  assert os.environ['NO_GCE_CHECK'] == 'true'
  assert os.environ['GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT'] == 'false'
  import fsspec

  fs = fsspec.filesystem('gcs')
  assert type(fs).__module__ == 'gcsfs.core', type(fs)  # no gRPC bucket-layout probing
  assert fs._location == gcs_bucket.endpoint


def test_orbax_ocdbt_roundtrip(gcs_bucket):
  state = _state()
  path = gcs_bucket.path('ckpt')
  t = time.monotonic()
  restored = _save_restore(path, state)
  elapsed = time.monotonic() - t
  assert_bit_identical(restored, state)
  objs = gcs_bucket.objects()
  # OCDBT layout: a manifest plus data files under ocdbt.process_* / d/.
  assert any('manifest.ocdbt' in o for o in objs), objs
  assert any(o.startswith('ckpt/3/') for o in objs), objs
  assert elapsed < 20, elapsed


def test_orbax_roundtrip_through_fault_proxy(faulty_gcs):
  state = _state(seed=1)
  proxy: FaultProxy = faulty_gcs.proxy
  proxy.set_rate(0.05, kinds=('429', '503', 'reset', 'delay'))
  restored = _save_restore(faulty_gcs.path('ckpt'), state)
  assert_bit_identical(restored, state)
  stats = proxy.stats()
  # Both gcsfs (epath: directories, metadata, commit markers) and tensorstore went through it.
  assert stats['requests'] > 40, stats
  assert stats['faults_total'] > 0, stats
  assert set(stats['faults']) & {'429', '503', 'reset'}, stats
  # And the data really landed on the server, read back with the proxy out of the way.
  proxy.set_rate(0.0)
  assert any('manifest.ocdbt' in o for o in faulty_gcs.objects())


def test_second_manager_lists_steps_after_quick_async_saves(gcs_bucket):
  """The hang in gcs_testing.md: three quick async saves, then a second manager on the same
  path lists steps. Root cause was gcsfs's ExtendedGcsFileSystem probing the Storage
  Control gRPC API per operation (see support.gcs_server.hermetic_env); with
  GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false this completes at once."""
  path = gcs_bucket.path('ckpt')
  result: dict = {}

  def scenario():
    try:
      opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
      mgr = ocp.CheckpointManager(path, options=opts)
      for step in range(3):
        mgr.save(step, args=ocp.args.StandardSave({'a': jnp.arange(8.0) + step}))
      mgr.wait_until_finished()
      t = time.monotonic()
      mgr2 = ocp.CheckpointManager(path)
      result['steps'] = mgr2.all_steps()
      result['restored'] = mgr2.restore(2, args=ocp.args.StandardRestore({'a': jnp.zeros(8)}))
      result['list_s'] = time.monotonic() - t
      mgr2.close()
      mgr.close()
    except BaseException as e:  # reported below
      result['error'] = e

  th = threading.Thread(target=scenario, daemon=True)
  th.start()
  th.join(25)
  assert not th.is_alive(), 'second CheckpointManager hung listing steps (>25 s)'
  if 'error' in result:
    raise result['error']
  assert result['steps'] == [0, 1, 2]
  np.testing.assert_array_equal(np.asarray(result['restored']['a']), np.arange(8.0) + 2)
  assert result['list_s'] < 10, result['list_s']


def test_fault_proxy_streams_and_counts(fake_gcs):
  """The proxy on its own: large bodies both ways, chunked uploads, keep-alive, and exact
  accounting of injected faults."""
  import http.client

  bucket = fake_gcs.new_bucket('p')
  body = os.urandom(3 << 20)
  with FaultProxy(fake_gcs.url, rate=0.0, seed=7) as proxy:
    host, port = proxy.url[len('http://'):].split(':')
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request('POST', f'/upload/storage/v1/b/{bucket}/o?uploadType=media&name=big',
                 body=body, headers={'Content-Type': 'application/octet-stream'})
    r = conn.getresponse(); r.read()
    assert r.status == 200

    def chunks():
      for i in range(0, len(body), 1 << 18):
        yield body[i:i + (1 << 18)]

    conn.request('POST', f'/upload/storage/v1/b/{bucket}/o?uploadType=media&name=chunked',
                 body=chunks(), encode_chunked=True,
                 headers={'Content-Type': 'application/octet-stream'})
    r = conn.getresponse(); r.read()
    assert r.status == 200
    for name in ('big', 'chunked'):
      conn.request('GET', f'/storage/v1/b/{bucket}/o/{name}?alt=media')
      r = conn.getresponse()
      assert r.status == 200 and r.read() == body
    assert proxy.stats()['requests'] == 4  # all on one keep-alive connection
    conn.close()

    proxy.set_rate(1.0, kinds=('503',))
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request('GET', f'/storage/v1/b/{bucket}/o/big?alt=media')
    r = conn.getresponse()
    assert r.status == 503 and b'injected' in r.read()
    proxy.set_rate(1.0, kinds=('reset',))
    with pytest.raises((ConnectionError, http.client.HTTPException)):
      conn.request('GET', f'/storage/v1/b/{bucket}/o/big?alt=media')
      conn.getresponse().read()
    conn.close()
    s = proxy.stats()
    assert s['faults'] == {'503': 1, 'reset': 1}, s
    assert s['requests'] == 6 and s['forwarded'] == 4, s


def test_fault_proxy_caps_bandwidth_and_counts_body_bytes(fake_gcs):
  """``bandwidth`` caps relayed body bytes per second over all connections (the tier benchmark
  makes storage slower than memory with it): 2 MiB each way at 8 MiB/s take at least 0.5 s
  (a lower bound only: a loaded machine may be slower, never faster)."""
  import http.client

  bucket = fake_gcs.new_bucket('bw')
  body = os.urandom(2 << 20)
  with FaultProxy(fake_gcs.url, rate=0.0, bandwidth=8 << 20) as proxy:
    host, port = proxy.url[len('http://'):].split(':')
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    t0 = time.monotonic()
    conn.request('POST', f'/upload/storage/v1/b/{bucket}/o?uploadType=media&name=big',
                 body=body, headers={'Content-Type': 'application/octet-stream'})
    r = conn.getresponse(); r.read()
    assert r.status == 200
    conn.request('GET', f'/storage/v1/b/{bucket}/o/big?alt=media')
    r = conn.getresponse()
    assert r.status == 200 and r.read() == body
    elapsed = time.monotonic() - t0
    conn.close()
    s = proxy.stats()
    assert s['request_bytes'] == len(body) and s['response_bytes'] >= len(body), s
    assert elapsed >= (s['request_bytes'] + s['response_bytes']) / (8 << 20) * 0.95, elapsed
