"""A manager save's small files on gs://, one request each.

SUPPORTED: orbax-checkpoint ``supported.ORBAX`` (written against 0.12.8).

Orbax writes a step's small files (the item's ``_METADATA``, ``array_metadatas/process_<i>``,
``commit_success.txt``) through ``path.async_path.write_text``: a delete of the object first,
then etils' ``write_text``, which gcsfs sends as a resumable upload (a start and the bytes). On
gs:// that is three round trips one after another per file; the delete only matters where a
write cannot replace a file, and a GCS upload replaces the object whole. Here a file of a save
in progress is written with gcsfs's ``pipe_file`` instead: one multipart upload, which replaces
the object in one request with the same bytes (``put``). ``_compat/orbax_step_metadata.py``
writes the step's ``_CHECKPOINT_METADATA`` the same way.

Patch, installed by ``install(inside)`` and restored exactly (the very same function object)
by ``uninstall()``; both idempotent:

- ``path.async_path.write_text(path, text)``: when ``inside(path)`` (a file at most three levels
  under the step directory of a ``CheckpointManager`` save in progress on this process:
  ``orbax_step_metadata.inside_registered``) and the path is on gs:// through etils' fsspec
  backend, ``put``; anything else (local disks, ``ocp.v1.save_pytree``, other files): Orbax's
  own. Orbax's modules call ``async_path.write_text`` by attribute, so patching the module
  reaches every caller.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any, Callable

from etils import epath

from orbax_pathways._compat import src
from orbax_pathways._compat import supported

_async_path = src.orbax('path.async_path')

SUPPORTED = supported.ORBAX

_lock = threading.Lock()
_original: list[Callable[..., Any]] = []  # Orbax's own write_text, while installed


def put(path: Any, data: bytes) -> bool:
  """Writes ``data`` to ``path`` in one request when it is on gs:// through etils' fsspec
  backend (gcsfs ``pipe_file``: a multipart upload, replacing any object there); returns
  False, having written nothing, for any other path (the caller writes it as Orbax does)."""
  path = epath.Path(path)
  if not str(path).startswith('gs://'):
    return False
  backend: Any = getattr(path, '_backend', None)
  fs_of = getattr(backend, 'fs', None)
  if fs_of is None:
    return False
  fs: Any = fs_of(str(path))
  pipe = getattr(fs, 'pipe_file', None)
  if pipe is None:
    return False
  pipe(str(path), data)
  return True


def _wrap_write_text(original, inside: Callable[[Any], bool]):
  @functools.wraps(original)
  async def write_text(path, text):
    if inside(path):
      data = text.encode('utf-8')
      if await asyncio.to_thread(put, path, data):
        return len(text)
    return await original(path, text)
  return write_text


def install(inside: Callable[[Any], bool]) -> None:
  """Wraps ``async_path.write_text`` (once); ``inside(path)`` says which files are a save's.
  An Orbax without it is left as it is."""
  with _lock:
    if _original or 'write_text' not in vars(_async_path):
      return
    _original.append(vars(_async_path)['write_text'])
    _async_path.write_text = _wrap_write_text(_original[0], inside)


def uninstall() -> None:
  """Puts Orbax's own ``write_text`` back (idempotent)."""
  with _lock:
    if _original:
      _async_path.write_text = _original.pop()


def installed() -> bool:
  return bool(_original)
