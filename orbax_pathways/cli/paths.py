"""Paths for the CLI: arguments to ``epath``, storage errors to one-line user errors, sizes.

Called by every command (``steps``, ``arrays``, ``verify``) on the machine running the CLI. Local
paths and ``gs://`` go through ``etils.epath`` (gcsfs) and ``fsspec``; nothing here imports jax or
tensorstore.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any, Iterator

from etils import epath

from orbax_pathways.format import urls


class CliError(Exception):
  """A user error: printed as one line, exit code 2, no traceback."""


class DamagedFile(ValueError):
  """A metadata file that exists but cannot be parsed. ``str()`` names the file and the cause."""

  def __init__(self, path: epath.Path, cause: str):
    super().__init__(f'{path} is damaged ({cause})')
    self.path, self.cause = path, cause


def to_path(s: str | os.PathLike[str]) -> epath.Path:
  """A CLI argument as an epath (local paths made absolute: tensorstore's OCDBT needs that)."""
  text = os.fspath(s)
  if not text.strip():
    raise CliError('empty path: pass a checkpoint directory (use . for the current directory).')
  if not urls.is_url(text):
    text = os.path.abspath(text)
  path = epath.Path(text)
  preflight(path)
  return path


def is_remote(path: epath.Path) -> bool:
  """Written as a URL (``file://`` too): a path the CLI does not resolve on this machine."""
  return urls.is_url(path)


def preflight(path: epath.Path) -> None:
  """Fails fast, in one line, on gs:// without credentials (gcsfs would retry for a minute)."""
  if not urls.is_gcs(path) or os.environ.get('STORAGE_EMULATOR_HOST'):
    return
  try:
    import google.auth  # pylint: disable=g-import-not-at-top
    import google.auth.exceptions  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  try:
    google.auth.default()
  except google.auth.exceptions.DefaultCredentialsError as e:
    raise CliError(
        f'cannot read {path}: no Google Cloud credentials found (looked for Application Default '
        'Credentials: GOOGLE_APPLICATION_CREDENTIALS, gcloud, the GCE metadata server). Run '
        '`gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS.'
    ) from e


_CREDENTIAL_HINTS = (
    'DefaultCredentialsError', 'default credentials', 'Could not automatically determine',
    'UNAUTHENTICATED', 'PERMISSION_DENIED', 'Anonymous caller', 'RefreshError', 'invalid_grant',
)
_HTTP_AUTH = re.compile(r'\b(401|403)\b')


def classify_remote_error(path: epath.Path, e: BaseException) -> CliError | None:
  """The single place that turns a storage exception into a user error (by its text)."""
  text = f'{type(e).__name__}: {e}'
  if not is_remote(path):
    return None
  if isinstance(e, ImportError) or 'Please install gcsfs' in text:
    return CliError(f'cannot read {path}: gs:// paths need gcsfs (pip install gcsfs).')
  if any(h in text for h in _CREDENTIAL_HINTS) or _HTTP_AUTH.search(text):
    return CliError(
        f'cannot read {path}: no usable Google Cloud credentials ({type(e).__name__}). '
        'Run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS.'
    )
  return CliError(f'cannot read {path}: {text.splitlines()[0][:300]}')


@contextlib.contextmanager
def remote_errors(path: epath.Path) -> Iterator[None]:
  """Turns credential / transport failures on gs:// into one-line CliErrors."""
  try:
    yield
  except (CliError, DamagedFile):
    raise
  except Exception as e:  # pylint: disable=broad-except
    err = classify_remote_error(path, e)
    if err is None:
      raise
    raise err from e


def exists(path: epath.Path) -> bool:
  with remote_errors(path):
    return path.exists()


def is_dir(path: epath.Path) -> bool:
  with remote_errors(path):
    return path.is_dir()


def listdir(path: epath.Path) -> list[epath.Path]:
  with remote_errors(path):
    return sorted(path.iterdir(), key=lambda p: p.name)


def read_json(path: epath.Path) -> Any:
  """The parsed file; DamagedFile (naming the file) when it is not UTF-8 JSON."""
  data = path.read_bytes()
  try:
    return json.loads(data.decode('utf-8'))
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    raise DamagedFile(path, f'not valid JSON: {type(e).__name__}: {e}') from e


def dir_size(path: epath.Path) -> int:
  """Total bytes of the files under ``path`` (one listing on gs://)."""
  if not is_remote(path):
    total = 0
    for root, _, files in os.walk(os.fspath(path)):
      for f in files:
        with contextlib.suppress(OSError):
          total += os.stat(os.path.join(root, f)).st_size
    return total
  import fsspec  # pylint: disable=g-import-not-at-top

  with remote_errors(path):
    fs, p = fsspec.core.url_to_fs(os.fspath(path))
    return sum(int(i.get('size') or 0) for i in fs.find(p, detail=True).values())
