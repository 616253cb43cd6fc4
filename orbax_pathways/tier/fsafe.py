"""The node-local tier's file system access, safe on a node shared with other users.

The tier lives in a directory other local users can name (``/dev/shm/orbax-pathways-<uid>`` is
predictable, and ``/dev/shm`` is world-writable), holds checkpoint values, and is served to the
job's other processes. So every access here follows four rules:

- **The root is ours and private.** ``private_root`` creates the tier directory ``0700``; one
  that exists is used only if it is a real directory (not a symlink) owned by this uid and not
  group- or world-writable (one that is only readable by others is tightened to ``0700``).
  Anything else is refused with the reason, and the caller turns the tier off (one warning).
  ``root_problem`` applies the same rule to an existing directory without changing it (before
  a restore or ``orbax-pathways tier`` reads it).
  Once the root passes, nobody but this uid (and root) can create, rename or remove anything
  under it.
- **Nothing under it is followed.** Directories are created one component at a time with mode
  ``0700`` and checked with ``lstat`` (``private_dirs``); listings never follow links
  (``subdirs``); files are opened with ``O_NOFOLLOW``; removal never follows a link
  (``remove_tree`` unlinks a link itself, never what it points to).
- **Files are ``0600``**, created with ``O_EXCL`` or truncated in place, never through a link
  (``write_file``).
- **Only regular files of the recorded size are read** (``open_regular``): a FIFO, a device, a
  socket or a symlink where a chunk should be is refused without blocking (``O_NONBLOCK`` at
  open; a FIFO would otherwise block the open until a writer appears), and so is a file whose
  size is not the one its manifest records. ``read_small`` bounds what a manifest or a marker
  may hold.

Who calls what, on which host: every tier module on the host that owns the tier directory
(``tier/store.py`` writes and lists entries, ``fleet/chain.py`` reads this node's chunks,
``peer/server.py``'s server opens the files it sends, ``tier/gc.py`` and
``orbax-pathways tier`` scan and remove). No jax, no numpy: paths and file descriptors only. Linux and macOS (POSIX
``O_NOFOLLOW``); on a system without it the opens still check the file type after the open.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import stat
from typing import BinaryIO, Iterator

import crc32c as _crc32c

DIR_MODE = 0o700
FILE_MODE = 0o600
_NOFOLLOW = getattr(os, 'O_NOFOLLOW', 0)
_NONBLOCK = getattr(os, 'O_NONBLOCK', 0)
_CLOEXEC = getattr(os, 'O_CLOEXEC', 0)
_DIRECTORY = getattr(os, 'O_DIRECTORY', 0)
MAX_SMALL_BYTES = 64 << 20  # a manifest of a very large item is a few MiB; a marker is empty


class UnsafeError(OSError):
  """A tier path is not what the tier itself would have made: not ours, open to other users,
  a symlink, or not a regular file of the recorded size. The message says which and what to do;
  callers treat it like any damaged or missing copy (the tier is skipped or storage serves)."""


def _describe(st: os.stat_result) -> str:
  kind = ('a symlink' if stat.S_ISLNK(st.st_mode) else 'a directory' if stat.S_ISDIR(st.st_mode)
          else 'a regular file' if stat.S_ISREG(st.st_mode) else 'a FIFO' if stat.S_ISFIFO(st.st_mode)
          else 'a socket' if stat.S_ISSOCK(st.st_mode) else 'a device' if (
              stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)) else 'not a file')
  return f'{kind} owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}'


def describe(st: os.stat_result) -> str:
  """'a symlink owned by uid 1001 with mode 0777': what an ``lstat`` found, for messages."""
  return _describe(st)


def private_root(path: str) -> str:
  """Makes sure ``path`` is a private tier directory of this uid; returns ``''`` when it is,
  else why it cannot be used (the tier must then stay off). Creates it (and missing parents,
  with the default mode: they are the user's choice of place) with mode ``0700``."""
  parent = os.path.dirname(path.rstrip('/')) or '/'
  try:
    if not os.path.isdir(parent):
      os.makedirs(parent, exist_ok=True)
    os.mkdir(path, DIR_MODE)
  except FileExistsError:
    pass
  except OSError as e:
    return f'cannot create {path}: {e}'
  try:
    st = os.lstat(path)
  except OSError as e:
    return f'cannot inspect {path}: {e}'
  why = _not_private(path, st)
  if why:
    return why
  if stat.S_IMODE(st.st_mode) & 0o077:
    try:
      os.chmod(path, DIR_MODE, follow_symlinks=False)
    except (OSError, NotImplementedError) as e:
      return f'{path} is readable by other users and cannot be made private: {e}'
  return ''


def root_problem(path: str) -> str:
  """Why the existing ``path`` must not be read as a tier directory of this uid (``''``: it
  may), without creating or changing anything: the check of a restore, a listing or
  ``orbax-pathways tier``. Same rule as ``private_root`` (a real directory of this uid that
  other users cannot write into); one only readable by others is accepted here (reading it
  cannot be subverted; the next save makes it ``0700``). Missing: says so."""
  try:
    st = os.lstat(path)
  except OSError as e:
    return f'cannot inspect {path}: {e}'
  return _not_private(path, st)


def _not_private(path: str, st: os.stat_result) -> str:
  uid = os.geteuid()
  if not stat.S_ISDIR(st.st_mode):
    return (f'{path} is {_describe(st)}, not a directory of this user (uid {uid}); another user '
            'may have made it to take over this tier. Remove it, or set ORBAX_PATHWAYS_TIER_DIR '
            'to a directory of your own')
  if st.st_uid != uid:
    return (f'{path} is {_describe(st)}, not owned by this user (uid {uid}); another user may '
            'have made it to read or replace this tier\'s checkpoint values. Remove it, or set '
            'ORBAX_PATHWAYS_TIER_DIR to a directory of your own')
  if stat.S_IMODE(st.st_mode) & 0o022:
    return (f'{path} is {_describe(st)}: other users can write into it. chmod 700 it (or remove '
            'it), or set ORBAX_PATHWAYS_TIER_DIR to a directory of your own')
  return ''


def private_dirs(root: str, *parts: str) -> str:
  """``root/parts...``, creating each missing component ``0700``; raises ``UnsafeError`` if one
  that exists is not a real directory of this uid (never goes through a symlink). ``root`` must
  have passed ``private_root``."""
  path = root
  for part in parts:
    if not part or part in ('.', '..') or '/' in part:
      raise UnsafeError(errno.EINVAL, f'not a tier path component: {part!r}')
    path = os.path.join(path, part)
    try:
      os.mkdir(path, DIR_MODE)
    except FileExistsError:
      pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
      raise UnsafeError(errno.ENOTDIR, f'{path} is {_describe(st)}, not a tier directory of '
                        f'this user; refusing to use it')
  return path


def is_dir(path: str) -> bool:
  """A real directory (``lstat``: a symlink to one is not)."""
  try:
    return stat.S_ISDIR(os.lstat(path).st_mode)
  except OSError:
    return False


def exists(path: str) -> bool:
  """Something is at ``path`` itself (``lstat``: a dangling or any symlink counts as there)."""
  try:
    os.lstat(path)
    return True
  except OSError:
    return False


def subdirs(path: str) -> list[str]:
  """Names of the real subdirectories of ``path`` (symlinks and files left out), sorted;
  ``[]`` when ``path`` is not a real directory."""
  if not is_dir(path):
    return []
  try:
    with os.scandir(path) as it:
      return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
  except OSError:
    return []


def names(path: str) -> list[str]:
  """Every name in the real directory ``path`` (of any kind), sorted; ``[]`` when it is not
  one."""
  if not is_dir(path):
    return []
  try:
    return sorted(os.listdir(path))
  except OSError:
    return []


def open_regular(path: str, size: int | None = None) -> BinaryIO:
  """Opens ``path`` for reading only if it is a regular file (not a symlink, FIFO, device or
  socket; ``O_NOFOLLOW`` and ``O_NONBLOCK``, so nothing blocks at open) and, with ``size``, of
  exactly that many bytes. Raises ``UnsafeError`` (what was found), or ``OSError`` as ``open``
  does (a missing file: ``FileNotFoundError``)."""
  try:
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise UnsafeError(errno.ELOOP, f'{path} is a symlink; the tier never follows one') from e
    raise
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      raise UnsafeError(errno.EINVAL, f'{path} is {_describe(st)}, not a regular file')
    if size is not None and st.st_size != size:
      raise UnsafeError(errno.EINVAL, f'{path} holds {st.st_size} bytes; its record says {size}')
    if _NONBLOCK:  # regular files never block; clear it anyway so reads behave as usual
      os.set_blocking(fd, True)
    return io.open(fd, 'rb', buffering=0, closefd=True)
  except BaseException:
    os.close(fd)
    raise


def read_small(path: str, max_bytes: int = MAX_SMALL_BYTES) -> bytes:
  """The bytes of a regular file of at most ``max_bytes`` (a manifest, ``root.txt``);
  ``UnsafeError`` if it is anything else or larger."""
  with open_regular(path) as f:
    n = os.fstat(f.fileno()).st_size
    if n > max_bytes:
      raise UnsafeError(errno.EFBIG, f'{path} holds {n} bytes, more than the {max_bytes} a tier '
                        'metadata file may hold')
    return f.read(max_bytes + 1)[:max_bytes]


def open_new(path: str, *, exclusive: bool = False) -> int:
  """A descriptor of ``path`` opened for writing, mode ``0600``, never through a symlink
  (``O_NOFOLLOW``), a regular file only; ``exclusive`` refuses a file that exists
  (``O_EXCL``), else an existing regular file is truncated. The caller closes it."""
  flags = os.O_WRONLY | os.O_CREAT | _NOFOLLOW | _CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)
  try:
    fd = os.open(path, flags, FILE_MODE)
  except OSError as e:
    if e.errno == errno.ELOOP:
      raise UnsafeError(errno.ELOOP, f'{path} is a symlink; the tier never writes through '
                        'one') from e
    raise
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      raise UnsafeError(errno.EINVAL, f'{path} is {_describe(st)}, not a regular file')
  except BaseException:
    os.close(fd)
    raise
  return fd


