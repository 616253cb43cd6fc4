"""Which directory is this node's tier, whether it is worth having, and whether this uid may use
it: ``Options.tier_dir`` resolved, the /dev/shm default's rule, and the private-root check.

Who calls what, on which host:

- ``resolve`` turns ``Options.tier_dir`` into a ``TierConfig`` (or None: off), and
  ``default_applies`` says whether the /dev/shm default is worth it for a save or restore
  (``engine.tier``, on the saving or restoring process; ``storage_is_remote`` for its first
  argument).
- ``usable`` checks, before the first write (``tier/store.write_entry`` on every writer host,
  ``engine.tier``), that the directory is this uid's and private (``tier/fsafe.private_root``;
  once per process and directory, again if it was made anew, chown'ed or chmod'ed), else turns
  the tier off with one warning (``warn``); ``readable`` is the same check before a listing
  (``tier/store.entries``), which never reads a directory that fails it.
- ``used`` holds the tier directories this process saved into or read (``store.forget_step``
  drops a deleted step's copies there).

No jax, no numpy: paths, ``os.lstat`` and ``/proc/mounts``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading

from orbax_pathways._util import said
from orbax_pathways import options
from orbax_pathways.tier import fsafe
from orbax_pathways.tier import manifest as manifest_lib
from orbax_pathways.format import urls

_lock = threading.Lock()
OFF = 'off'
ENV = 'ORBAX_PATHWAYS_TIER_DIR'  # also the default of Options.tier_dir=None (engine.tier)
MAX_AGE_S = options.TIER_MAX_AGE_S  # Options.tier_max_age_s's default (24 h)


@dataclasses.dataclass(frozen=True)
class TierConfig:
  """A resolved tier: its directory, how many committed steps it keeps, whether the user chose
  the directory (``explicit``) or it is the /dev/shm default, and the node-level clean-up of
  other checkpoint directories' entries (``tier/gc.py``): their longest idle time, and the
  tier's size cap (None: half its filesystem)."""

  tier_dir: str
  keep: int = 1
  explicit: bool = True
  max_age_s: float = MAX_AGE_S
  max_bytes: int | None = None


def _fs_type(path: str) -> str:
  """The type of the filesystem ``path`` is on (its longest mount point in /proc/mounts; ''
  when unknown). ``path`` need not exist yet."""
  try:
    with open('/proc/mounts', encoding='utf-8') as f:
      mounts = [line.split() for line in f]
  except OSError:
    return ''
  best, fstype = '', ''
  real = os.path.realpath(path)
  for parts in mounts:
    if len(parts) < 3:
      continue
    point = parts[1].replace('\\040', ' ')
    if (real == point or real.startswith(point.rstrip('/') + '/')) and len(point) >= len(best):
      best, fstype = point, parts[2]
  return fstype


def _is_tmpfs(path: str) -> bool:
  return _fs_type(path) == 'tmpfs'


def default_dir() -> str | None:
  """``/dev/shm/orbax-pathways-<uid>`` when /dev/shm is a tmpfs, else None (no tier)."""
  if not os.path.isdir(manifest_lib.DEFAULT_SHM) or not _is_tmpfs(manifest_lib.DEFAULT_SHM):
    return None
  return os.path.join(manifest_lib.DEFAULT_SHM, f'orbax-pathways-{os.getuid()}')


# Filesystems whose reads cross the network: a checkpoint directory there is storage a restart
# pays for, as gs:// is (a local path on them is no page-cache read).
NETWORK_FS = ('nfs', 'nfs4', 'cifs', 'smb3', 'smbfs', 'ceph', 'glusterfs', 'lustre', 'gpfs',
              'beegfs', 'afs', 'fuse.gcsfuse', 'fuse.s3fs', 'fuse.sshfs', 'fuse.rclone',
              'fuse.juicefs', 'fuse.ceph-fuse', 'fuse.glusterfs')


@functools.lru_cache(maxsize=64)
def storage_is_remote(root: str) -> bool:
  """Whether a checkpoint directory is storage a restart pays for: a URL (``gs://``, any
  scheme but ``file://``) or a local path on a network filesystem (``NETWORK_FS``)."""
  if urls.is_url(root):
    return urls.is_remote(root)
  return _fs_type(root) in NETWORK_FS


def default_applies(remote_storage: bool, processes: int, workers: bool) -> bool:
  """Whether the /dev/shm default tier (``Options.tier_dir`` unset) is kept for a save or
  restore (pure; ``engine.tier`` asks): only where it saves a storage read on a restart. A
  checkpoint directory on this machine's own disk, written by one process, is read back from
  the page cache (or a local disk at its own speed): a copy in node memory buys nothing there
  and costs RAM for a day (a notebook's, a test run's throwaway checkpoints). It does buy a
  read for ``remote_storage`` (gs://, NFS), for jobs of several processes (a restarted process
  reads its share from its own node's memory and the survivors' tiers, not from storage: the
  job's directory is shared storage), and for Pathways workers (``workers``: the colocated
  transport's worker hosts). An explicit ``tier_dir`` is always used."""
  return remote_storage or processes > 1 or workers


