"""Every touch of Orbax v1's private internals (``orbax.checkpoint.experimental.v1._src``).

Supported: the orbax-checkpoint range in ``supported.ORBAX``. v1's leaf handlers (used by
``ocp.v1.save`` / ``load`` / ``save_pytree`` / ``load_pytree`` and ``ocp.v1.training.Checkpointer``)
each build the v0 TypeHandler they delegate every save, load and metadata call to, once per
leaf handler (per ``Context``), through a module-level factory; v1 never consults the v0 global
registry. Those factories are where our v1 front door (``frontends/orbax_v1.py``) plugs in, one
reversible patch each:

- ``array_leaf_handler._create_v0_array_handler(context)``: ``jax.Array`` leaves
  (``ArrayLeafHandler``).
- ``numpy_leaf_handler._create_v0_numpy_handler(...)``: ``np.ndarray`` leaves
  (``NumpyLeafHandler``). Takes the Context in newer Orbax, nothing in older releases.
- ``scalar_leaf_handler._create_v0_scalar_handler()``: ``int`` / ``float`` (and ``bytes``) leaves
  (``ScalarLeafHandler``).

Each wrapper calls the original first (with whatever arguments Orbax passes), so Orbax itself
maps the Context to handler settings, then hands the result to the hook. The numpy and scalar
factories are optional: an Orbax without one (``HOST_SEAMS`` lists those found) leaves those
leaves to Orbax's own handler, unchecked, as before they were hooked.

``install(array_hook, host_hook)`` / ``uninstall()`` are idempotent and restore the very same
function objects.
"""

from __future__ import annotations

from orbax_pathways._compat import seam
from orbax_pathways._compat import src

import threading
from typing import Any, Callable

def _optional_module(name: str) -> Any:
  try:
    return src.orbax_v1(name)
  except ImportError:  # pragma: no cover  (an Orbax whose v1 has no such leaf handler)
    return None


# kind -> (module name, factory name): where v1 builds the v0 handler of that kind of leaf.
_FACTORIES: dict[str, tuple[str, str]] = {
    'array': ('serialization.array_leaf_handler', '_create_v0_array_handler'),
    'numpy': ('serialization.numpy_leaf_handler', '_create_v0_numpy_handler'),
    'scalar': ('serialization.scalar_leaf_handler', '_create_v0_scalar_handler'),
}
HOST_KINDS = ('numpy', 'scalar')
# The host-leaf seams the installed Orbax has (both in every release tested; see tests).
HOST_SEAMS: tuple[str, ...] = tuple(
    k for k in HOST_KINDS if callable(getattr(_optional_module(_FACTORIES[k][0]),
                                              _FACTORIES[k][1], None)))

_lock = threading.Lock()


class _State:
  """This module's process-wide state (one object: no `global` statement)."""

  array_hook: Callable[[Any, Any], Any] | None = None
  host_hook: Callable[[str, Any], Any] | None = None


_state = _State()


def _array_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
  def _create_v0_array_handler(context):
    handler = original(context)
    hook = _state.array_hook
    return hook(context, handler) if hook is not None else handler
  return _create_v0_array_handler


def _host_wrapper(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  def make(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args, **kwargs):
      handler = original(*args, **kwargs)
      hook = _state.host_hook
      return hook(kind, handler) if hook is not None else handler
    wrapper.__name__ = wrapper.__qualname__ = _FACTORIES[kind][1]
    return wrapper
  return make


def _targets() -> list[seam.Target]:
  module = lambda kind: lambda: src.orbax_v1(_FACTORIES[kind][0])  # pylint: disable=unnecessary-lambda-assignment
  return ([seam.Target(module('array'), _FACTORIES['array'][1], _array_wrapper)] +
          [seam.Target(module(kind), _FACTORIES[kind][1], _host_wrapper(kind))
           for kind in HOST_SEAMS])


FEATURE = seam.Feature(
    'Orbax v1 saves and loads through the package\'s handlers',
    'v1 builds its v0 leaf handlers in module factories and never reads the v0 registry',
    _targets)


def install(array_hook: Callable[[Any, Any], Any],
            host_hook: Callable[[str, Any], Any] | None = None) -> None:
  """``array_hook(context, stock_handler) -> handler`` decides which v0 handler v1 uses for
  ``jax.Array`` leaves; ``host_hook(kind, stock_handler) -> handler`` for ``np.ndarray``
  (kind 'numpy') and scalar ('scalar') leaves, where the installed Orbax has the seam."""
  with _lock:
    _state.array_hook, _state.host_hook = array_hook, host_hook
    seam.install(FEATURE)


def uninstall() -> None:
  with _lock:
    seam.uninstall(FEATURE)
    _state.array_hook, _state.host_hook = None, None


def installed() -> bool:
  return seam.installed(FEATURE)


def hooked_host_kinds() -> tuple[str, ...]:
  """The host-leaf kinds ('numpy', 'scalar') whose v1 factory is patched now."""
  patched = seam.originals(FEATURE)
  return tuple(k for k in HOST_KINDS if _FACTORIES[k][1] in patched)


def pathways_impl_name(context: Any) -> str | None:
  """``context.pathways_options.checkpointing_impl`` as 'colocated', 'persistence', 'in_process' (no
  dispatcher) or None (unset)."""
  impl = context.pathways_options.checkpointing_impl
  if impl is None:
    return None
  return {'COLOCATED_PYTHON': 'colocated', 'PERSISTENCE': 'persistence',
          'NO_DISPATCHER': 'in_process'}.get(impl.name)


def uses_load_and_broadcast(context: Any) -> bool:
  return bool(context.array_options.loading.use_load_and_broadcast)
