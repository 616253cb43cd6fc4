"""Writes, commits, prunes and lists node-local tier entries (layout in ``tier/manifest.py``).

Who calls what, on which host:

- ``write_entry`` runs on each writer host in the background part of a save, right after that
  host wrote its share to storage (``transports/share.write_share``), from the same host
  buffers: no extra device-to-host copy, never inside ``save()``'s blocking part. It never
  fails the save: a tier that would not fit, or whose directory is read-only or full, is skipped
  with one warning per process and directory.
- ``submit(fn, *args)`` (the in-process transport's ``share.write_share``) queues that copy on the
  tier's one background thread and returns at once: the copy is not on the commit path (a step
  commits when storage has it; the tier is a cache). The next save's background writes first
  wait for copies still queued (``flush``), so at most one save's buffers wait for the tier.
  Interpreter exit waits for queued copies (the preemption save's copy lands before the process
  ends); ``flush(timeout)`` waits for them on demand.
- ``on_commit(root, step)`` runs on every process from the CheckpointManager's ``after_commit``
  hook (``_registration``): marks the entries this process wrote for ``step`` committed, drops
  other saves of that step and steps older than the newest ``tier_keep`` committed ones. A
  front door without that hook (``ocp.v1.save``, a bare ``Checkpointer``) leaves entries
  unmarked; a restore still uses an unmarked entry whose save id the committed index records,
  and each new write drops all but the newest ``tier_keep + 1`` unmarked steps.
- Which directory is the tier and whether this uid may use it is ``tier/config.py``
  (``resolve``, ``default_applies``, ``usable``); ``write_entry`` checks ``usable`` before its
  first write. ``entries`` lists a node's tier (the restore's source chain, ``orbax-pathways
  tier``), never one that fails that check, never through a symlink, and refuses an entry whose
  manifest names a file that is not a regular file; ``touch`` marks an entry a restore reads as
  in use.
- ``prune`` sees only the checkpoint directory being saved; entries of other directories (old
  jobs, a test loop's fresh directories) are dropped by ``tier/gc.py`` (age, size cap, gone
  from storage), which the tier's background thread runs once per save after ``write_entry``.
  A copy that does not fit first drops this directory's older steps (``_make_room``), so a
  tier with room for one copy keeps the newest step instead of the first.
- ``forget_step(step_dir)`` runs where Orbax deletes a step (``retention``'s deletion hook:
  ``mngr.delete`` and ``max_to_keep``, on the process that deletes) and drops the tier copies
  of that step in the tier directories this process uses.

Every file system access goes through ``tier/fsafe.py``: directories ``0700``, files
``0600``, no symlink followed, only regular files read.

No jax: pieces arrive as numpy (or host-resident arrays that ``np.asarray`` reads in place).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import shutil
import stat
import threading
from typing import Any, Iterator, Sequence

import numpy as np

from orbax_pathways._util import priority
from orbax_pathways._util import said
from orbax_pathways.format import names as format_lib
from orbax_pathways import options as options_lib
from orbax_pathways import version
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.storage import cast as cast_lib
from orbax_pathways.tier import config as config_lib
from orbax_pathways.tier import fsafe
from orbax_pathways.tier import manifest as manifest_lib
from orbax_pathways.tier import spares

log = logging.getLogger('orbax_pathways')
# Room left on the tier's filesystem after an entry: a node-local tmpfs is also the node's RAM.
MARGIN_BYTES = 64 << 20


# Entries this process wrote and has not seen committed: (root, step name) -> [(dir, config)].
_pending: dict[tuple[str, str], list[tuple[str, config_lib.TierConfig]]] = {}
# Steps seen committed (root, step), newest last: a copy that lands after its step's commit is
# marked at once (the copy runs in the background, so the commit can come first).
_committed: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
_COMMITTED_REMEMBERED = 64
_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_queued: list[concurrent.futures.Future] = []


def submit(fn: Any, *args: Any) -> None:
  """Runs ``fn(*args)`` on the tier's background thread (one, FIFO: a colocated save's device
  groups land in order) and returns at once. ``fn`` must not raise (``share.write_tier`` logs).
  ThreadPoolExecutor's threads are joined at interpreter exit, so queued copies finish first."""
  global _executor
  with _lock:
    if _executor is None:
      _executor = concurrent.futures.ThreadPoolExecutor(
          max_workers=1, thread_name_prefix='orbax_pathways_tier',
          initializer=priority.lower_this_thread)
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


