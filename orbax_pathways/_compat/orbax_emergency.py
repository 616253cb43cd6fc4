"""Orbax's experimental emergency ``CheckpointManager``: where it lives, the private helpers of
its module that ours reuses, and the seam where ``import orbax_pathways`` puts ours
(``multitier/emergency.py``) in its place.

MaxText binds Orbax's class to a name of its own when its module is imported
(``emergency_checkpointing.CheckpointManager = emergency_checkpoint_manager.CheckpointManager``),
which may happen before ``import orbax_pathways``. So the seam is the class itself, not the
module attribute: while ours is installed, Orbax's class's ``__new__`` builds ours (a subclass,
so ``isinstance`` checks against Orbax's class hold) wherever the class was bound and whatever
the import order. ``install`` / ``uninstall`` are called by ``orbax_pathways._install`` only,
on the process that imports the package.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from orbax_pathways._compat import seam
from orbax_pathways._compat import src

MODULE = 'orbax.checkpoint.experimental.emergency.checkpoint_manager'

NAME = "Orbax's emergency CheckpointManager built as the package's drop-in"


def module() -> Any:
  """Orbax's emergency ``checkpoint_manager`` module."""
  return importlib.import_module(MODULE)


def stock_class() -> type:
  """Orbax's own emergency ``CheckpointManager`` (also while ours is installed)."""
  return module().CheckpointManager


def persistent_options(options: Any, multiprocessing_options: Any) -> Any:
  """The ``ocp.CheckpointManagerOptions`` Orbax's emergency manager gives its persistent
  manager for ``options`` (its ``_get_persistent_options``: interval, ``max_to_keep``,
  ``keep_period``, step names, async options, policies), so each option keeps its meaning."""
  return module()._get_persistent_options(options, multiprocessing_options)  # pylint: disable=protected-access


def replica_count(mesh: Any, replica_axis_index: int) -> int:
  """How many replicas (slices) ``mesh`` has along ``replica_axis_index``, as Orbax counts."""
  return src.orbax('multihost.multislice').replica_count(
      mesh, replica_axis_index=replica_axis_index)


def in_primary_replica(process_index: int, mesh: Any, replica_axis_index: int) -> bool:
  """Whether ``process_index`` holds devices of replica 0 of ``mesh``, as Orbax decides."""
  return src.orbax('multihost.multislice').in_replica(
      process_index, mesh, replica_axis_index=replica_axis_index, replica_id=0)


def build_stock(*args: Any, **kwargs: Any) -> Any:
  """An instance of Orbax's own class, also while ours is installed (the construction the
  redirect below would otherwise turn into ours)."""
  stock = stock_class()
  obj: Any = object.__new__(stock)
  obj.__init__(*args, **kwargs)
  return obj


def install(cls: type, accepts: Callable[[dict[str, Any]], bool]) -> None:
  """Building Orbax's class builds ``cls`` (a subclass of it) instead, for the keyword
  arguments ``accepts`` takes: its ``__new__`` is replaced (or, where it defines none, one is
  added and later removed), so the redirect holds for every name bound to the class, also one
  bound before ``import orbax_pathways`` (MaxText's ``emergency_checkpointing.CheckpointManager``).
  Python then runs ``cls.__init__`` on the instance, as for any subclass instance ``__new__``
  returns."""
  seam.uninstall(NAME)
  stock = stock_class()

  def __new__(klass: type, *args: Any, **kwargs: Any) -> Any:
    del args
    if klass is stock and accepts(kwargs):
      klass = cls
    return object.__new__(klass)

  seam.install(seam.Feature(
      NAME, 'building Orbax\'s class is the only way MaxText\'s unchanged code reaches ours',
      lambda: [seam.Target(lambda: stock, '__new__', lambda _: staticmethod(__new__),
                           add=True)]))


def uninstall() -> None:
  """Orbax's own class builds itself again."""
  seam.uninstall(NAME)


def installed() -> bool:
  return seam.installed(NAME)