def write_file(path: str, data: bytes | memoryview | None = None, *, exclusive: bool = False
               ) -> None:
  """Writes ``data`` (nothing: an empty marker) to ``path`` with mode ``0600``, never through a
  symlink (``open_new``); ``exclusive`` refuses a file that exists, else an existing regular
  file is truncated."""
  fd = open_new(path, exclusive=exclusive)
  try:
    if data is not None:
      view = memoryview(data).cast('B')
      while view:
        n = os.write(fd, view)
        view = view[n:]
  finally:
    os.close(fd)


def replace(src: str, dst: str) -> None:
  """Atomically renames ``src`` over ``dst`` (both inside one private directory; a rename
  replaces a symlink at ``dst`` itself, never what it points to)."""
  os.replace(src, dst)


def remove_tree(path: str) -> None:
  """Removes ``path``: a symlink or file is unlinked itself (never what it points to), a
  directory with everything in it, without following any symlink inside (``shutil.rmtree``'s
  fd-based walk). Missing is fine; other errors are ignored (best effort, like the tier)."""
  try:
    st = os.lstat(path)
  except OSError:
    return
  if not stat.S_ISDIR(st.st_mode):
    try:
      os.unlink(path)
    except OSError:
      pass
    return
  shutil.rmtree(path, ignore_errors=True)


def walk_files(path: str) -> Iterator[tuple[str, os.stat_result]]:
  """(path, lstat) of everything below the real directory ``path`` that is not a directory,
  never descending through a symlink (sizes and mtimes for the node-level clean-up)."""
  for name in names(path):
    p = os.path.join(path, name)
    try:
      st = os.lstat(p)
    except OSError:
      continue
    if stat.S_ISDIR(st.st_mode):
      yield from walk_files(p)
    else:
      yield p, st


def symlink_safe_rmtree() -> bool:
  """Whether this platform's ``shutil.rmtree`` resists symlink attacks (Linux: yes)."""
  return bool(getattr(shutil.rmtree, 'avoids_symlink_attacks', False))


def crc32c_of(path: str, size: int) -> int:
  """The crc32c of the regular file ``path`` of ``size`` bytes (``open_regular``), read in
  pieces of 1 MiB."""
  with open_regular(path, size) as f:
    crc = 0
    while True:
      piece = f.read(1 << 20)
      if not piece:
        return crc
      crc = _crc32c.crc32c(piece, crc)
