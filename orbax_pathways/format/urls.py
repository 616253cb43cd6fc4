"""Storage URLs, in one place: which scheme a checkpoint path names, whether reading it costs a
request to remote storage, and the bucket kvstore tensorstore opens for it.

Pure string handling (no I/O, no tensorstore). ``format/`` is the lowest layer that names
storage, so the layers above (storage's records, the tier, the manager, ``_compat``, the CLI)
ask here instead of testing for ``'://'`` or ``'gs://'`` each on its own. A new scheme with a
bucket (tensorstore's ``s3`` driver, say) is one entry of ``BUCKET_DRIVERS``.
"""

from __future__ import annotations

import os
from typing import Any

# Schemes whose paths are ``<scheme>://<bucket>/<key>``, and tensorstore's kvstore driver for
# each (gs:// may be read through another driver: ``bucket_kvstore``'s ``gcs_driver``).
BUCKET_DRIVERS = {'gs': 'gcs', 's3': 's3'}


def scheme(path: Any) -> str:
  """The URL scheme of ``path`` (``'gs'``, ``'s3'``, ``'file'``, ...), or ``''`` for a path on
  this machine."""
  head, sep, _ = os.fspath(path).partition('://')
  return head if sep else ''


def is_url(path: Any) -> bool:
  """Whether ``path`` is written as a URL (``file://`` included)."""
  return scheme(path) != ''


def is_remote(path: Any) -> bool:
  """Whether ``path`` names remote storage: a URL of any scheme but ``file://``. (A local path
  on a network filesystem is remote too for the tier's purposes: ``tier/config``.)"""
  return scheme(path) not in ('', 'file')


def is_gcs(path: Any) -> bool:
  return scheme(path) == 'gs'


def bucket_kvstore(path: Any, *, gcs_driver: str = 'gcs') -> dict[str, str] | None:
  """``{'driver', 'bucket', 'path'}`` for a path of a ``BUCKET_DRIVERS`` scheme, its key as
  written (no slash added or removed); None for any other path."""
  text = os.fspath(path)
  s = scheme(text)
  if s not in BUCKET_DRIVERS:
    return None
  bucket, _, key = text[len(s) + 3:].partition('/')
  return {'driver': gcs_driver if s == 'gs' else BUCKET_DRIVERS[s], 'bucket': bucket, 'path': key}