def _bands(leaf_shape: Sequence[int], chunk_shape: Sequence[int], stored: np.dtype,
           pieces: Sequence[Any]) -> Iterator[tuple[boxes_lib.Box, np.ndarray, list[Any]]]:
  """(band box, its bytes in the stored dtype: C-contiguous, its chunks' boxes) of every band of
  ``pieces`` (``tier/manifest.py``): the chunks of one chunk row of a piece, whose bytes are one
  contiguous run of a C-ordered piece, so a band is written as it lies, with no copy (a piece
  that is a strided view is copied one band at a time). Pure."""
  for piece in pieces:
    data = cast_lib.convert(piece.data, stored, what='a tier chunk')  # as storage holds it
    rows: dict[tuple[int, int], list[Any]] = {}
    for cell in boxes_lib.chunk_grid(piece.box, chunk_shape):
      region = boxes_lib.clip(cell, leaf_shape).intersect(piece.box)
      if region is None or region.size == 0:
        continue
      key = (region.start[0], region.stop[0]) if region.ndim else (0, 0)
      rows.setdefault(key, []).append(region)
    for (r0, r1), chunks in rows.items():
      band = chunks[0] if not piece.box.ndim else boxes_lib.Box(
          (r0,) + tuple(piece.box.start[1:]), (r1,) + tuple(piece.box.stop[1:]))
      yield band, np.ascontiguousarray(data[band.relative_to(piece.box)]), chunks


def write_entry(cfg: config_lib.TierConfig, item_dir: str, writer: str, save_id: str,
                leaves: Sequence[Any], plans: Sequence[Any], pieces: Sequence[Sequence[Any]],
                crcs: dict[str, dict[tuple[int, ...], int]]) -> str | None:
  """Writes this writer's chunks of one item into the tier (the manifest last); returns the
  entry directory, or None when skipped (one warning per process and reason). ``leaves`` are
  ``values.SaveLeaf``s, ``plans`` their write plans, ``pieces`` this host's ``writer.Piece``s,
  ``crcs`` the checksums the storage write computed (name -> origin -> crc32c). A second call
  for the same writer and save (the next device group of a colocated save) adds its arrays.
  The directory must pass the private-root check first (``usable``); nothing is created when
  the copy does not fit."""
  if config_lib.usable(cfg) is None:
    return None
  root, step_name, item_name = manifest_lib.split_item_dir(item_dir)
  key = manifest_lib.root_key(root)
  name = manifest_lib.entry_name(writer, save_id)
  path = os.path.join(cfg.tier_dir, key, step_name, item_name, name)
  total = sum(int(np.asarray(p.data).nbytes) for ps in pieces for p in ps)
  made = False  # only a directory this call made (checked component by component) is removed
  try:
    if not _make_room(cfg, root, step_name, total, item_dir):
      return None
    fsafe.private_dirs(cfg.tier_dir, key, step_name, item_name, name)
    made = True
    root_file = os.path.join(cfg.tier_dir, key, manifest_lib.ROOT_FILE)
    if not fsafe.exists(root_file):
      try:
        fsafe.write_file(root_file, (root + '\n').encode(), exclusive=True)
      except FileExistsError:
        pass  # another process of this node wrote it meanwhile
    spares.note_writer(writer)
    pool = spares.Pool(cfg.tier_dir, writer)  # a dropped step's files, written over
    # A colocated save writes one device group per call: later groups add to the entry.
    arrays = list(_existing(path, save_id))
    first = len(arrays)
    for a, (leaf, plan, ps) in enumerate(zip(leaves, plans, pieces), start=first):
      stored = np.dtype(leaf.stored_dtype)
      origins: list[tuple[int, ...]] = []
      sums: list[int] = []
      sizes: list[int] = []
      files: list[str] = []
      bands: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
      for band, data, chunks in _bands(leaf.shape, plan.chunk_shape, stored, ps):
        fname = manifest_lib.chunk_file(a, len(origins))
        _write_band(pool, os.path.join(path, fname),
                    data.tobytes() if data.ndim == 0 else data.reshape(-1).view(np.uint8).data)
        if len(chunks) > 1 or chunks[0] != band:
          bands.append((fname, tuple(band.start), tuple(band.shape)))
        for chunk in chunks:
          origins.append(tuple(chunk.start))
          sums.append(int(crcs.get(leaf.name, {}).get(tuple(chunk.start), 0)))
          sizes.append(chunk.size * stored.itemsize)
          files.append(fname)
      arrays.append(manifest_lib.TierArray(
          name=leaf.name, dtype=stored.name, shape=tuple(leaf.shape),
          chunk_shape=tuple(plan.chunk_shape), origins=tuple(origins), crc32c=tuple(sums),
          nbytes=tuple(sizes), files=tuple(files), bands=tuple(bands)))
    manifest = manifest_lib.Manifest(root=root, step_name=step_name, item=item_name, writer=writer,
                               save_id=save_id, arrays=tuple(arrays),
                               library_version=version.VERSION)
    tmp = os.path.join(path, manifest_lib.MANIFEST + '.tmp')
    fsafe.write_file(tmp, manifest_lib.encode(manifest))
    fsafe.replace(tmp, os.path.join(path, manifest_lib.MANIFEST))
  except OSError as e:  # fsafe.UnsafeError too: a symlink or another user's directory inside
    if made:
      remove(path)
    config_lib.warn(cfg, type(e).__name__, f'writing {path} failed: {e}')
    return None
  adopt(cfg, path, root, step_name)
  return path


