"""The items of a node step that only their own handler can save, saved in the training loop's
thread: a data iterator's (its handler reads the iterator's position as it saves), a custom
handler's arguments. ``multitier/local_detach.py`` cannot copy them, so the loop's thread runs
their handler's ``save`` into a staging directory on the node (``<node steps>/.loop-items/
<step>/<item>``) before ``save()`` returns; the node step's save (on the background thread, or
the loop's for the preemption step) then moves that directory into the step as its item, inside
Orbax's save, so the step commits with it or not at all. The item's files are its handler's
own, and the step's ``_CHECKPOINT_METADATA`` names that handler, as a save through it would:
a restore with the item's restore arguments reads it through the same handler.

Who calls what, on which host (every process that calls the manager, its own node):

- ``handler_for(mngr, name, args)``: ``node_steps.applies``: the handler ``mngr`` saves the item
  with (its ``item_handlers`` or ``handler_registry``, else the one Orbax registered for the
  arguments' type); None where there is none, or where it saves in the background
  (an ``AsyncCheckpointHandler``: Orbax's own save would call it after ``save()`` returned, and
  its object is the user's manager's, which may be committing a storage save with it). Orbax
  v1's handler of a checkpointable (a ``StatefulCheckpointable`` data iterator under v1's
  ``training.Checkpointer``) is taken: v1 made its compatibility handler for this save alone,
  and ``stage`` runs both phases of v1's save in the loop's thread.
- ``stage(mngr, node_dir, step, items)``: ``local_steps.LocalStepHooks._start`` and
  ``node_steps.save`` (the loop's thread): each item saved by its handler into the staging
  directory; returns the arguments that stand for them in the node step's ``Composite``.
- ``discard(node_dir, step)``: ``node_steps.save`` once the step saved or failed, and
  ``node_steps.manager`` (every staged item of an earlier run: a save killed midway).

Every directory is ``0700`` inside the tier's private directory (``tier/fsafe.py``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from etils import epath
import orbax.checkpoint as ocp

from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways._compat import orbax_v1_training as _v1
from orbax_pathways.tier import fsafe

LOOP_ITEMS_DIR = '.loop-items'  # <node steps>/.loop-items/<step>/<item>: not a step name

# Handler typestr -> the arguments type whose (registered) handler moves a staged item into the
# step and names that handler in the step's metadata.
_staged_types: dict[str, type] = {}


def handler_for(mngr: Any, name: str, args: Any) -> Any | None:
  """The synchronous handler that saves item ``name`` (``args``) in ``mngr``'s saves, or None."""
  registry = _oms.handlers_of(mngr)
  handler = None
  for item in (name, None):
    if registry.has(item, args):
      handler = registry.get(item, args)
      break
  if handler is None:
    try:
      handler = ocp.args.get_registered_handler_cls(args)()
    except Exception:  # pylint: disable=broad-except  (no handler: the storage path keeps it)
      return None
  if isinstance(handler, ocp.AsyncCheckpointHandler) and _v1.v1_handler(handler) is None:
    return None
  return handler


def _adopt(staged: str, directory: epath.Path) -> None:
  """Moves the files of ``staged`` into ``directory`` (the item's directory in the step being
  saved), then removes ``staged``."""
  os.makedirs(str(directory), mode=0o700, exist_ok=True)
  for name in os.listdir(staged):
    os.rename(os.path.join(staged, name), os.path.join(str(directory), name))
  os.rmdir(staged)


def _staged_type(typestr: str) -> type:
  """The arguments type of a staged item whose handler's typestr is ``typestr`` (one per
  handler type, registered with Orbax once)."""
  found = _staged_types.get(typestr)
  if found is not None:
    return found

  class StagedItemHandler(ocp.CheckpointHandler):
    """Saves a staged item by moving its directory into the step; named ``typestr`` in the
    step's metadata. Never restores: a restore names the item's own restore arguments."""

    def __init__(self):
      # The class registers under a name of its own (Orbax keeps one class per typestr); the
      # step's metadata asks the instance, which names the item's handler.
      setattr(self, 'typestr', lambda: typestr)

    def save(self, directory: epath.Path, *args: Any, **kwargs: Any) -> None:
      given: Any = kwargs['args'] if 'args' in kwargs else args[0]
      _adopt(given.path, directory)

    def restore(self, directory: epath.Path, *args: Any, **kwargs: Any) -> Any:
      raise ValueError(f'{directory}: a node step\'s item saved by {typestr} is restored with '
                       'its own restore arguments')

    @classmethod
    def typestr(cls) -> str:
      return f'orbax_pathways.staged_item:{typestr}'

  @dataclasses.dataclass
  class StagedItemSave(ocp.args.CheckpointArgs):
    path: str  # the staged item's directory on this node

  @dataclasses.dataclass
  class StagedItemRestore(ocp.args.CheckpointArgs):  # Orbax registers a handler's pair; unused
    pass

  ocp.args.register_with_handler(StagedItemHandler, for_save=True)(StagedItemSave)
  ocp.args.register_with_handler(StagedItemHandler, for_restore=True)(StagedItemRestore)
  _staged_types[typestr] = StagedItemSave
  return StagedItemSave


def staging_dir(node_dir: str, step: int) -> str:
  """Where step ``step``'s loop items are staged (no I/O)."""
  return os.path.join(node_dir, LOOP_ITEMS_DIR, str(step))


def stage(mngr: Any, node_dir: str, step: int, items: dict[str, Any]) -> dict[str, Any]:
  """Saves each of ``items`` (name -> save arguments) with its handler (``handler_for``) into
  the staging directory of step ``step`` under ``node_dir``; returns name -> the arguments that
  stand for it in the node step's save. The loop's thread."""
  discard(node_dir, step)  # a staging an earlier run left for the same step
  base = fsafe.private_dirs(node_dir, LOOP_ITEMS_DIR, str(step))
  out = {}
  for name, args in items.items():
    handler = handler_for(mngr, name, args)
    if handler is None:
      raise ValueError(f'no synchronous handler saves item {name!r} ({type(args).__name__}) '
                       f'of {mngr.directory}')
    path = os.path.join(base, name)
    os.mkdir(path, 0o700)
    v1 = _v1.v1_handler(handler)
    if v1 is not None:  # Orbax v1's handler of a checkpointable: both its phases, here
      _v1.save_now(v1, epath.Path(path), args.checkpointable)
    else:
      handler.save(epath.Path(path), args=args)
      handler.finalize(epath.Path(path))
    out[name] = _staged_type(handler.typestr())(path=path)
  return out


def discard(node_dir: str, step: int | None = None) -> None:
  """Removes step ``step``'s staging (None: every step's) under ``node_dir``."""
  target = (os.path.join(node_dir, LOOP_ITEMS_DIR) if step is None
            else staging_dir(node_dir, step))
  fsafe.remove_tree(target)
  if step is not None:
    try:
      os.rmdir(os.path.join(node_dir, LOOP_ITEMS_DIR))  # the last staging gone: no trace left
    except OSError:
      pass


def is_staged(args: Any) -> bool:
  """Whether ``args`` stands for a staged item (``stage``)."""
  return type(args) in _staged_types.values()
