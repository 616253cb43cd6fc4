"""A manager save's own ``_CHECKPOINT_METADATA``, remembered while that save runs.

SUPPORTED: orbax-checkpoint ``supported.ORBAX`` (written against 0.12.8).

Orbax's save protocol reads back the step metadata file it has just written three times a save
(the composite handler's metadata at the commit, and the read-modify-write of each of two
updates: the item handlers and metrics, then the commit timestamp), each read an existence
check, a stat and a download; and four times it checks that the step directory is not a file
(an existence and a directory check). On gs:// at 30 ms a request that is about 17 round trips
one after another, about 0.5 s. Served from memory, a local-only save's ``save()`` to
committed went from 1.53-1.59 s to 1.17-1.18 s (measured 2026-12-05 on a 2-core VM, 4
processes: ``benchmarks/local_steps.py --train-only --modes multi_tier --mib 256 --step-s 1
--local-every 1 --storage-every 1000 --steps 30 --update device --latency-ms 30``). A local
save's hidden save starts only once the previous one committed (``multitier/local_steps.py``),
so with a local save every step a commit longer than the step puts the saves back to back.

Patches, installed by ``install()`` and restored exactly (the very same function objects) by
``uninstall()``; both idempotent:

- ``metadata.checkpoint._MetadataStoreImpl.write`` / ``read`` (under Orbax's blocking and
  non-blocking metadata stores): for a file inside a step directory registered with
  ``begin(step_dir)`` (``inside_registered``), a write that succeeded is remembered (its JSON;
  on gs:// it is one multipart upload, ``orbax_small_writes.put``), and a read returns a copy
  of what was remembered without a request; an update (Orbax's read, then write) then costs its
  write only. Any other file: Orbax's own, untouched.
- ``metadata.checkpoint._sanitize_metadata_path(path)``: a registered step directory is
  returned as it is, without the existence and directory checks (it is a directory this save
  made).

The same memory serves ``orbax_small_writes.py`` (the ``Memory`` it is installed with): the
other small files a save writes through ``async_path.write_text`` at most three levels under a
registered directory (``inside_registered``) are remembered (``remember_file``), read back
(``recall_file``) and known to exist, with the directories above them (``holds_files_under``),
until the registration ends; and which registered step directories this process's save created
(``remember_created``, ``created_fresh``: ``orbax_small_writes`` then creates an item directory
in one without asking storage whether it exists).

Who registers what: ``manager/step_metadata.py``'s hook, on every process, registers the step
directory of every ``CheckpointManager`` save Orbax's policy takes (storage steps and the hidden
manager's local-only ones) from just before Orbax writes anything of it until its commit ended
(committed or failed: Orbax's ``_finalize`` runs either way), or until its ``save`` raised or
was declined. Nothing else is registered: restores, listings, ``ocp.v1.save_pytree`` and every other reader
read storage as Orbax does. Why it cannot return stale metadata: while a step is saved, the
only writer of its ``_CHECKPOINT_METADATA`` is this save, on the manager's primary host
(Orbax's protocol), and no reader of that step runs (it is not committed, so not listed); a
process that did not write the file (every other process) finds nothing remembered and reads
storage. On a local disk Orbax saves into a temporary directory and renames it, so the
registered final path matches nothing: this matters on gs://, where Orbax writes in place.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from typing import Any, Callable, Iterator

from etils import epath

from orbax_pathways._compat import orbax_small_writes
from orbax_pathways._compat import seam
from orbax_pathways._compat import src
from orbax_pathways._compat import supported

_checkpoint = src.orbax('metadata.checkpoint')

SUPPORTED = supported.ORBAX

_lock = threading.Lock()
_scopes: dict[str, int] = {}  # registered step directory -> how many registrations
_remembered: dict[str, str] = {}  # metadata file in a registered directory -> its JSON
_created: set[str] = set()  # registered step directories this process's save created


def _key(path: Any) -> str:
  return str(epath.Path(path))


def _wrap_write(original):
  @functools.wraps(original)
  def write(self, file_path, metadata):
    if not inside_registered(file_path):
      return original(self, file_path, metadata)
    text = json.dumps(metadata)
    # A save's own file on gs://: one multipart upload, not a resumable one (two requests);
    # elsewhere Orbax's write (orbax_small_writes.py).
    out = None if orbax_small_writes.put(file_path, text.encode()) else original(
        self, file_path, metadata)
    remember_file(file_path, text)
    return out
  return write


def remember_file(file_path: Any, text: str) -> None:
  """Remembers ``text`` as what this process just wrote to ``file_path`` (a save's small file,
  ``inside_registered``: ``orbax_small_writes``), while its step directory stays registered."""
  key = _key(file_path)
  with _lock:
    if _scope_of(key) is not None:
      _remembered[key] = text


def recall_file(file_path: Any) -> str | None:
  """What this process wrote to ``file_path`` during the save in progress, or None (not
  registered, or not written by this process: read storage)."""
  if not _scopes:
    return None
  with _lock:
    return _remembered.get(_key(file_path))


def holds_files_under(path: Any) -> bool:
  """Whether this process wrote, during a save in progress, a file at or under ``path`` (so it
  exists, a directory on gs:// included, without asking storage)."""
  if not _scopes:
    return False
  key = _key(path)
  with _lock:
    return any(n == key or n.startswith(key + '/') for n in _remembered)


def remember_created(directory: Any) -> None:
  """Notes that this process's save just created ``directory`` (Orbax's directory creation
  found nothing there, or removed what it found, then made it), if it is a registered step
  directory; forgotten when the registration ends."""
  key = _key(directory)
  with _lock:
    if key in _scopes:
      _created.add(key)


def created_fresh(directory: Any) -> bool:
  """Whether ``directory`` is a registered step directory that this process's save created
  (``remember_created``): nothing of another save lies under it."""
  if not _scopes:
    return False
  with _lock:
    return _key(directory) in _created


def _scope_of(key: str) -> str | None:
  """The registered step directory ``key`` (a path) lies in (at most three levels down)."""
  parent = epath.Path(key).parent
  for _ in range(3):
    if str(parent) in _scopes:
      return str(parent)
    parent = parent.parent
  return None


def inside_registered(file_path: Any) -> bool:
  """Whether ``file_path`` lies at most three levels under a registered step directory (the
  step's files, its items' and their ``array_metadatas``'): a file of a save in progress."""
  if not _scopes:
    return False
  return _scope_of(_key(file_path)) is not None


def _wrap_read(original):
  @functools.wraps(original)
  def read(self, file_path):
    text = recall_file(file_path)
    return json.loads(text) if text is not None else original(self, file_path)
  return read


def _wrap_sanitize(original):
  @functools.wraps(original)
  def _sanitize_metadata_path(path):
    if _scopes and _key(path) in _scopes:
      return epath.Path(path)
    return original(path)
  return _sanitize_metadata_path


FEATURE = seam.Feature(
    'a manager save\'s own step metadata read from memory',
    'Orbax\'s metadata store reads back on storage what the same save just wrote',
    lambda: [seam.Target(lambda: _checkpoint._MetadataStoreImpl, 'write', _wrap_write),  # pylint: disable=protected-access
             seam.Target(lambda: _checkpoint._MetadataStoreImpl, 'read', _wrap_read),  # pylint: disable=protected-access
             seam.Target(lambda: _checkpoint, '_sanitize_metadata_path', _wrap_sanitize)])


def install() -> None:
  """Installs the three wrappers (once). An Orbax without one of them is left as it is (every
  read then goes to storage, as stock)."""
  seam.install(FEATURE)


def uninstall() -> None:
  """Puts Orbax's own functions back (idempotent)."""
  seam.uninstall(FEATURE)


def installed() -> bool:
  return seam.installed(FEATURE)


def begin(step_dir: epath.PathLike) -> str:
  """Registers ``step_dir``: from now on its ``_CHECKPOINT_METADATA`` as this process last wrote
  it is read from memory (see the module docstring). Returns the key ``end`` takes.
  Registrations of one directory nest (each ``begin`` needs its own ``end``)."""
  key = _key(step_dir)
  with _lock:
    _scopes[key] = _scopes.get(key, 0) + 1
  return key


def end(key: str) -> None:
  """Ends one ``begin(step_dir)`` (its returned ``key``); at the last one, what was remembered
  of the directory is forgotten."""
  with _lock:
    left = _scopes.get(key, 0) - 1
    if left > 0:
      _scopes[key] = left
      return
    _scopes.pop(key, None)
    _created.discard(key)
    for name in [n for n in _remembered if n.startswith(key + '/')]:
      del _remembered[name]


def registered() -> list[str]:
  """The step directories registered now (for tests: none once every save ended)."""
  with _lock:
    return sorted(_scopes)


@contextlib.contextmanager
def remembering(step_dir: epath.PathLike) -> Iterator[None]:
  """``begin(step_dir)`` for the block, ``end`` at its end."""
  key = begin(step_dir)
  try:
    yield
  finally:
    end(key)