def _write_band(pool: spares.Pool, path: str, data: bytes | memoryview) -> None:
  """One band file of a new entry: over a spare's pages when one of its size is free
  (``tier/spares.py``), else a new file."""
  fd = pool.claim(len(memoryview(data).cast('B')), path)
  if fd is None:
    fsafe.write_file(path, data)
    return
  try:
    spares.write(fd, data)
  finally:
    spares.release(fd)


def adopt(cfg: config_lib.TierConfig, path: str, root: str, step_name: str) -> None:
  """A complete entry this process wrote (``write_entry``) or received (a partner copy:
  ``fleet/receive.py``) is marked committed when its step commits (``on_commit``), at once if it
  already did; then the tier is pruned."""
  parsed = format_lib.parse_step_name(step_name)
  with _lock:
    config_lib.used.add(cfg.tier_dir)
    committed = parsed is not None and (manifest_lib.normalize_root(root), parsed[0]) in _committed
    if not committed:
      _pending.setdefault((root, step_name), []).append((path, cfg))
  if committed:  # its step committed while this copy was being written
    _mark_committed(path, cfg, root)
  prune(cfg, root)


def _free_bytes(tier_dir: str) -> int:
  return shutil.disk_usage(tier_dir).free


def _older(found: Sequence[Entry], step_name: str) -> list[Entry]:
  """The entries of one checkpoint directory that a copy of ``step_name`` replaces: its older
  steps (by number; directories named by no step number: every other one)."""
  parsed = format_lib.parse_step_name(step_name)
  if parsed is None:
    return [e for e in found if e.step_name != step_name]
  return [e for e in found if e.step is not None and e.step < parsed[0]]


