"""Node-level clean-up of the tier: entries of checkpoint directories that no save is using.

``store.prune`` keeps a checkpoint directory's newest steps and drops its older ones; it never
looks at other directories. A node that runs many jobs, or one job restarted into fresh
directories (a test loop, a sweep), would keep each old directory's last copy in node memory
(a tmpfs is RAM) until a save no longer fits. This module drops such entries.

Who calls what, on which host: ``after_write`` runs on each writer host once per save, right
after that save's first tier copy landed (``transports/share.write_tier``, on the tier's
background thread: never inside ``save()``, never on the commit path); ``collect`` is also
what ``orbax-pathways tier --gc`` runs by hand. Both list the tier directory once (one
manifest read per entry, a directory listing per incomplete one) and decide with ``plan``
(pure), then delete.

What is dropped, when (``plan``):

- Never an entry touched in the last ``IDLE_S`` seconds (5 minutes): another process of the
  node may be writing or reading it. An entry's time is its directory's mtime, which moves when
  a chunk or its manifest is written, when it is marked committed, and when a restore reads it
  (``store.touch``); for an incomplete entry also its newest file's. A copy in progress writes
  files continuously, and a restore touches what it reads, so 5 minutes idle means unused.
- ``age``: an entry of another checkpoint directory idle for ``max_age_s``
  (``Options.tier_max_age_s``, 24 h: a job that comes back to this node within a day, after a
  preemption or maintenance, still finds its copy).
- ``incomplete``: an idle entry of another directory without a manifest (a save or copy cut
  short, or a damaged manifest): no restore uses it.
- ``gone`` / ``stale``: an idle entry, of any directory (the saving one too), whose step is no
  longer on storage (its checkpoint directory was removed, or ``delete()`` / retention removed
  the step from a process that does not hold the tier), or whose step storage now records
  another save of (``stale``). What a save checks (``gone_locally``): local checkpoint
  directories only, one directory listing each, no storage request; a gs:// directory's
  entries are judged by ``orbax-pathways tier --gc`` (one listing per directory, one index read
  per step), or go by age.
- Node steps (``multitier/node_steps.py``, ``<tier_dir>/.node-steps/``): their bytes count
  against the cap, but the cap never drops one (its manager's retention keeps a job's newest
  ``tier_keep``); one idle for ``max_age_s`` goes (``age``: a job that stopped), and so does
  an idle one Orbax never finalized (``incomplete``: a save cut short).
- ``cap``: while the tier's entries and node steps hold more than ``max_bytes`` bytes
  (``Options.tier_max_bytes``; default half the size of the tier's filesystem: /dev/shm is
  half the RAM by default, so a quarter of it, leaving room for the next copy and the other
  users of /dev/shm), idle entries, oldest first: other directories' entries first, then the
  saving directory's steps older than its newest committed one. Never the entry just written,
  nor the saving directory's newest committed step or the steps after it (saves in flight).

The saving directory's own steps are otherwise ``store.prune``'s (``tier_keep``). A by-hand
run has no saving directory. A failure is logged once per process and tier directory, never
raised into a save. No jax here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import threading
import time
from typing import Callable, Container, Iterable, Mapping, Sequence

from orbax_pathways._util import said
from orbax_pathways.format import names as format_lib
from orbax_pathways.tier import fsafe
from orbax_pathways.tier import manifest as manifest_lib
from orbax_pathways.tier import config as tier_config
from orbax_pathways.tier import store
from orbax_pathways.tier import spares
from orbax_pathways.format import urls

log = logging.getLogger('orbax_pathways')
IDLE_S = 300.0
AGE, INCOMPLETE, CAP, GONE, STALE = 'age', 'incomplete', 'cap', 'gone', 'stale'
REASONS = {GONE: 'its step or checkpoint directory is gone from storage',
           STALE: 'storage holds another save of its step',
           AGE: 'idle longer than the max age',
           INCOMPLETE: 'incomplete (a save or copy cut short) and idle',
           CAP: 'the tier is over its size cap: oldest first'}
# What a judge of entries against storage returns: entry path -> GONE or STALE (the others:
# present, or not known).
Judge = Callable[[Sequence[store.Entry], str], Mapping[str, str]]


@dataclasses.dataclass(frozen=True)
class Seen:
  """One entry as ``plan`` sees it: where, whose (root key), which step (None: a directory
  named by no step number), marked committed, complete (has a manifest), bytes, last touched,
  and what storage says of its step (``GONE``, ``STALE``; '': there, or not known)."""

  path: str
  root_key: str
  step: int | None
  committed: bool
  complete: bool
  nbytes: int
  mtime: float
  storage: str = ''
  node_step: bool = False  # a step of ``multitier/node_steps.py`` (``.node-steps/``), not an entry


@dataclasses.dataclass(frozen=True)
class Drop:
  seen: Seen
  reason: str  # AGE, INCOMPLETE or CAP


def plan(seen: Sequence[Seen], now: float, max_age_s: float, max_bytes: int | None,
         current: str | None = None, keep: Container[str] = (),
         idle_s: float = IDLE_S) -> list[Drop]:
  """Which entries to drop (module docstring): ``current`` is the root key of the directory
  being saved (None: a by-hand run), ``keep`` the paths never to drop (the entry just
  written). Pure."""
  idle = {e.path: now - e.mtime >= idle_s and e.path not in keep for e in seen}
  drops: dict[str, Drop] = {}
  for e in seen:
    if not idle[e.path]:
      continue
    if e.node_step:  # its manager's retention keeps its newest: only a stopped job's go here
      if now - e.mtime > max_age_s:
        drops[e.path] = Drop(e, AGE)
      elif not e.complete:
        drops[e.path] = Drop(e, INCOMPLETE)
      continue
    if e.storage in (GONE, STALE):  # no restore can use it, whichever directory it is of
      drops[e.path] = Drop(e, e.storage)
      continue
    if e.root_key == current:
      continue
    if now - e.mtime > max_age_s:
      drops[e.path] = Drop(e, AGE)
    elif not e.complete:
      drops[e.path] = Drop(e, INCOMPLETE)
  total = sum(e.nbytes for e in seen if e.path not in drops)
  if max_bytes is None or total <= max_bytes:
    return list(drops.values())
  newest = max((e.step for e in seen if e.root_key == current and e.step is not None
                and e.committed and e.complete), default=None)

  def may_go(e: Seen) -> bool:
    if e.path in drops or not idle[e.path] or e.node_step:
      return False
    return e.root_key != current or (newest is not None and e.step is not None and e.step < newest)

  for e in sorted(filter(may_go, seen), key=lambda e: (e.root_key == current, e.mtime, e.path)):
    if total <= max_bytes:
      break
    drops[e.path] = Drop(e, CAP)
    total -= e.nbytes
  return list(drops.values())


def _incomplete_stat(path: str) -> tuple[float, int] | None:
  """(newest mtime of the directory and its files, their bytes), None if it is gone. Never
  follows a symlink (a link counts as its own size)."""
  try:
    mtime, nbytes = os.lstat(path).st_mtime, 0
    for _, st in fsafe.walk_files(path):
      mtime, nbytes = max(mtime, st.st_mtime), nbytes + st.st_size
  except OSError:
    return None
  return mtime, nbytes


def node_steps(tier_dir: str) -> list[Seen]:
  """The node steps under ``tier_dir`` (``<tier_dir>/.node-steps/<digest>/<step>``, Orbax's
  step directories of ``multitier/node_steps.py``) as ``plan`` sees them: root key
  ``.node-steps/<digest>``, complete once Orbax finalized it (a step number for a name, its
  ``_CHECKPOINT_METADATA`` there), its files' bytes and newest mtime."""
  base = os.path.join(tier_dir, format_lib.NODE_STEPS_DIR)
  out = []
  for digest in fsafe.subdirs(base):
    # Partner copies (``fleet/node_copy.py``): ``<digest>.copies/<writer>/<step>``, each
    # writer's steps a root of their own.
    roots = ([f'{digest}/{w}' for w in fsafe.subdirs(os.path.join(base, digest))]
             if digest.endswith('.copies') else [digest])
    for root in roots:
      for name in fsafe.subdirs(os.path.join(base, *root.split('/'))):
        path = os.path.join(base, *root.split('/'), name)
        got = _incomplete_stat(path)
        if got is None:
          continue
        final = name.isdigit() and os.path.lexists(os.path.join(path, '_CHECKPOINT_METADATA'))
        out.append(Seen(path, f'{format_lib.NODE_STEPS_DIR}/{root}',
                        int(name) if name.isdigit() else None, final, final, got[1], got[0],
                        node_step=True))
  return out


