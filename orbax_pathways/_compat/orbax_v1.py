"""Every touch of Orbax v1's private internals (``orbax.checkpoint.experimental.v1._src``).

Supported: the orbax-checkpoint range in ``orbax.SUPPORTED_ORBAX``. One reversible patch:

- ``array_leaf_handler._create_v0_array_handler(context)``: the single place where v1's
  ``ArrayLeafHandler`` (used by ``ocp.v1.save_pytree`` / ``load_pytree`` and
  ``ocp.v1.training.Checkpointer``) builds the v0 ArrayHandler it delegates to, once per
  ``Context``. v1 never consults the v0 global registry, so this is where our v1 front door
  (``frontends/orbax_v1.py``) plugs in. The wrapper calls the original first, so Orbax itself
  maps the Context to handler settings, then hands the result to the hook.

``install(hook)`` / ``uninstall()`` are idempotent and restore the very same function object.
"""

from __future__ import annotations

from orbax_pathways._compat import src

import threading
from typing import Any, Callable

_alh = src.orbax_v1('serialization.array_leaf_handler')

_lock = threading.Lock()
_original: Callable[[Any], Any] | None = None
_hook: Callable[[Any, Any], Any] | None = None



def _wrapped(context):
  original = _original
  assert original is not None, 'installed as the patch only while _original holds the original'
  handler = original(context)
  hook = _hook
  return hook(context, handler) if hook is not None else handler


def install(hook: Callable[[Any, Any], Any]) -> None:
  """``hook(context, stock_handler) -> handler`` decides which v0 handler v1 uses."""
  global _original, _hook
  with _lock:
    _hook = hook
    if _original is None:
      _original = _alh._create_v0_array_handler  # pylint: disable=protected-access
      _alh._create_v0_array_handler = _wrapped  # pylint: disable=protected-access


def uninstall() -> None:
  global _original, _hook
  with _lock:
    if _original is not None:
      _alh._create_v0_array_handler = _original  # pylint: disable=protected-access
    _original, _hook = None, None


def installed() -> bool:
  return _original is not None


def pathways_impl_name(context: Any) -> str | None:
  """``context.pathways_options.checkpointing_impl`` as 'colocated', 'persistence', 'local' (no
  dispatcher) or None (unset)."""
  impl = context.pathways_options.checkpointing_impl
  if impl is None:
    return None
  return {'COLOCATED_PYTHON': 'colocated', 'PERSISTENCE': 'persistence',
          'NO_DISPATCHER': 'local'}.get(impl.name)


def uses_load_and_broadcast(context: Any) -> bool:
  return bool(context.array_options.loading.use_load_and_broadcast)
