"""Where the benchmark's checkpoints go, how they are removed, and the bytes that came off storage.

cpu / gpu modes: a fresh directory (``--dir`` or ``/tmp/orbax-bench-*``) removed at the end.
gcs mode: a bucket on ``tests/support/gcs_server.py``'s fake-gcs-server (memory backend, loopback), with
that module's environment applied to this process (and inherited by the RSS subprocesses).
``ts_bytes_read`` sums tensorstore's per-driver kvstore ``bytes_read`` counters, the same counter
for both handlers. Nothing here imports jax.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import uuid

from benchlib import TESTS


def import_gcs_server():
  """tests/support/gcs_server.py (FakeGcs), or None with the reason."""
  if not os.path.exists(os.path.join(TESTS, 'support', 'gcs_server.py')):
    return None, 'tests/support/gcs_server.py is absent'
  if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
  try:
    from support import gcs_server  # pylint: disable=import-outside-toplevel
    return gcs_server, None
  except Exception as e:  # pylint: disable=broad-except
    return None, f'cannot import tests/support/gcs_server.py: {type(e).__name__}: {e}'


class Storage:
  """A checkpoint root: a local directory, or ``gs://<bucket>/bench`` when ``bucket`` is set."""

  def __init__(self, root: str, gcs_bucket: str | None = None):
    self.root = root.rstrip('/')
    self.bucket = gcs_bucket

  def new_dir(self, tag: str) -> str:
    return f'{self.root}/{tag}-{uuid.uuid4().hex[:8]}'

  def remove(self, path: str) -> None:
    _drop_tier(path)
    if self.bucket is None:
      shutil.rmtree(path, ignore_errors=True)
      return
    import tensorstore as ts
    prefix = path[len(f'gs://{self.bucket}/'):].rstrip('/') + '/'
    kv = ts.KvStore.open({'driver': 'gcs', 'bucket': self.bucket}).result()
    kv.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord('/') + 1))).result()


def _drop_tier(path: str) -> None:
  """Removes this node's tier copies of ``path`` (a finished rep's directory is never restored
  again; left there, every rep would keep a copy of the state in /dev/shm, i.e. in RAM)."""
  try:
    from orbax_pathways.tier import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
    from orbax_pathways.tier import config as tier_config
    from orbax_pathways.tier import store
  except ImportError:
    return
  tier_dir = tier_config.resolve(os.environ.get(tier_config.ENV) or None)
  if tier_dir is not None:
    store.flush()  # a copy still being written would land after the removal
    shutil.rmtree(os.path.join(tier_dir.tier_dir, manifest_lib.root_key(path)), ignore_errors=True)


def open_storage(stack: contextlib.ExitStack, mode: str, tier_dir: str | None, gcs_mod,
                 notes: list) -> Storage:
  """The run's checkpoint root; ``stack`` stops the server or removes the directory at the end."""
  if mode == 'gcs':
    server = stack.enter_context(gcs_mod.FakeGcs(backend='memory'))
    bucket = server.new_bucket('bench')
    stack.enter_context(gcs_mod.applied_env(server.env()))
    notes.append(f'fake-gcs-server at {server.url} (memory backend), bucket {bucket}')
    return Storage(f'gs://{bucket}/bench', bucket)
  if tier_dir:
    os.makedirs(tier_dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix='bench-', dir=tier_dir)
  else:
    root = tempfile.mkdtemp(prefix='orbax-bench-', dir='/tmp')
  stack.callback(shutil.rmtree, root, True)
  return Storage(root)


def ts_bytes_read() -> tuple[int, list[str]]:
  """Sum of tensorstore's per-driver kvstore bytes_read counters (file, gcs, ...): the bytes
  that came off storage (compressed, as stored), the same counter for both handlers.

  ``ts.experimental_collect_matching_metrics`` is tensorstore's experimental metrics API."""
  import tensorstore as ts
  total, names = 0, []
  for m in ts.experimental_collect_matching_metrics('/tensorstore/kvstore/'):
    name = m['name']
    parts = name.split('/')
    if len(parts) == 5 and parts[4] == 'bytes_read' and parts[3] not in ('ocdbt', 'memory'):
      total += sum(int(v.get('value', 0)) for v in m['values'])
      names.append(name)
  return total, names


@contextlib.contextmanager
def capped_gcs(bandwidth_bytes: float | None = None, latency_s: float = 0.0):
  """fake-gcs-server (memory backend) behind ``tests/support/fault_proxy.py``, with its
  bandwidth cap (all connections together; None: uncapped) and, when ``latency_s`` > 0, every
  response held that long (a round trip to GCS), this process's environment (and its
  children's) pointed at the proxy. Yields ``(server, proxy)``; both stop at the end."""
  gcs_mod, why = import_gcs_server()
  if gcs_mod is None:
    raise RuntimeError(why)
  from support.fault_proxy import FaultProxy  # pylint: disable=import-outside-toplevel
  server = gcs_mod.FakeGcs(backend='memory').start()
  proxy = FaultProxy(server.url, rate=0.0, bandwidth=bandwidth_bytes).start()
  if latency_s > 0:
    proxy.delay_s = latency_s
    proxy.set_rate(1.0, ('delay',))
  try:
    for k, v in server.env(proxy.url).items():
      os.environ[k] = v
    for k in gcs_mod.FakeGcs.unset_keys():
      os.environ.pop(k, None)
    yield server, proxy
  finally:
    proxy.stop()
    server.stop()
