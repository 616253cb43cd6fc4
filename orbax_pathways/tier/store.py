"""Writes, commits, prunes and lists node-local tier entries (layout in ``tier/layout.py``).

Who calls what, on which host:

- ``write_entry`` runs on each writer host in the background part of a save, right after that
  host wrote its share to storage (``transports/share.write_share``), from the same host
  buffers: no extra device-to-host copy, never inside ``save()``'s blocking part. It never
  fails the save: a tier that would not fit, or whose directory is read-only or full, is skipped
  with one warning per process and directory.
- ``submit(fn, *args)`` (the local transport's ``share.write_share``) queues that copy on the
  tier's one background thread and returns at once: the copy is not on the commit path (a step
  commits when storage has it; the tier is a cache). The next save's background writes first
  wait for copies still queued (``flush``), so at most one save's buffers wait for the tier.
  Interpreter exit waits for queued copies (the preemption save's copy lands before the process
  ends); ``flush(timeout)`` waits for them on demand.
- ``on_commit(root, step)`` runs on every process from the CheckpointManager's ``after_commit``
  hook (``_registration``): marks the entries this process wrote for ``step`` committed, drops
  other saves of that step and steps older than the newest ``local_keep`` committed ones. A
  front door without that hook (``ocp.v1.save``, a bare ``Checkpointer``) leaves entries
  unmarked; a restore still uses an unmarked entry whose save id the committed index records,
  and each new write drops all but the newest ``local_keep + 1`` unmarked steps.
- ``resolve`` turns ``Options.local_dir`` into a directory (or None: off); ``entries`` lists a
  node's tier (the restore's source chain, ``orbax-pathways tier``); ``touch`` marks an entry a
  restore reads as in use.
- ``prune`` sees only the checkpoint directory being saved; entries of other directories (old
  jobs, a test loop's fresh directories) are dropped by ``tier/gc.py`` (age, size cap), which
  the tier's background thread runs once per save after ``write_entry``.

No jax: pieces arrive as numpy (or host-resident arrays that ``np.asarray`` reads in place).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import os
import shutil
import threading
from typing import Any, Iterator, Sequence

import numpy as np

from orbax_pathways import _said
from orbax_pathways import format as format_lib
from orbax_pathways import options
from orbax_pathways import version
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.storage import cast as cast_lib
from orbax_pathways.tier import layout

log = logging.getLogger('orbax_pathways')
OFF = 'off'
ENV = 'ORBAX_PATHWAYS_LOCAL_DIR'  # also the default of Options.local_dir=None (engine.tier)
# Room left on the tier's filesystem after an entry: a node-local tmpfs is also the node's RAM.
MARGIN_BYTES = 64 << 20
MAX_AGE_S = options.LOCAL_MAX_AGE_S  # Options.local_max_age_s's default (24 h)


@dataclasses.dataclass(frozen=True)
class TierConfig:
  """A resolved tier: its directory, how many committed steps it keeps, whether the user chose
  the directory (``explicit``) or it is the /dev/shm default, and the node-level clean-up of
  other checkpoint directories' entries (``tier/gc.py``): their longest idle time, and the
  tier's size cap (None: half its filesystem)."""

  local_dir: str
  keep: int = 1
  explicit: bool = True
  max_age_s: float = MAX_AGE_S
  max_bytes: int | None = None


def _is_tmpfs(path: str) -> bool:
  try:
    with open('/proc/mounts', encoding='utf-8') as f:
      mounts = [line.split() for line in f]
  except OSError:
    return False
  best, fstype = '', ''
  real = os.path.realpath(path)
  for parts in mounts:
    if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip('/') + '/')):
      if len(parts[1]) >= len(best):
        best, fstype = parts[1], parts[2]
  return fstype == 'tmpfs'


def default_dir() -> str | None:
  """``/dev/shm/orbax-pathways-<uid>`` when /dev/shm is a tmpfs, else None (no tier)."""
  if not os.path.isdir(layout.DEFAULT_SHM) or not _is_tmpfs(layout.DEFAULT_SHM):
    return None
  return os.path.join(layout.DEFAULT_SHM, f'orbax-pathways-{os.getuid()}')