def named_dir(tier_dir: str | None) -> str | None:
  """The tier directory a process's options name: ``Options.tier_dir``, else
  ``ORBAX_PATHWAYS_TIER_DIR`` as the node has it set (where a node keeps its RAM disk is the
  node's setting, so it holds for ``Options(...)`` built in code too); None: the default.
  What ``resolve`` takes, for ``engine.Engine.tier`` and ``multitier/node_steps.py``."""
  return tier_dir if tier_dir is not None else (options.env_raw(ENV) or None)


@functools.lru_cache(maxsize=64)
def resolve(tier_dir: str | None, keep: int = 1, max_age_s: float = MAX_AGE_S,
            max_bytes: int | None = None) -> TierConfig | None:
  """``Options.tier_dir`` as a ``TierConfig``: None picks the /dev/shm default (None when
  /dev/shm is not a tmpfs), ``'off'`` turns the tier off."""
  if tier_dir is not None and tier_dir.strip().lower() == OFF:
    return None
  if tier_dir is None or not tier_dir.strip():
    d = default_dir()
    return TierConfig(d, keep, False, max_age_s, max_bytes) if d else None
  return TierConfig(os.path.abspath(os.path.expanduser(tier_dir.strip())), keep, True,
                    max_age_s, max_bytes)


ADVICE = ('Free space there, point ORBAX_PATHWAYS_TIER_DIR (Options.tier_dir) elsewhere, or '
           'set it to "off" to silence this.')


def warn(cfg: TierConfig, reason: str, detail: str, advice: str = ADVICE) -> None:
  said.once(logging.WARNING, ('tier', cfg.tier_dir, reason),
             'orbax_pathways: node-local tier skipped (%s): %s. Saves go on to storage as '
             'before; restores read storage. %s', cfg.tier_dir, detail, advice)


# Tier directories that passed the private-root check in this process: path -> the lstat
# fields that passed (device, inode, owner, mode). One lstat per use then; a directory removed
# and made again (by anyone), chown'ed or chmod'ed is checked again.
_roots: dict[str, tuple[int, int, int, int]] = {}
used: set[str] = set()  # tier directories this process saved into or read (store.forget_step)


def _root_key_of(st: os.stat_result) -> tuple[int, int, int, int]:
  return st.st_dev, st.st_ino, st.st_uid, st.st_mode


def root_problem(tier_dir: str, *, create: bool) -> str:
  """Why ``tier_dir`` must not be used as this uid's tier ('' when it may): ``create`` makes
  it ``0700`` if missing (``fsafe.private_root``, before a write), else it is only inspected
  (``fsafe.root_problem``, before a read). Cheap: once per process and directory."""
  try:
    st: os.stat_result | None = os.lstat(tier_dir)
  except OSError:
    st = None
  if st is not None and _roots.get(tier_dir) == _root_key_of(st):
    return ''
  why = fsafe.private_root(tier_dir) if create else fsafe.root_problem(tier_dir)
  if not why:
    try:
      st = os.lstat(tier_dir)
    except OSError as e:
      return f'cannot inspect {tier_dir}: {e}'
    with _lock:
      _roots[tier_dir] = _root_key_of(st)
      used.add(tier_dir)
  return why


UNSAFE_ADVICE = ('Nothing in it was read, written or removed. Remove it if you did not make it, '
                  'or point ORBAX_PATHWAYS_TIER_DIR (Options.tier_dir) at a directory of your '
                  'own, or set it to "off".')


def usable(cfg: TierConfig | None, *, missing_ok: bool = False) -> TierConfig | None:
  """``cfg`` when its directory is (or is now made) a private tier directory of this uid, else
  None with one warning per process naming what is wrong (another user's directory, one others
  can write into, a symlink, one that cannot be created). Called before the first write of each
  save (``write_entry`` on a writer host) and by ``engine.tier`` on the saving or restoring
  process, with ``missing_ok``: a directory that cannot be made (nothing is there, so nobody
  else's either) still gives ``cfg`` (its copies are skipped, warned; a restore still reads the
  other hosts' tiers), one that is there but is not a private one of this uid gives None (the
  tier is off on this process: nothing in it is read, served or written)."""
  if cfg is None:
    return None
  why = root_problem(cfg.tier_dir, create=True)
  if why:
    warn(cfg, 'unsafe:' + why, why, UNSAFE_ADVICE)
    return cfg if missing_ok and not fsafe.exists(cfg.tier_dir) else None
  return cfg


def readable(tier_dir: str) -> bool:
  """Whether a listing may read ``tier_dir``: it exists and passes ``fsafe.root_problem``
  (one warning per process otherwise: a planted tier is never read)."""
  if not fsafe.exists(tier_dir):
    return False
  why = root_problem(tier_dir, create=False)
  if why:
    said.once(logging.WARNING, ('tier-read', tier_dir, why),
               'orbax_pathways: node-local tier %s not read: %s. Restores read storage. %s',
               tier_dir, why, UNSAFE_ADVICE)
    return False
  return True
