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

from orbax_pathways._compat import src

import threading
from typing import Any, Callable

_alh = src.orbax_v1('serialization.array_leaf_handler')


def _optional_module(name: str) -> Any:
  try:
    return src.orbax_v1(name)
  except ImportError:  # pragma: no cover  (an Orbax whose v1 has no such leaf handler)
    return None


# kind -> (module, factory name): where v1 builds the v0 handler of that kind of leaf.
_SEAMS: dict[str, tuple[Any, str]] = {
    'array': (_alh, '_create_v0_array_handler'),
    'numpy': (_optional_module('serialization.numpy_leaf_handler'), '_create_v0_numpy_handler'),
    'scalar': (_optional_module('serialization.scalar_leaf_handler'), '_create_v0_scalar_handler'),
}
HOST_KINDS = ('numpy', 'scalar')
# The host-leaf seams the installed Orbax has (both in every release tested; see tests).
HOST_SEAMS: tuple[str, ...] = tuple(
    k for k in HOST_KINDS if _SEAMS[k][0] is not None and callable(
        getattr(_SEAMS[k][0], _SEAMS[k][1], None)))

_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}  # kind -> Orbax's factory, while patched
_array_hook: Callable[[Any, Any], Any] | None = None
_host_hook: Callable[[str, Any], Any] | None = None


def _array_wrapper(context):
  original = _originals.get('array')
  assert original is not None, 'installed as the patch only while _originals holds the original'
  handler = original(context)
  hook = _array_hook
  return hook(context, handler) if hook is not None else handler


def _host_wrapper(kind: str) -> Callable[..., Any]:
  def wrapper(*args, **kwargs):
    original = _originals.get(kind)
    assert original is not None, 'installed as the patch only while _originals holds the original'
    handler = original(*args, **kwargs)
    hook = _host_hook
    return hook(kind, handler) if hook is not None else handler
  wrapper.__name__ = wrapper.__qualname__ = _SEAMS[kind][1]
  return wrapper


def install(array_hook: Callable[[Any, Any], Any],
            host_hook: Callable[[str, Any], Any] | None = None) -> None:
  """``array_hook(context, stock_handler) -> handler`` decides which v0 handler v1 uses for
  ``jax.Array`` leaves; ``host_hook(kind, stock_handler) -> handler`` for ``np.ndarray``
  (kind 'numpy') and scalar ('scalar') leaves, where the installed Orbax has the seam."""
  global _array_hook, _host_hook
  with _lock:
    _array_hook, _host_hook = array_hook, host_hook
    for kind in ('array',) + HOST_SEAMS:
      if kind in _originals:
        continue
      module, name = _SEAMS[kind]
      _originals[kind] = getattr(module, name)
      setattr(module, name, _array_wrapper if kind == 'array' else _host_wrapper(kind))


def uninstall() -> None:
  global _array_hook, _host_hook
  with _lock:
    for kind, original in _originals.items():
      module, name = _SEAMS[kind]
      setattr(module, name, original)
    _originals.clear()
    _array_hook, _host_hook = None, None


def installed() -> bool:
  return 'array' in _originals


def hooked_host_kinds() -> tuple[str, ...]:
  """The host-leaf kinds ('numpy', 'scalar') whose v1 factory is patched now."""
  return tuple(k for k in HOST_KINDS if k in _originals)


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
