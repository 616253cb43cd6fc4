"""Tier directories assigned to checkpoint directories by the manager that saves into them.

Orbax's emergency ``CheckpointManager`` takes a ``local_directory`` beside its persistent one;
ours (``multitier/emergency.py``) makes that directory the node-local tier of every save and
restore of its persistent directory (storage steps and local-only steps alike), keeping its
``local.max_to_keep`` steps. Every other checkpoint directory keeps ``Options.tier_dir``.

Who calls what, on which host: the manager calls ``assign`` at construction and ``release`` at
``close``, on every process that builds it; ``Engine.tier`` calls ``lookup`` at each save and
restore of an item, on the process that calls it. Process-wide, keyed by the checkpoint
directory as ``manifest.normalize_root`` spells it (a local-only step's hidden directory maps to
its manager's).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

from orbax_pathways.format import names as format_names
from orbax_pathways.tier import manifest


class Assignment(NamedTuple):
  tier_dir: str  # the tier directory
  keep: int  # committed steps the tier keeps for this checkpoint directory


_lock = threading.Lock()
_assigned: dict[str, Assignment] = {}


def _key(root: Any) -> str:
  return manifest.normalize_root(root)


def assign(root: Any, tier_dir: str, keep: int) -> None:
  """Saves and restores of ``root`` (and of its local-only steps) use the tier ``tier_dir``."""
  with _lock:
    _assigned[_key(root)] = Assignment(str(tier_dir), int(keep))


def release(root: Any) -> None:
  with _lock:
    _assigned.pop(_key(root), None)


def lookup(root: Any) -> Assignment | None:
  """The assignment of the checkpoint directory ``root``, or of the manager directory whose
  local-only steps ``root`` holds; None: ``Options.tier_dir`` applies."""
  if root is None:
    return None
  key = _key(root)
  with _lock:
    found = _assigned.get(key)
    if found is None:
      parent, _, name = key.rpartition('/')
      if name == format_names.LOCAL_STEPS_DIR:
        found = _assigned.get(parent)
  return found