def scan(tier_dir: str, judge: Judge | None = None) -> tuple[list[Seen], dict[str, store.Entry]]:
  """Every entry of the tier at ``tier_dir`` as ``plan`` sees it, then the node steps beside
  them (``node_steps``: their bytes count against the cap), and the entries by path; ``judge``
  says which entries are gone from storage or stale (``gone_locally`` at a save)."""
  seen, by_path = [], {}
  for e in store.entries(tier_dir):
    if e.manifest is not None:
      try:
        got: tuple[float, int] | None = (os.lstat(e.path).st_mtime, e.manifest.nbytes)
      except OSError:
        got = None
    else:
      got = _incomplete_stat(e.path)
    if got is None:  # removed since the listing (another process's clean-up)
      continue
    seen.append(Seen(e.path, e.root_key, e.step, e.committed, e.manifest is not None, got[1],
                     got[0]))
    by_path[e.path] = e
  if judge is not None and by_path:
    verdicts = judge(list(by_path.values()), tier_dir)
    seen = [dataclasses.replace(s, storage=verdicts.get(s.path, '')) for s in seen]
  return seen + node_steps(tier_dir), by_path


def entry_root(tier_dir: str, e: store.Entry, roots: dict[str, str | None]) -> str | None:
  """The checkpoint directory of entry ``e`` (its root key's ``root.txt``, else its manifest's
  root), only if it is the one the root key names (else None: not known). ``roots`` caches
  ``root.txt`` per key."""
  if e.root_key not in roots:
    roots[e.root_key] = store.root_of(tier_dir, e.root_key)
  root = roots[e.root_key] or (e.manifest.root if e.manifest else None)
  if root is None or manifest_lib.root_key(root) != e.root_key:
    return None
  return manifest_lib.normalize_root(root)