def _make_room(cfg: config_lib.TierConfig, root: str, step_name: str, total: int,
               item_dir: str) -> bool:
  """Whether a copy of ``total`` bytes fits (leaving ``MARGIN_BYTES`` free on the default
  tier's filesystem, node memory). When it does not, this directory's older steps are dropped
  first: a newer copy replaces them anyway, and a tier with room for one copy then keeps the
  newest step rather than its first forever. Still no room: one warning naming the bytes, the
  free space and the margin; nothing is created."""
  margin = 0 if cfg.explicit else MARGIN_BYTES
  free = _free_bytes(cfg.tier_dir)
  dropped = 0
  if free < total + margin and spares.drop(cfg.tier_dir):  # spares go first
    free = _free_bytes(cfg.tier_dir)
  if free < total + margin:
    for e in _older(entries(cfg.tier_dir, root), step_name):
      remove(e.path)
      dropped += 1
    if dropped:
      free = _free_bytes(cfg.tier_dir)
  if free >= total + margin:
    if dropped:
      log.info('orbax_pathways: node-local tier %s: dropped %d older entr%s of %s to make room '
               'for step %s', cfg.tier_dir, dropped, 'y' if dropped == 1 else 'ies', root,
               step_name)
    return True
  kept = (f'the default tier leaves a safety margin of {margin} bytes '
          f'({margin / 2**20:.0f} MiB) free on its filesystem, which is node memory' if margin
          else 'an explicit directory leaves no safety margin')
  after = ('after dropping this directory\'s older steps' if dropped
           else 'and this directory has no older step to drop')
  config_lib.warn(cfg, 'full', f'this host\'s share of {item_dir} is {total} bytes; {free} bytes '
                  f'are free {after}; {kept}')
  return False


def _existing(path: str, save_id: str) -> tuple[manifest_lib.TierArray, ...]:
  try:
    m = manifest_lib.decode(fsafe.read_small(os.path.join(path, manifest_lib.MANIFEST)))
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
  manifest: manifest_lib.Manifest | None = None
  error: str = ''

  @property
  def step(self) -> int | None:
    m = format_lib.parse_step_name(self.step_name)
    return m[0] if m else None


def read_entry(path: str) -> Entry:
  """One entry as found (its directory is a real one, listed without following links). Its
  manifest is refused (``error``: damaged) when it is not a regular file, cannot be decoded,
  names a file that is no chunk file of the entry, or names a file that is there but is not a
  regular file (a symlink, a FIFO, a device: what another user planted or a bug made; a
  missing one only costs its chunk a storage read)."""
  parts = path.rstrip('/').split('/')
  key, step_name, item = parts[-4], parts[-3], parts[-2]
  writer, save_id = manifest_lib.parse_entry_name(parts[-1]) or (parts[-1], '')
  committed = _is_regular(os.path.join(path, manifest_lib.COMMITTED))
  try:
    manifest = manifest_lib.decode(fsafe.read_small(os.path.join(path, manifest_lib.MANIFEST)))
  except FileNotFoundError:
    return Entry(path, key, step_name, item, writer, save_id, committed,
                 error='incomplete: no manifest (a save or a copy was cut short)')
  except (OSError, ValueError) as e:
    return Entry(path, key, step_name, item, writer, save_id, committed,
                 error=f'damaged manifest: {e}')
  why = manifest_lib.manifest_problem(manifest) or _files_problem(path, manifest)
  if why:
    return Entry(path, key, step_name, item, writer, save_id, committed,
                 error=f'damaged manifest: {why}')
  return Entry(path, key, step_name, item, writer, save_id, committed, manifest)


def _is_regular(path: str) -> bool:
  try:
    return stat.S_ISREG(os.lstat(path).st_mode)
  except OSError:
    return False


def _files_problem(path: str, m: manifest_lib.Manifest) -> str:
  """The first file ``m`` names that is there but is not a regular file ('' if none): one
  listing of the entry (the file types come with it, no stat per chunk; nothing followed)."""
  try:
    with os.scandir(path) as it:
      odd = {e.name for e in it if not e.is_file(follow_symlinks=False)}
  except OSError as e:
    return f'{path}: {e}'
  if not odd:
    return ''
  for a in m.arrays:
    for name in a.files:
      if name in odd:
        p = os.path.join(path, name)
        try:
          found = fsafe.describe(os.lstat(p))
        except OSError as e:
          found = f'unreadable ({e})'
        return f'{p} is {found}, not a regular file; the tier never follows or reads one'
  return ''


