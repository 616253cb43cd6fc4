"""Where node steps lie in a node (``multitier/node_steps.py``, ``docs/format.md``): the tier
directory a manager's node steps use, their directory, the copies beside it, which process
saved a step, and which process saved each device's shards (``write_processes``: what a
restore onto another layout plans its reads from). Called on every process that saves or
resumes node steps; no key-value request, no network.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Iterable

import msgpack

from orbax_pathways.fleet import node_copy
from orbax_pathways.format import names as format_names
from orbax_pathways.plan import node_parts
from orbax_pathways.tier import assigned as tier_assigned
from orbax_pathways.tier import config as tier_config
from orbax_pathways.tier import fsafe


def kept(keep: int) -> int:
  """How many of its node steps a node holds (and of each partner's copies) for a retention of
  ``keep`` local-only steps (``Options.local_steps_keep``, else ``tier_keep``): at least two.
  A node step commits on each process by itself, with no barrier, so every process commits step
  ``s`` at its own moment. A node that dropped the step before ``s`` as soon as its own ``s``
  committed would, at a kill before some other process committed ``s``, leave no step every node
  holds, and the restart would fall back to storage. The step before the newest stays until the
  next one commits; listings show ``keep`` steps as before (``multitier/emergency.py``)."""
  return max(2, keep)


def tier(options: Any, mngr: Any) -> tier_config.TierConfig | None:
  """This node's tier for ``mngr``'s node steps: the directory its builder assigned (Orbax's
  emergency manager's ``local_directory``, ``tier/assigned.py``), else the one the user named
  (``Options.tier_dir``, else ``ORBAX_PATHWAYS_TIER_DIR``), once it passes the private-root
  check; None otherwise."""
  assigned = tier_assigned.lookup(mngr.directory)
  named = assigned.tier_dir if assigned is not None else tier_config.named_dir(options.tier_dir)
  cfg = tier_config.usable(tier_config.resolve(named))
  return cfg if cfg is not None and cfg.explicit else None


def tier_root(options: Any, mngr: Any) -> str | None:
  """The directory of ``tier(options, mngr)``, or None."""
  cfg = tier(options, mngr)
  return None if cfg is None else cfg.tier_dir


def digest_of(mngr: Any) -> str:
  """The name of ``mngr``'s node steps in every node: a digest of its directory."""
  return hashlib.sha256(str(mngr.directory).encode()).hexdigest()[:16]


def directory(mngr: Any, root: str) -> str:
  """``<root>/.node-steps/<digest of mngr.directory>``, made ``0700`` (never through a
  symlink)."""
  return fsafe.private_dirs(root, format_names.NODE_STEPS_DIR, digest_of(mngr))


# The item of a node step holding a tree, as Orbax v1's ``load`` finds it (its
# ``checkpointable_name='AUTO'``, a name v1 reserves): the one item of the step, else the
# first by name that holds a tree (v1 checkpointables beside it: a data iterator).
AUTO_ITEM = 'AUTO'
_TREE_METADATA = '_METADATA'  # what Orbax's PyTree handler writes into a tree item


def tree_item(step_dir: str, item: str | None) -> str | None:
  """The item of the node step at ``step_dir`` a resume restores its tree from: ``item`` where
  the step holds it; with ``item=None`` its one item (a v0 save's ``default`` or one other);
  with ``AUTO_ITEM`` that, else the first item by name that holds a tree. None where there is
  none."""
  items = fsafe.subdirs(step_dir)
  if item is not None and item != AUTO_ITEM:
    return item if item in items else None
  if len(items) == 1:
    return items[0]
  if item == AUTO_ITEM:
    return next((n for n in sorted(items)
                 if fsafe.exists(os.path.join(step_dir, n, _TREE_METADATA))), None)
  return None


# The process that saved a node step (its writer record): used here and by the peer channel.
saver = node_copy.saver


def copies_dir(root: str, digest: str) -> str:
  """Where a node keeps other processes' copies of the node steps of ``digest``: beside them,
  ``<root>/.node-steps/<digest>.copies`` (``fleet/node_copy.py``; no I/O)."""
  return os.path.join(root, format_names.NODE_STEPS_DIR, digest + node_copy.COPIES_SUFFIX)


def write_processes(step_dir: str, count: int, device_process: Iterable[tuple[int, int]]) -> None:
  """Records beside the items of the node step at ``step_dir`` the job's process count and
  which process held each device (``node_parts.encode_processes``'s runs: about one per
  process), once the step is saved: what a restore onto another layout needs to know which
  process saved which shards (``read_processes``). A ``0600`` file, written whole then renamed
  (a step saved before it was written has none: it restores only onto its own layout)."""
  data = msgpack.packb({'n': int(count), 'runs': node_parts.encode_processes(device_process)},
                       use_bin_type=True)
  final = os.path.join(step_dir, format_names.NODE_PROCESSES_FILE)
  part = final + '.writing'
  fsafe.remove_tree(part)
  fsafe.write_file(part, data, exclusive=True)
  fsafe.replace(part, final)


def read_processes(step_dir: str) -> tuple[int, list[list[int]]] | None:
  """``(process count, device runs)`` of the node step at ``step_dir`` (``write_processes``),
  or None when it has none or it does not decode."""
  try:
    got = msgpack.unpackb(fsafe.read_small(os.path.join(step_dir,
                                                        format_names.NODE_PROCESSES_FILE)),
                          raw=False)
    n, runs = int(got['n']), [[int(a), int(b), int(c)] for a, b, c in got['runs']]
  except Exception:  # pylint: disable=broad-except  (missing or damaged: not restorable elsewhere)
    return None
  return (n, runs) if n > 0 else None