def step_names(listed: Iterable[str]) -> set[str]:
  """The step directory names a checkpoint directory's listing holds, committed or being
  written (Orbax's temporary names count as their final name: a save in flight is there)."""
  return {format_lib.final_name(n) for n in listed}


def _local_steps(root: str) -> set[str] | None:
  """Step names in the local checkpoint directory ``root`` (empty: it is gone), None when it
  cannot be listed (not known)."""
  try:
    st = os.stat(root)
  except FileNotFoundError:
    return set()
  except OSError:
    return None
  if not stat.S_ISDIR(st.st_mode):
    return set()
  try:
    return step_names(os.listdir(root))
  except OSError:
    return None


def gone_locally(found: Sequence[store.Entry], tier_dir: str) -> dict[str, str]:
  """``GONE`` for each entry whose checkpoint directory is a local path that no longer holds
  its step, or no longer exists (one listing per checkpoint directory, no storage request);
  entries of gs:// (or other remote) directories are not judged here."""
  roots: dict[str, str | None] = {}
  listed: dict[str, set[str] | None] = {}
  out = {}
  for e in found:
    root = entry_root(tier_dir, e, roots)
    if root is None or urls.is_url(root):
      continue
    if root not in listed:
      listed[root] = _local_steps(root)
    names = listed[root]
    if names is not None and e.step_name not in names:
      out[e.path] = GONE
  return out


def default_cap(tier_dir: str) -> int | None:
  """Half the size of the filesystem the tier is on (None if it cannot be read)."""
  try:
    st = os.statvfs(tier_dir)
  except OSError:
    return None
  return st.f_blocks * st.f_frsize // 2