def entries(tier_dir: str, root: str | None = None, step_name: str | None = None,
            item: str | None = None) -> list[Entry]:
  """Every entry under ``tier_dir``, narrowed to one checkpoint directory / step / item.
  Nothing when the directory fails the private-root check (one warning): a tier another user
  made is never read. Only real directories are descended into."""
  if not config_lib.readable(tier_dir):
    return []
  out = []
  keys = ([manifest_lib.root_key(root)] if root is not None else
          [k for k in fsafe.subdirs(tier_dir) if not k.startswith('.')])  # node steps' own
  for key in keys:
    kdir = os.path.join(tier_dir, key)
    for s in ([step_name] if step_name is not None else fsafe.subdirs(kdir)):
      sdir = os.path.join(kdir, s)
      for i in ([item] if item is not None else fsafe.subdirs(sdir)):
        idir = os.path.join(sdir, i)
        for e in fsafe.subdirs(idir):
          out.append(read_entry(os.path.join(idir, e)))
  return out


def root_of(tier_dir: str, key: str) -> str | None:
  """The checkpoint directory a root key stands for (from its ``root.txt``)."""
  try:
    text = fsafe.read_small(os.path.join(tier_dir, key, manifest_lib.ROOT_FILE), 1 << 16)
  except OSError:
    return None
  return text.decode('utf-8', 'replace').strip() or None


def touch(path: str) -> None:
  """Marks an entry used now (its directory's mtime): a restore reading it, so node-level
  clean-up (``tier/gc.py``) counts it as busy. Best effort."""
  try:
    os.utime(path, follow_symlinks=False)
  except (OSError, NotImplementedError):
    pass


def remove(path: str) -> None:
  """Deletes one entry (never following a symlink in it), then its item and step directories
  once empty."""
  fsafe.remove_tree(path)
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
  root = manifest_lib.normalize_root(root)
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


def _mark_committed(path: str, cfg: config_lib.TierConfig, root: str) -> None:
  """Marks one complete entry committed, drops this writer's other saves of the step, prunes."""
  if not _is_regular(os.path.join(path, manifest_lib.MANIFEST)):
    return
  try:
    fsafe.write_file(os.path.join(path, manifest_lib.COMMITTED))
  except OSError as e:
    config_lib.warn(cfg, 'commit', f'marking {path} committed failed: {e}')
    return
  here = os.path.basename(path)
  writer = (manifest_lib.parse_entry_name(here) or (here, ''))[0]
  for sibling in fsafe.subdirs(os.path.dirname(path)):  # other saves of this step by this writer
    other = manifest_lib.parse_entry_name(sibling)
    if sibling != here and other is not None and other[0] == writer:
      remove(os.path.join(os.path.dirname(path), sibling))
  prune(cfg, root)


def _mtime(path: str) -> float:
  """When an entry was written: its manifest's mtime (a restore's ``touch`` moves the
  directory's, not this; 0 for an incomplete entry)."""
  try:
    return os.lstat(os.path.join(path, manifest_lib.MANIFEST)).st_mtime
  except OSError:
    return 0.0


def _committed_step(step_dir: str) -> bool:
  """Whether any entry of one step directory is marked committed (stops at the first one: no
  manifest is read, one ``lstat`` per entry looked at)."""
  for item in fsafe.subdirs(step_dir):
    idir = os.path.join(step_dir, item)
    for e in fsafe.subdirs(idir):
      if _is_regular(os.path.join(idir, e, manifest_lib.COMMITTED)):
        return True
  return False


def _newest_mtime(step_dir: str) -> float:
  return max((_mtime(os.path.join(step_dir, i, e)) for i in fsafe.subdirs(step_dir)
              for e in fsafe.subdirs(os.path.join(step_dir, i))), default=0.0)


