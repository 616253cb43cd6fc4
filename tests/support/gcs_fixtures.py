"""pytest fixtures for tests against fake-gcs-server, in the process that runs pytest
(``tests/conftest.py`` imports them: ``fake_gcs``, ``gcs_bucket``, ``faulty_gcs``).

Importing this module sets the endpoint-independent variables of ``hermetic_env`` in
os.environ at once, because several are read only when a library is imported
(google-auth's NO_GCE_CHECK / GCE_METADATA_HOST, gcsfs's GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT,
fsspec's FSSPEC_GCS_*). The endpoint (STORAGE_EMULATOR_HOST, TENSORSTORE_GCS_HTTP_URL) is
set per test by ``gcs_bucket`` / ``faulty_gcs`` with monkeypatch.

Behind the fault proxy, gcsfs's own backoff between attempts (1, 2, 4, 8, 16 s plus up to 1 s)
is only waiting: ``faulty_gcs`` scales it down (``fast_gcsfs_backoff``); every fault is still
injected, seen and retried by the same code, the same number of times.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
import uuid

import pytest

from support.fault_proxy import FaultProxy
from support.gcs_server import FakeGcs, configure_fsspec_anon, hermetic_env

_ENDPOINT_KEYS = ('STORAGE_EMULATOR_HOST', 'TENSORSTORE_GCS_HTTP_URL')
GCSFS_BACKOFF_SCALE = 20  # gcsfs's backoff sleeps are divided by this behind the fault proxy


def _apply_static_env() -> None:
  cfg = tempfile.mkdtemp(prefix='gcloud-empty-')
  for k in FakeGcs.unset_keys():
    os.environ.pop(k, None)
  for k, v in hermetic_env('http://127.0.0.1:1', cfg).items():
    if k not in _ENDPOINT_KEYS:
      os.environ[k] = v
  configure_fsspec_anon()


_apply_static_env()


@dataclasses.dataclass(frozen=True)
class GcsBucket:
  """A fresh bucket on the fake server. ``root`` is ``gs://<name>``."""

  name: str
  server: FakeGcs
  endpoint: str  # the URL clients were pointed at (server or proxy)

  @property
  def root(self) -> str:
    return f'gs://{self.name}'

  def path(self, *parts: str) -> str:
    return '/'.join([self.root, *parts])

  def objects(self) -> list[str]:
    """Object names in the bucket, read directly from the server (no proxy)."""
    return self.server.list_objects(self.name)


@dataclasses.dataclass(frozen=True)
class FaultyGcs(GcsBucket):
  proxy: FaultProxy = None  # type: ignore[assignment]


def _point_at(monkeypatch: pytest.MonkeyPatch, server: FakeGcs, url: str) -> None:
  for k, v in server.env(url).items():
    monkeypatch.setenv(k, v)
  for k in FakeGcs.unset_keys():
    monkeypatch.delenv(k, raising=False)
  # gcsfs caches filesystem instances; the endpoint is read per request, but start clean.
  configure_fsspec_anon()


def _fresh_name(prefix: str) -> str:
  name = f'{prefix}-{uuid.uuid4().hex[:20]}'
  assert 3 <= len(name) <= 63
  return name


@pytest.fixture(scope='session')
def fake_gcs():
  """One fake-gcs-server (in-memory) for the whole session."""
  with FakeGcs(backend='memory') as server:
    yield server


@pytest.fixture
def gcs_bucket(fake_gcs: FakeGcs, monkeypatch: pytest.MonkeyPatch) -> GcsBucket:
  """A fresh bucket, with every GCS client in this process pointed at the fake server.

  A fresh bucket per test also means a fresh tensorstore gcs driver: tensorstore reads
  TENSORSTORE_GCS_HTTP_URL when it opens a driver, and reuses an open driver (per Context
  and bucket) with the URL it had then.
  """
  name = fake_gcs.create_bucket(_fresh_name('t'))
  _point_at(monkeypatch, fake_gcs, fake_gcs.url)
  yield GcsBucket(name=name, server=fake_gcs, endpoint=fake_gcs.url)
  configure_fsspec_anon()


class _ScaledSleep:
  """``asyncio`` as gcsfs.retry sees it, with ``sleep`` shortened by ``GCSFS_BACKOFF_SCALE``."""

  def __init__(self, module):
    self._module = module

  def __getattr__(self, name):
    return getattr(self._module, name)

  async def sleep(self, delay, result=None):
    return await self._module.sleep(delay / GCSFS_BACKOFF_SCALE, result)


@pytest.fixture
def fast_gcsfs_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
  """gcsfs (``retry.retry_request``) sleeps ``2 ** (attempt - 1)`` s plus jitter before each of
  its 5 retries; a test that makes storage fail on purpose only waits for that. In this process,
  for this test, those sleeps are divided by ``GCSFS_BACKOFF_SCALE``."""
  try:
    import gcsfs.retry  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  if getattr(gcsfs.retry, 'asyncio', None) is asyncio:
    monkeypatch.setattr(gcsfs.retry, 'asyncio', _ScaledSleep(asyncio))


@pytest.fixture
def faulty_gcs(fake_gcs: FakeGcs, monkeypatch: pytest.MonkeyPatch, fast_gcsfs_backoff):
  """Like ``gcs_bucket`` but every client goes through a FaultProxy (rate 0 at first;
  call ``faulty_gcs.proxy.set_rate(p)``), with gcsfs's backoff shortened
  (``fast_gcsfs_backoff``)."""
  name = fake_gcs.create_bucket(_fresh_name('f'))
  with FaultProxy(fake_gcs.url, rate=0.0, seed=1234) as proxy:
    _point_at(monkeypatch, fake_gcs, proxy.url)
    yield FaultyGcs(name=name, server=fake_gcs, endpoint=proxy.url, proxy=proxy)
    configure_fsspec_anon()
