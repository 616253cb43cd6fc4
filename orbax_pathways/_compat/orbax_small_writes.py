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
  the save in progress, that file or a file under that directory; ``False`` without a request
  for the directory being created by the ``_create_tmp_directory`` call below; else Orbax's own.
- ``path.atomicity._create_tmp_directory(makedir, tmp_dir, ...)``: Orbax's own (it asks whether
  ``tmp_dir`` exists, removes it if so, makes it), except that when ``tmp_dir``'s parent is a
  step directory this process's save has just created (``created_fresh``: the item directories
  of a step, on gs:// where Orbax saves in place) the existence check is answered ``False``
  without a request: nothing can lie in a directory that did not exist a moment ago, since
  Orbax lets no process write into a step before its directories are made. A registered step
  directory it creates is noted (``remember_created``). On gs:// at 30 ms a request that is
  two round trips one after another per item, in every save's commit.

Anything else (restores, listings, ``ocp.v1.save_pytree``, other processes' files, files this
save did not write): Orbax's own, from storage. Why nothing stale is returned: a save's files
have one writer, the process that saves them (``array_metadatas/process_<i>`` is process i's),
and no reader of an uncommitted step runs. Orbax's modules call these functions by attribute on
``async_path``, so patching the module reaches every caller.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from typing import Any, Callable, Protocol

from etils import epath

from orbax_pathways._compat import seam
from orbax_pathways._compat import src
from orbax_pathways._compat import supported
from orbax_pathways.format import urls

_async_path = src.orbax('path.async_path')
_atomicity = src.orbax('path.atomicity')

SUPPORTED = supported.ORBAX

_lock = threading.Lock()
# The directory the running ``_create_tmp_directory`` call creates inside a step directory
# this save created (its existence check answered False), in that call's asyncio context.
_creating_fresh: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    'orbax_pathways_creating_fresh', default=None)


def put(path: Any, data: bytes) -> bool:
  """Writes ``data`` to ``path`` in one request when it is on gs:// through etils' fsspec
  backend (gcsfs ``pipe_file``: a multipart upload, replacing any object there); returns
  False, having written nothing, for any other path (the caller writes it as Orbax does)."""
  path = epath.Path(path)
  if not urls.is_gcs(path):
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
  def remember_created(self, directory: Any) -> None: ...
  def created_fresh(self, directory: Any) -> bool: ...


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
    if memory.holds_files_under(path):
      return True
    creating = _creating_fresh.get()
    if creating is not None and creating == str(epath.Path(path)):
      return False
    return await original(path)
  return exists


def _wrap_create_tmp_directory(original, memory: Memory):
  @functools.wraps(original)
  async def _create_tmp_directory(async_makedir_func, tmp_dir, *args, **kwargs):
    path = epath.Path(tmp_dir)
    token = _creating_fresh.set(str(path) if memory.created_fresh(path.parent) else None)
    try:
      out = await original(async_makedir_func, tmp_dir, *args, **kwargs)
    finally:
      _creating_fresh.reset(token)
    memory.remember_created(path)  # noted only for a registered step directory
    return out
  return _create_tmp_directory


_WRAPS = ((_async_path, 'write_text', _wrap_write_text),
          (_async_path, 'read_text', _wrap_read_text),
          (_async_path, 'exists', _wrap_exists))
_OPTIONAL = ((_atomicity, '_create_tmp_directory', _wrap_create_tmp_directory),)
NAME = ('a manager save\'s small files written in one request each on gs:// and read back '
        'from memory')


def _target(owner: Any, name: str, wrap: Callable[..., Any], memory: Memory,
            optional: bool = False) -> seam.Target:
  return seam.Target(lambda: owner, name, lambda original: wrap(original, memory),
                     optional=optional)


def _feature(memory: Memory) -> seam.Feature:
  return seam.Feature(
      NAME, 'Orbax writes and reads its small step files through module functions, no hook',
      lambda: ([_target(o, name, w, memory) for o, name, w in _WRAPS] +
               [_target(o, name, w, memory, optional=True) for o, name, w in _OPTIONAL]))


def install(memory: Memory) -> None:
  """Wraps ``async_path.write_text``, ``read_text`` and ``exists`` (once), and
  ``atomicity._create_tmp_directory`` where this Orbax has it; ``memory`` says which files are a
  save's and remembers what it wrote. An Orbax without one of the three is left as it is."""
  seam.install(_feature(memory))


def uninstall() -> None:
  """Puts Orbax's own functions back (idempotent)."""
  seam.uninstall(NAME)


def installed() -> bool:
  return seam.installed(NAME)