@functools.lru_cache(maxsize=64)
def resolve(local_dir: str | None, keep: int = 1, max_age_s: float = MAX_AGE_S,
            max_bytes: int | None = None) -> TierConfig | None:
  """``Options.local_dir`` as a ``TierConfig``: None picks the /dev/shm default (None when
  /dev/shm is not a tmpfs), ``'off'`` turns the tier off."""
  if local_dir is not None and local_dir.strip().lower() == OFF:
    return None
  if local_dir is None or not local_dir.strip():
    d = default_dir()
    return TierConfig(d, keep, False, max_age_s, max_bytes) if d else None
  return TierConfig(os.path.abspath(os.path.expanduser(local_dir.strip())), keep, True,
                    max_age_s, max_bytes)


def _warn(cfg: TierConfig, reason: str, detail: str) -> None:
  _said.once(logging.WARNING, ('tier', cfg.local_dir, reason),
             'orbax_pathways: node-local tier skipped (%s): %s. Saves go on to storage as '
             'before; restores read storage. Free space there, point ORBAX_PATHWAYS_LOCAL_DIR '
             '(Options.local_dir) elsewhere, or set it to "off" to silence this.',
             cfg.local_dir, detail)


# Entries this process wrote and has not seen committed: (root, step name) -> [(dir, config)].
_pending: dict[tuple[str, str], list[tuple[str, TierConfig]]] = {}
# Steps seen committed (root, step), newest last: a copy that lands after its step's commit is
# marked at once (the copy runs in the background, so the commit can come first).
_committed: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
_COMMITTED_REMEMBERED = 64
_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_queued: list[concurrent.futures.Future] = []


TIER_THREAD_NICE = 10  # the copy yields the cores to training, restores and storage writes


def _lower_priority() -> None:
  """On the tier's thread: a lower CPU priority for this thread only (Linux: a thread's nice
  value is its own), so a copy into node memory never competes on equal terms with the work
  that needs the cores now. Best effort: elsewhere it runs at normal priority."""
  try:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TIER_THREAD_NICE)
  except (AttributeError, OSError):
    pass


def submit(fn: Any, *args: Any) -> None:
  """Runs ``fn(*args)`` on the tier's background thread (one, FIFO: a colocated save's device
  groups land in order) and returns at once. ``fn`` must not raise (``share.write_tier`` logs).
  ThreadPoolExecutor's threads are joined at interpreter exit, so queued copies finish first."""
  global _executor
  with _lock:
    if _executor is None:
      _executor = concurrent.futures.ThreadPoolExecutor(
          max_workers=1, thread_name_prefix='orbax_pathways_tier', initializer=_lower_priority)
    _queued[:] = [f for f in _queued if not f.done()]
    _queued.append(_executor.submit(fn, *args))


def flush(timeout: float | None = None) -> bool:
  """Waits for the tier copies queued so far (all of them, or until ``timeout`` seconds);
  True when none is left. Called before a save's background writes (bounds what waits for the
  tier to one save's buffers) and by tests and tools that read the tier right after a save."""
  with _lock:
    queued = list(_queued)
  done, not_done = concurrent.futures.wait(queued, timeout=timeout)
  del done
  return not not_done


def _chunks(leaf_shape: Sequence[int], chunk_shape: Sequence[int], stored: np.dtype,
            pieces: Sequence[Any]) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
  """(origin, bytes in the stored dtype) of every chunk of ``pieces``, in the writer's
  checksum order (``storage/writer.chunk_records``)."""
  for piece in pieces:
    data = cast_lib.convert(piece.data, stored, what='a tier chunk')  # as storage holds it
    for cell in boxes_lib.chunk_grid(piece.box, chunk_shape):
      region = boxes_lib.clip(cell, leaf_shape).intersect(piece.box)
      if region is None or region.size == 0:
        continue
      yield region.start, data[region.relative_to(piece.box)]


