"""Where node steps lie in a node (``multitier/node_steps.py``, ``docs/format.md``): the tier
directory a manager's node steps use, their directory, the copies beside it, and which process
saved a step. Called on every process that saves or resumes node steps; no key-value request,
no network.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from orbax_pathways.fleet import node_copy
from orbax_pathways.format import names as format_names
from orbax_pathways.tier import assigned as tier_assigned
from orbax_pathways.tier import config as tier_config
from orbax_pathways.tier import fsafe


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


_RECORD_RE = re.compile(r'^p(\d+)' + re.escape(format_names.PATHWAYS_SUFFIX) + '$')


def saver(step_dir: str) -> int | None:
  """The process that saved the node step at ``step_dir`` (its writer record, ``p<i>``, in an
  item's ``_pathways``), or None when no item has one (JSON only: the same on every process)."""
  for item in fsafe.subdirs(step_dir):
    for name in fsafe.names(os.path.join(step_dir, item, format_names.PATHWAYS_DIR)):
      found = _RECORD_RE.match(name)
      if found:
        return int(found.group(1))
  return None


def copies_dir(root: str, digest: str) -> str:
  """Where a node keeps other processes' copies of the node steps of ``digest``: beside them,
  ``<root>/.node-steps/<digest>.copies`` (``fleet/node_copy.py``; no I/O)."""
  return os.path.join(root, format_names.NODE_STEPS_DIR, digest + node_copy.COPIES_SUFFIX)
