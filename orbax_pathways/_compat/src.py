"""The one module that imports Orbax's and JAX's private modules (``_src``).

Everything else in ``_compat/`` asks for them here, by their path under ``_src``:
``src.orbax('path.deleter')``, ``src.orbax_v1('partial.saving')``, ``src.jax('distributed')``.
Those paths move between releases; the supported range is in ``pyproject.toml`` and ``.ci/run``
tests both ends, so a moved path fails there with the full module name in the error.
``tests/repo/test_boundaries.py`` checks that no other module imports ``_src``.
"""

from __future__ import annotations

import importlib
from typing import Any

ORBAX = 'orbax.checkpoint._src'
ORBAX_V1 = 'orbax.checkpoint.experimental.v1._src'
JAX = 'jax._src'


def _load(root: str, name: str) -> Any:
  """``root.name`` as a module, or, where its last part is an attribute of the module above it
  (``asyncio_utils.run_sync``), that attribute."""
  full = f'{root}.{name}'
  try:
    return importlib.import_module(full)
  except ModuleNotFoundError as e:
    parent, _, attr = full.rpartition('.')
    if e.name != full or parent == root:
      raise
    module = importlib.import_module(parent)
    if not hasattr(module, attr):
      raise
    return getattr(module, attr)


def orbax(name: str) -> Any:
  """``orbax.checkpoint._src.<name>``."""
  return _load(ORBAX, name)


def orbax_v1(name: str) -> Any:
  """``orbax.checkpoint.experimental.v1._src.<name>``."""
  return _load(ORBAX_V1, name)


def jax(name: str) -> Any:
  """``jax._src.<name>``."""
  return _load(JAX, name)
