"""Deadlines for the storage requests Orbax makes through clients other than tensorstore.

Orbax reaches ``gs://`` for its step protocol through two Python clients besides tensorstore:

- ``etils.epath`` -> fsspec -> ``gcsfs`` (aiohttp): the listing of steps, every existence and
  ``is_dir`` check (an object stat plus a one-entry listing), ``_CHECKPOINT_METADATA``,
  ``_METADATA``, ``array_metadatas/process_<i>``, ``commit_success.txt``, the step's uploads,
  renames and deletes. gcsfs passes ``GCSFileSystem.requests_timeout`` to aiohttp for each
  request; left unset, aiohttp waits up to 300 s for a request the server accepted and never
  answered, and gcsfs then gives up without retrying (a total timeout is no ``ClientError``).
- ``google-cloud-storage``: Orbax's ``gcs_utils.get_bucket`` (the hierarchical-namespace check
  before it lists steps, once per bucket and process), with the client's 60 s read timeout.

``configure(stall_s)`` gives both the package's stall deadline (``storage/hedge.stall_timeout_s``
of ``Options.request_deadline_floor_s``, the same one tensorstore's own transfers get): a
request whose answer stays silent that long (aiohttp's ``sock_read``, measured from the moment
the request was sent, and reset by every byte received; requests' read timeout for the bucket
lookup) fails, and the client's own retry issues it again (gcsfs: 6 attempts; google-cloud-
storage: ``DEFAULT_RETRY``). A large transfer that keeps moving is never cut: there is no total
limit. A value the user set (``requests_timeout`` in fsspec's config or on a filesystem) is kept.

Called by ``engine.Engine`` (each handler built: the last options set it; a client's timeout is
process-wide by nature, unlike our own requests' deadline bounds) on the controller process; ``uninstall`` (from
``orbax_pathways.uninstall``) puts the clients back as they were. Imports gcsfs only if this
process already did (so ``import orbax_pathways`` does not import it).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from typing import Any

from orbax_pathways._compat import seam
from orbax_pathways._compat import src

_lock = threading.Lock()


class _Config:
  timeout: Any = None  # the aiohttp.ClientTimeout we set (None: not configured)
  stall_s: float | None = None


_config = _Config()
_buckets: dict[str, Any] = {}
PROTOCOLS = ('gs', 'gcs')


def _gcsfs_installed() -> bool:
  return 'gcsfs' in sys.modules or importlib.util.find_spec('gcsfs') is not None


def gcs_filesystems() -> list[Any]:
  """Every gcsfs filesystem of this process that exists now (etils.epath's and fsspec's
  instance caches); none unless gcsfs is already imported. Also used by
  ``orbax_manager.invalidate_gcs_listings``."""
  gcsfs = sys.modules.get('gcsfs')
  if gcsfs is None:
    return []
  from etils import epath  # pylint: disable=g-import-not-at-top
  instances = [epath.backend.fsspec_backend.fs('gs://bucket/')]
  pending = [gcsfs.GCSFileSystem]
  while pending:
    cls = pending.pop()
    pending.extend(cls.__subclasses__())
    instances.extend(getattr(cls, '_cache', {}).values())
  return list({id(fs): fs for fs in instances}.values())


def _set_gcsfs(new: Any, old: Any) -> None:
  """``requests_timeout`` ``new`` in fsspec's config and on every gcsfs filesystem where it is
  unset or still ``old`` (ours); a value anybody else set stays."""
  import fsspec.config  # pylint: disable=g-import-not-at-top
  for proto in PROTOCOLS:
    conf = fsspec.config.conf.setdefault(proto, {})
    current = conf.get('requests_timeout')
    if current is None or (old is not None and current is old):
      if new is None:
        conf.pop('requests_timeout', None)
      else:
        conf['requests_timeout'] = new
  for fs in gcs_filesystems():
    current = getattr(fs, 'requests_timeout', None)
    if current is None or (old is not None and current is old):
      fs.requests_timeout = new


def _get_bucket(bucket_name: str) -> Any:
  """Orbax's ``gcs_utils.get_bucket`` (cached per bucket, like Orbax's), with our read
  deadline instead of the client's 60 s."""
  with _lock:
    hit = _buckets.get(bucket_name)
    stall_s = _config.stall_s
  if hit is not None:
    return hit
  from google.cloud import storage  # type: ignore[import-untyped]  # pylint: disable=g-import-not-at-top
  kwargs = {} if stall_s is None else {'timeout': stall_s}
  bucket = storage.Client().get_bucket(bucket_name, **kwargs)
  with _lock:
    _buckets.setdefault(bucket_name, bucket)
    if len(_buckets) > 32:
      _buckets.pop(next(iter(_buckets)))
  return bucket


FEATURE = seam.Feature(
    'Orbax\'s bucket lookup on gs:// bounded by the package\'s request deadline',
    'Orbax looks its bucket up with the client\'s 60 s default and no setting',
    lambda: [seam.Target(lambda: src.orbax('path.gcs_utils'), 'get_bucket',
                         lambda _: _get_bucket)])


def configure(stall_s: float) -> None:
  """Every gcsfs request, and Orbax's bucket lookup, fails after ``stall_s`` seconds without a
  byte of its answer (then the client retries it)."""
  with _lock:
    if _config.stall_s == stall_s and _config.timeout is not None:
      return
    old = _config.timeout
    new = None
    if _gcsfs_installed():
      import aiohttp  # pylint: disable=g-import-not-at-top
      new = aiohttp.ClientTimeout(total=None, sock_connect=stall_s, sock_read=stall_s)
      _set_gcsfs(new, old)
    _config.timeout, _config.stall_s = new, stall_s
    seam.install(FEATURE)


def uninstall() -> None:
  """The clients as they were before ``configure`` (a value someone else set since stays)."""
  with _lock:
    if _config.timeout is not None:
      _set_gcsfs(None, _config.timeout)
    seam.uninstall(FEATURE)
    _config.timeout, _config.stall_s = None, None
    _buckets.clear()


def gcsfs_requests_timeout() -> Any:
  """The aiohttp timeout gcsfs requests get now (epath's filesystem), for tests and logs; None
  without gcsfs."""
  filesystems = gcs_filesystems()
  return getattr(filesystems[0], 'requests_timeout', None) if filesystems else None

