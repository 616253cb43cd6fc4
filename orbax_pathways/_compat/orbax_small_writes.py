"""A manager save's small files on gs://, one request each, and read back from memory.

SUPPORTED: orbax-checkpoint ``supported.ORBAX`` (written against 0.12.8).

Orbax writes a step's small files (the item's ``_METADATA``, ``array_metadatas/process_<i>``,
``commit_success.txt``) through ``path.async_path.write_text``: a delete of the object first,
then etils' ``write_text``, which gcsfs sends as a resumable upload (a start and the bytes). On
gs:// that is three round trips one after another per file; the delete only matters where a
write cannot replace a file, and a GCS upload replaces the object whole. Here a file of a save
in progress is written with gcsfs's ``pipe_file`` instead: one multipart upload, which replaces
the object in one request with the same bytes (``put``). ``_compat/orbax_step_metadata.py``
writes the step's ``_CHECKPOINT_METADATA`` the same way.

Patches, installed by ``install(memory)`` and restored exactly (the very same function
objects) by ``uninstall()``; both idempotent. ``memory`` is ``orbax_step_metadata``: a file
"of a save in progress" lies at most three levels under the step directory of a
``CheckpointManager`` save running on this process (``inside_registered``).

- ``path.async_path.write_text(path, text)``: a file of a save in progress on gs:// through
  etils' fsspec backend: ``put``; elsewhere Orbax's own; either way the text is remembered
  (``remember_file``) until the save ends.
- ``path.async_path.read_text(path)``: what this process wrote to that file during the save
  in progress (Orbax reads its ``array_metadatas/process_<i>`` back to extend and to validate
  it), else Orbax's own.
- ``path.async_path.exists(path)``: ``True`` without a request when this process wrote, during
  the save in progress, that file or a file under that directory; else Orbax's own.

Anything else (restores, listings, ``ocp.v1.save_pytree``, other processes' files, files this
save did not write): Orbax's own, from storage. Why nothing stale is returned: a save's files
have one writer, the process that saves them (``array_metadatas/process_<i>`` is process i's),
and no reader of an uncommitted step runs. Orbax's modules call these functions by attribute on
``async_path``, so patching the module reaches every caller.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any, Callable, Protocol

from etils import epath

from orbax_pathways._compat import src
from orbax_pathways._compat import supported

_async_path = src.orbax('path.async_path')

SUPPORTED = supported.ORBAX

_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}  # Orbax's own functions, while installed


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


class Memory(Protocol):
  """What a save in progress remembers of its own files (``orbax_step_metadata``)."""

  def inside_registered(self, file_path: Any) -> bool: ...
  def remember_file(self, file_path: Any, text: str) -> None: ...
  def recall_file(self, file_path: Any) -> str | None: ...
  def holds_files_under(self, path: Any) -> bool: ...


def _wrap_write_text(original, memory: Memory):
  @functools.wraps(original)
  async def write_text(path, text):
    if not memory.inside_registered(path):
      return await original(path, text)
    if await asyncio.to_thread(put, path, text.encode('utf-8')):
      out = len(text)
    else:
      out = await original(path, text)
    memory.remember_file(path, text)
    return out
  return write_text


def _wrap_read_text(original, memory: Memory):
  @functools.wraps(original)
  async def read_text(path):
    text = memory.recall_file(path)
    return text if text is not None else await original(path)
  return read_text


def _wrap_exists(original, memory: Memory):
  @functools.wraps(original)
  async def exists(path):
    return True if memory.holds_files_under(path) else await original(path)
  return exists


_WRAPS = (('write_text', _wrap_write_text), ('read_text', _wrap_read_text),
          ('exists', _wrap_exists))


def install(memory: Memory) -> None:
  """Wraps ``async_path.write_text``, ``read_text`` and ``exists`` (once); ``memory`` says which
  files are a save's and remembers what it wrote. An Orbax without one of them is left as it
  is."""
  with _lock:
    if _originals or not all(name in vars(_async_path) for name, _ in _WRAPS):
      return
    for name, wrap in _WRAPS:
      _originals[name] = vars(_async_path)[name]
      setattr(_async_path, name, wrap(_originals[name], memory))


def uninstall() -> None:
  """Puts Orbax's own functions back (idempotent)."""
  with _lock:
    for name, original in _originals.items():
      setattr(_async_path, name, original)
    _originals.clear()


def installed() -> bool:
  return bool(_originals)