@dataclasses.dataclass(frozen=True)
class Result:
  """One clean-up: the limits it applied, what it saw, what it dropped (or, ``dry_run``,
  would drop), with each entry's ``store.Entry``."""

  tier_dir: str
  max_age_s: float
  max_bytes: int | None
  now: float
  dry_run: bool
  seen: tuple[Seen, ...]
  dropped: tuple[Drop, ...]
  entries: dict[str, store.Entry]

  @property
  def bytes_before(self) -> int:
    return sum(e.nbytes for e in self.seen)

  @property
  def bytes_after(self) -> int:
    return self.bytes_before - sum(d.seen.nbytes for d in self.dropped)


def _remove_empty_root(tier_dir: str, key: str) -> None:
  """A root key directory left with only its ``root.txt``: removed. A save of that directory
  that starts meanwhile writes ``root.txt`` again, or fails its copy (one warning)."""
  kdir = os.path.join(tier_dir, key)
  try:
    if fsafe.is_dir(kdir) and fsafe.names(kdir) == [manifest_lib.ROOT_FILE]:
      os.unlink(os.path.join(kdir, manifest_lib.ROOT_FILE))
      os.rmdir(kdir)
  except OSError:
    pass


def collect(tier_dir: str, *, max_age_s: float, max_bytes: int | None = None,
            current: str | None = None, keep: Container[str] = (), dry_run: bool = False,
            now: float | None = None, judge: Judge | None = gone_locally) -> Result:
  """Lists the tier at ``tier_dir``, drops what ``plan`` says (``max_bytes`` None: half its
  filesystem; ``current``: root key of the directory being saved; ``keep``: paths never
  dropped; ``judge``: which entries storage no longer has, ``gone_locally`` by default); with
  ``dry_run`` only says what it would drop."""
  seen, by_path = scan(tier_dir, judge)
  cap = max_bytes if max_bytes is not None else default_cap(tier_dir)
  now = time.time() if now is None else now
  drops = plan(seen, now, max_age_s, cap, current, keep)
  if not dry_run:
    spares.expire(tier_dir, now)  # a stopped job's spares (``tier/spares.py``)
    for d in drops:
      if d.seen.node_step:
        fsafe.remove_tree(d.seen.path)
      else:
        store.remove(d.seen.path)
    for key in sorted({d.seen.root_key for d in drops} - {current}):
      _remove_empty_root(tier_dir, key)
  return Result(tier_dir, max_age_s, cap, now, dry_run, tuple(seen), tuple(drops), by_path)


_last: dict[str, tuple[str, str]] = {}  # tier directory -> (root key, step) last cleaned for
_lock = threading.Lock()


def after_write(cfg: tier_config.TierConfig, path: str) -> Result | None:
  """After this process wrote entry ``path`` (the tier's background thread): cleans the tier
  up once per save (the first copy of each root and step; later items or device groups of
  the same save skip). Logs what it dropped; never raises (one warning per process)."""
  parts = os.path.relpath(path, cfg.tier_dir).split(os.sep)
  if len(parts) != 4:
    return None
  key, step_name = parts[0], parts[1]
  with _lock:
    if _last.get(cfg.tier_dir) == (key, step_name):
      return None
    _last[cfg.tier_dir] = (key, step_name)
  try:
    result = collect(cfg.tier_dir, max_age_s=cfg.max_age_s, max_bytes=cfg.max_bytes,
                     current=key, keep=(path,))
  except Exception as e:  # pylint: disable=broad-except  # a cache's clean-up: never the save's
    said.once(logging.WARNING, ('tier-gc', cfg.tier_dir),
               'orbax_pathways: node-local tier %s: cleaning up other checkpoint directories\' '
               'entries failed (%s: %s); they stay until a later save or `orbax-pathways tier '
               '--gc` removes them.', cfg.tier_dir, type(e).__name__, e)
    return None
  if result.dropped:
    counts = {r: sum(d.reason == r for d in result.dropped) for r in REASONS}
    log.info('orbax_pathways: node-local tier %s: dropped %d entries (%.1f MiB; %s); %.1f MiB '
             'left', cfg.tier_dir, len(result.dropped),
             sum(d.seen.nbytes for d in result.dropped) / 2**20,
             ', '.join(f'{n} {r}' for r, n in counts.items() if n), result.bytes_after / 2**20)
  return result