def write_entry(cfg: TierConfig, item_dir: str, writer: str, save_id: str,
                leaves: Sequence[Any], plans: Sequence[Any], pieces: Sequence[Sequence[Any]],
                crcs: dict[str, dict[tuple[int, ...], int]]) -> str | None:
  """Writes this writer's chunks of one item into the tier (the manifest last); returns the
  entry directory, or None when skipped (one warning per process and reason). ``leaves`` are
  ``values.SaveLeaf``s, ``plans`` their write plans, ``pieces`` this host's ``writer.Piece``s,
  ``crcs`` the checksums the storage write computed (name -> origin -> crc32c). A second call
  for the same writer and save (the next device group of a colocated save) adds its arrays."""
  root, step_name, item_name = layout.split_item_dir(item_dir)
  path = layout.entry_dir(cfg.local_dir, root, step_name, item_name, writer, save_id)
  total = sum(int(np.asarray(p.data).nbytes) for ps in pieces for p in ps)
  try:
    os.makedirs(path, exist_ok=True)
    free = shutil.disk_usage(path).free
    if free < total + (0 if cfg.explicit else MARGIN_BYTES):
      shutil.rmtree(path, ignore_errors=True)
      _warn(cfg, 'full', f'this host\'s share of {item_dir} is {total} bytes, '
                         f'{free} bytes are free')
      return None
    root_file = os.path.join(cfg.local_dir, layout.root_key(root), layout.ROOT_FILE)
    if not os.path.exists(root_file):
      with open(root_file, 'w', encoding='utf-8') as f:
        f.write(root + '\n')
    # A colocated save writes one device group per call: later groups add to the entry.
    arrays = list(_existing(path, save_id))
    first = len(arrays)
    for a, (leaf, plan, ps) in enumerate(zip(leaves, plans, pieces), start=first):
      stored = np.dtype(leaf.stored_dtype)
      origins, sums, sizes, files = [], [], [], []
      for c, (origin, chunk) in enumerate(_chunks(leaf.shape, plan.chunk_shape, stored, ps)):
        name = layout.chunk_file(a, c)
        with open(os.path.join(path, name), 'wb') as f:
          f.write(np.ascontiguousarray(chunk).tobytes() if chunk.ndim == 0 else
                  np.ascontiguousarray(chunk).reshape(-1).view(np.uint8).data)
        origins.append(tuple(origin))
        sums.append(int(crcs.get(leaf.name, {}).get(tuple(origin), 0)))
        sizes.append(int(chunk.nbytes))
        files.append(name)
      arrays.append(layout.TierArray(
          name=leaf.name, dtype=stored.name, shape=tuple(leaf.shape),
          chunk_shape=tuple(plan.chunk_shape), origins=tuple(origins), crc32c=tuple(sums),
          nbytes=tuple(sizes), files=tuple(files)))
    manifest = layout.Manifest(root=root, step_name=step_name, item=item_name, writer=writer,
                               save_id=save_id, arrays=tuple(arrays),
                               library_version=version.VERSION)
    tmp = os.path.join(path, layout.MANIFEST + '.tmp')
    with open(tmp, 'wb') as f:
      f.write(layout.encode(manifest))
    os.replace(tmp, os.path.join(path, layout.MANIFEST))
  except OSError as e:
    shutil.rmtree(path, ignore_errors=True)
    _warn(cfg, type(e).__name__, f'writing {path} failed: {e}')
    return None
  parsed = format_lib.parse_step_name(step_name)
  with _lock:
    committed = parsed is not None and (layout.normalize_root(root), parsed[0]) in _committed
    if not committed:
      _pending.setdefault((root, step_name), []).append((path, cfg))
  if committed:  # its step committed while this copy was being written
    _mark_committed(path, cfg, root)
  prune(cfg, root)
  return path


def _existing(path: str, save_id: str) -> tuple[layout.TierArray, ...]:
  try:
    with open(os.path.join(path, layout.MANIFEST), 'rb') as f:
      m = layout.decode(f.read())
  except (OSError, ValueError):
    return ()
  return m.arrays if m.save_id == save_id else ()


@dataclasses.dataclass(frozen=True)
class Entry:
  """One entry found on a node: its directory, manifest (None: incomplete or damaged, with
  ``error``), whether it is marked committed, and where it sits."""

  path: str
  root_key: str
  step_name: str
  item: str
  writer: str
  save_id: str
  committed: bool
  manifest: layout.Manifest | None = None
  error: str = ''

  @property
  def step(self) -> int | None:
    m = format_lib.parse_step_name(self.step_name)
    return m[0] if m else None


def _listdir(path: str) -> list[str]:
  try:
    return sorted(os.listdir(path))
  except OSError:
    return []


def read_entry(path: str) -> Entry:
  parts = path.rstrip('/').split('/')
  key, step_name, item = parts[-4], parts[-3], parts[-2]
  writer, save_id = layout.parse_entry_name(parts[-1]) or (parts[-1], '')
  committed = os.path.exists(os.path.join(path, layout.COMMITTED))
  try:
    with open(os.path.join(path, layout.MANIFEST), 'rb') as f:
      manifest = layout.decode(f.read())
  except FileNotFoundError:
    return Entry(path, key, step_name, item, writer, save_id, committed,
                 error='incomplete: no manifest (a save or a copy was cut short)')
  except (OSError, ValueError) as e:
    return Entry(path, key, step_name, item, writer, save_id, committed,
                 error=f'damaged manifest: {e}')
  return Entry(path, key, step_name, item, writer, save_id, committed, manifest)


