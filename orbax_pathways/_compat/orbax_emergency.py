"""Orbax's experimental emergency ``CheckpointManager``: where it lives, the private helpers of
its module that ours reuses, and the seam where ``import orbax_pathways`` puts ours
(``manager/emergency.py``) in its place.

MaxText builds the manager as ``checkpoint_manager.CheckpointManager(...)`` on the module
``orbax.checkpoint.experimental.emergency.checkpoint_manager``, looked up at each call, so
replacing that module attribute reaches unchanged code that imported the module (not code that
bound the class itself before ``import orbax_pathways``). ``install`` / ``uninstall`` are called
by ``orbax_pathways._install`` only, on the process that imports the package.
"""

from __future__ import annotations

import importlib
from typing import Any

from orbax_pathways._compat import src

MODULE = 'orbax.checkpoint.experimental.emergency.checkpoint_manager'

_stock: Any = None  # Orbax's class while ours is installed


def module() -> Any:
  """Orbax's emergency ``checkpoint_manager`` module."""
  return importlib.import_module(MODULE)


def stock_class() -> type:
  """Orbax's own emergency ``CheckpointManager`` (also while ours is installed)."""
  return _stock if _stock is not None else module().CheckpointManager


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


def install(cls: type) -> None:
  """``cls`` (a subclass of Orbax's class) is what the module's ``CheckpointManager`` names."""
  global _stock
  m = module()
  if _stock is None:
    _stock = m.CheckpointManager
  m.CheckpointManager = cls


def uninstall() -> None:
  """Orbax's own class again."""
  global _stock
  if _stock is not None:
    module().CheckpointManager = _stock
    _stock = None


def installed() -> bool:
  return _stock is not None and module().CheckpointManager is not _stock