def prune(cfg: config_lib.TierConfig, root: str) -> None:
  """Drops the steps of ``root`` older than what ``manifest_lib.keep_steps`` keeps. Directories
  whose name is no step number (``ocp.v1.save(path)`` saves into any directory) are kept by
  age: the newest ``keep + 1`` of them.

  Cheap, because it runs after every entry written or marked committed (a colocated save
  writes one entry per worker of the node): it reads no manifest, only the step directories'
  names and, newest first, the commit markers of the steps it must tell apart; once the
  newest ``keep`` committed steps are found, every older step is dropped unlooked-at."""
  if not config_lib.readable(cfg.tier_dir):
    return
  kdir = os.path.join(cfg.tier_dir, manifest_lib.root_key(root))
  numbered: list[tuple[int, str]] = []
  named: list[str] = []
  for name in fsafe.subdirs(kdir):
    parsed = format_lib.parse_step_name(name)
    if parsed is None:
      named.append(name)
    else:
      numbered.append((parsed[0], name))
  seen: list[tuple[int, bool]] = []
  found = 0
  for step, name in sorted(numbered, reverse=True):
    committed = found < cfg.keep and _committed_step(os.path.join(kdir, name))
    found += committed
    seen.append((step, committed))
  kept = manifest_lib.keep_steps(seen, cfg.keep)
  by_age = sorted(named, key=lambda n: -_newest_mtime(os.path.join(kdir, n)))
  for step, name in numbered:
    if step not in kept:
      remove_step(os.path.join(kdir, name), retire=True)
  for name in by_age[cfg.keep + 1:]:
    remove_step(os.path.join(kdir, name))


def remove_step(step_dir: str, retire: bool = False) -> None:
  """Deletes one step directory of a checkpoint directory's tier entries (never following a
  symlink in it); ``retire``: a newer step replaced it, so its big files may first become
  spares for the next save (``tier/spares.py``)."""
  if retire:
    tier_dir = os.path.dirname(os.path.dirname(step_dir))
    for item in fsafe.subdirs(step_dir):
      for e in fsafe.subdirs(os.path.join(step_dir, item)):
        spares.retire(tier_dir, os.path.join(step_dir, item, e))
  fsafe.remove_tree(step_dir)


def forget_step(step_dir: Any) -> None:
  """Orbax deleted the step directory ``step_dir`` (``mngr.delete``, ``max_to_keep``: the
  deletion hook in ``retention``, on the process that deletes, the primary host): drops every
  tier copy of that step in the tier directories this process saved into or read, and in the
  node's own (``ORBAX_PATHWAYS_TIER_DIR``, else the /dev/shm default) if it exists. Other
  processes' nodes drop theirs when a newer step commits (``prune``) or, for a local checkpoint
  directory, at the next save's clean-up (``tier/gc.py``: the step is gone). Never raises."""
  try:
    text = os.fspath(step_dir).rstrip('/')
    parent, _, name = text.rpartition('/')
    root, step_name = manifest_lib.normalize_root(parent or '.'), format_lib.final_name(name)
    with _lock:
      dirs = set(config_lib.used)
      _pending.pop((root, step_name), None)
    node = config_lib.resolve(options_lib.env_raw(config_lib.ENV) or None)
    if node is not None and fsafe.is_dir(node.tier_dir):
      dirs.add(node.tier_dir)
    removed = 0
    for tier_dir in sorted(dirs):
      for e in entries(tier_dir, root, step_name):
        spares.retire(tier_dir, e.path)  # a newer step replaced it: maybe a spare
        remove(e.path)
        removed += 1
    if removed:
      log.info('orbax_pathways: node-local tier: dropped %d entr%s of deleted step %s of %s',
               removed, 'y' if removed == 1 else 'ies', step_name, root)
  except Exception as e:  # pylint: disable=broad-except  # a cache: never fail a deletion
    said.once(logging.WARNING, ('tier-forget', type(e).__name__),
               'orbax_pathways: dropping the node-local tier copy of deleted %s failed (%s: %s); '
               'the next clean-up (or `orbax-pathways tier --gc`) removes it.', step_dir,
               type(e).__name__, e)
