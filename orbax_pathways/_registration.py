"""install() / uninstall(): put ProxyArrayHandler in Orbax's global type-handler registry.

Called at ``import orbax_pathways`` on every controller process (skipped when
``ORBAX_PATHWAYS_DISABLE=1``). Idempotent and reversible: ``uninstall()`` re-registers exactly
the handler object that was there before. ``check_installed()`` runs at each
``CheckpointManager.save`` (through the manager hooks) and warns, once per intruder, when another
library (``pathwaysutils.initialize()``, ``ocp.pathways.register_type_handlers()``,
``register_standard_handlers_with_options()``) re-registered ``jax.Array`` after us.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings

import numpy as np

from orbax_pathways.frontends import orbax_v0 as handler_lib
from orbax_pathways import options as options_lib
from orbax_pathways import preemption
from orbax_pathways import retention
from orbax_pathways import stats as stats_lib
from orbax_pathways._compat import orbax as compat
from orbax_pathways._compat import orbax_finalize
from orbax_pathways._compat import orbax_manager
from orbax_pathways._compat import orbax_v1 as compat_v1
from orbax_pathways.frontends import orbax_v1
from orbax_pathways.storage import index as index_lib

log = logging.getLogger('orbax_pathways')
DISABLE_ENV = 'ORBAX_PATHWAYS_DISABLE'

_lock = threading.RLock()
_previous = None  # the handler that was registered before install()
_ours = None  # the handler install() registered
_previous_numpy = None  # likewise for np.ndarray (ours only verifies restores of our arrays)
_warned: set[int] = set()


def disabled_by_env() -> bool:
  return os.environ.get(DISABLE_ENV, '').strip().lower() in ('1', 'true', 'yes', 'on')


def _install_manager_side() -> None:
  """Safe retention and strict listing, the preemption notice, and the re-registration check
  at each ``CheckpointManager.save`` (all reversible, see ``_compat/orbax_manager.py``)."""
  retention.install()
  preemption.install()
  orbax_manager.set_hook('before_save', lambda mngr, step: check_installed())
  orbax_manager.set_hook('after_commit', _log_commit)
  orbax_manager.install_manager_hooks()
  orbax_finalize.install(index_lib.merge_item)  # the _pathways index, written before commit


def _log_commit(mngr, step: int, commit_s: float) -> None:
  """One line per committed step, on every process: save() to committed, and this process's
  share (the arrays' bytes it wrote, how long save() blocked it). Sets each of the step's
  saves' ``commit_s``."""
  saves = [s for s in stats_lib.saves_for_step(step, str(mngr.directory)) if s.commit_s is None]
  if not saves or _ours is None:
    return
  for st in saves:
    st.commit_s = commit_s
  total = sum(st.total_written for st in saves)
  log.info('orbax_pathways: step %d committed %.2f s after save() (save() blocked %.0f ms; this '
           'process wrote %.1f MiB of arrays, %.2f GB/s over the commit; %s transport) in %s',
           step, commit_s, sum(st.blocking_s for st in saves) * 1e3, total / 2**20,
           total / max(commit_s, 1e-9) / 1e9, '/'.join(sorted({st.transport for st in saves})),
           mngr.directory)


def install(options: options_lib.Options | None = None) -> handler_lib.ProxyArrayHandler:
  """Registers our handler for ``jax.Array``; a second call returns the installed one unless
  ``options`` differ (then it replaces ours, keeping the original to restore on uninstall).

  Also turns on the CheckpointManager side: retention that never leaves a torn step listed,
  listing that skips incomplete steps, and SIGTERM as a preemption notice (unless
  ``ORBAX_PATHWAYS_NO_SIGTERM=1``)."""
  global _previous, _ours
  with _lock:
    _install_manager_side()
    current = compat.registered_array_handler()
    if _ours is not None and current is _ours and (options is None or options == _ours.options):
      return _ours
    if _ours is None or current is not _ours and not isinstance(current, handler_lib.ProxyArrayHandler):
      _previous = current
    _ours = handler_lib.ProxyArrayHandler(options=options)
    compat.register_array_handler(_ours)
    _install_numpy(options)
    compat_v1.install(_v1_handler)
    _warned.clear()
    log.info('orbax_pathways: installed %s for jax.Array in Orbax %s (replacing %s); '
             'uninstall() restores it.', type(_ours).__name__, compat.ORBAX_VERSION,
             type(_previous).__name__)
    return _ours


def _install_numpy(options) -> None:
  """Our np.ndarray handler (verified restores of our arrays into numpy targets)."""
  global _previous_numpy
  current = compat.registered_handler(np.ndarray)
  if not isinstance(current, handler_lib.ProxyNumpyHandler):
    _previous_numpy = current
  compat.register_handler(np.ndarray, handler_lib.ProxyNumpyHandler(options=options))


def _v1_handler(context, stock):
  """Orbax v1's array handler for ``context``: ours while installed (``frontends/orbax_v1.py``)."""
  ours = _ours
  return orbax_v1.handler_for(context, stock, ours.options) if ours is not None else stock


def uninstall() -> None:
  """Restores the handler that was registered before ``install()``. No-op if not installed."""
  global _previous, _ours, _previous_numpy
  with _lock:
    if _ours is None:
      return
    orbax_manager.set_hook('before_save', None)
    orbax_manager.set_hook('after_commit', None)
    preemption.uninstall()
    retention.uninstall()
    compat_v1.uninstall()
    orbax_finalize.uninstall()
    if _previous is not None:
      compat.register_array_handler(_previous)
    if _previous_numpy is not None:
      compat.register_handler(np.ndarray, _previous_numpy)
    log.info('orbax_pathways: uninstalled; jax.Array handled by %s again.', type(_previous).__name__)
    _previous, _ours = None, None
    _previous_numpy = None


def installed() -> handler_lib.ProxyArrayHandler | None:
  """Our handler if it is what Orbax will use for jax.Array now, else None."""
  current = compat.registered_array_handler()
  return current if _ours is not None and current is _ours else None


def check_installed() -> bool:
  """Warns (once per intruding handler) if something replaced our handler after install()."""
  if _ours is None:
    return False
  current = compat.registered_array_handler()
  if current is _ours:
    return True
  if id(current) not in _warned:
    _warned.add(id(current))
    warnings.warn(
        f'orbax_pathways: jax.Array is now handled by {type(current).__module__}.'
        f'{type(current).__name__}, not orbax_pathways (something re-registered it after '
        '`import orbax_pathways`, e.g. pathwaysutils.initialize() or '
        'ocp.pathways.register_type_handlers()). Shards will not be written by their owning '
        'hosts. Call orbax_pathways.install() after that call to take it back.',
        RuntimeWarning, stacklevel=3)
  return False