def entries(local_dir: str, root: str | None = None, step_name: str | None = None,
            item: str | None = None) -> list[Entry]:
  """Every entry under ``local_dir``, narrowed to one checkpoint directory / step / item."""
  out = []
  keys = [layout.root_key(root)] if root is not None else _listdir(local_dir)
  for key in keys:
    kdir = os.path.join(local_dir, key)
    if not os.path.isdir(kdir):
      continue
    for s in ([step_name] if step_name is not None else _listdir(kdir)):
      sdir = os.path.join(kdir, s)
      if not os.path.isdir(sdir):
        continue
      for i in ([item] if item is not None else _listdir(sdir)):
        idir = os.path.join(sdir, i)
        for e in _listdir(idir):
          if os.path.isdir(os.path.join(idir, e)):
            out.append(read_entry(os.path.join(idir, e)))
  return out


def root_of(local_dir: str, key: str) -> str | None:
  """The checkpoint directory a root key stands for (from its ``root.txt``)."""
  try:
    with open(os.path.join(local_dir, key, layout.ROOT_FILE), encoding='utf-8') as f:
      return f.read().strip() or None
  except OSError:
    return None


def touch(path: str) -> None:
  """Marks an entry used now (its directory's mtime): a restore reading it, so node-level
  clean-up (``tier/gc.py``) counts it as busy. Best effort."""
  try:
    os.utime(path)
  except OSError:
    pass


def remove(path: str) -> None:
  """Deletes one entry, then its item and step directories once empty."""
  shutil.rmtree(path, ignore_errors=True)
  parent = os.path.dirname(path)
  for _ in range(2):  # the item, then the step directory, once empty
    try:
      os.rmdir(parent)
    except OSError:
      break
    parent = os.path.dirname(parent)


def on_commit(root: Any, step: int) -> None:
  """After ``step`` of ``root`` committed (every process, the manager's after_commit hook):
  marks this process's entries of it committed, then drops what they replace. A copy still
  being written is marked when it lands (``write_entry``)."""
  root = layout.normalize_root(root)
  with _lock:
    _committed[(root, step)] = None
    while len(_committed) > _COMMITTED_REMEMBERED:
      _committed.popitem(last=False)
    mine = [(name, v) for (r, name), v in _pending.items()
            if r == root and (format_lib.parse_step_name(name) or (None,))[0] == step]
    for name, _ in mine:
      _pending.pop((root, name), None)
  for _, written in mine:
    for path, cfg in written:
      _mark_committed(path, cfg, root)


def _mark_committed(path: str, cfg: TierConfig, root: str) -> None:
  """Marks one complete entry committed, drops this writer's other saves of the step, prunes."""
  if not os.path.exists(os.path.join(path, layout.MANIFEST)):
    return
  try:
    open(os.path.join(path, layout.COMMITTED), 'wb').close()
  except OSError as e:
    _warn(cfg, 'commit', f'marking {path} committed failed: {e}')
    return
  here = os.path.basename(path)
  writer = (layout.parse_entry_name(here) or (here, ''))[0]
  for sibling in _listdir(os.path.dirname(path)):  # other saves of this step by this writer
    other = layout.parse_entry_name(sibling)
    if sibling != here and other is not None and other[0] == writer:
      remove(os.path.join(os.path.dirname(path), sibling))
  prune(cfg, root)


def _mtime(path: str) -> float:
  """When an entry was written: its manifest's mtime (a restore's ``touch`` moves the
  directory's, not this; 0 for an incomplete entry)."""
  try:
    return os.stat(os.path.join(path, layout.MANIFEST)).st_mtime
  except OSError:
    return 0.0


def prune(cfg: TierConfig, root: str) -> None:
  """Drops the entries of ``root`` older than what ``layout.keep_steps`` keeps. Directories
  whose name is no step number (``ocp.v1.save(path)`` saves into any directory) are kept by
  age: the newest ``keep + 1`` of them."""
  found = entries(cfg.local_dir, root)
  kept = layout.keep_steps([(e.step, e.committed) for e in found if e.step is not None], cfg.keep)
  named = sorted({e.step_name for e in found if e.step is None},
                 key=lambda n: -max(_mtime(e.path) for e in found if e.step_name == n))
  for e in found:
    if (e.step is not None and e.step not in kept) or (
        e.step is None and e.step_name not in named[:cfg.keep + 1]):
      remove(e.path)
