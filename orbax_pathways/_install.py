"""install() / uninstall(): put ProxyArrayHandler in Orbax's global type-handler registry.

Called at ``import orbax_pathways`` on every controller process (skipped when
``ORBAX_PATHWAYS_DISABLE`` is true). Idempotent and reversible: ``uninstall()`` re-registers
exactly the handler object that was there before. ``check_installed()`` runs at each
``CheckpointManager.save`` (through the manager hooks) and warns, once per intruder, when another
library (``pathwaysutils.initialize()``, ``ocp.pathways.register_type_handlers()``,
``register_standard_handlers_with_options()``) re-registered ``jax.Array`` after us.

``install()`` parses every ``ORBAX_PATHWAYS_*`` variable (``options.parse_env``): a malformed
value raises there, naming it, and an unknown ``ORBAX_PATHWAYS_*`` name is warned about. SIGTERM
is *not* touched here: ``preemption`` makes it a notice when the main process constructs its first
CheckpointManager. Each construction also checks that ``num_slices`` divides the device count.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Any

import numpy as np

from orbax_pathways.sharding import layout
from orbax_pathways.coord import liveness
from orbax_pathways.frontends import orbax_v0 as handler_lib
from orbax_pathways import options as options_lib
from orbax_pathways.engine import runtime
from orbax_pathways import preemption
from orbax_pathways.manager import hooks as manager_hooks
from orbax_pathways.multitier import local_steps
from orbax_pathways.manager import retention
from orbax_pathways.manager import step_errors
from orbax_pathways.manager import step_metadata
from orbax_pathways import stats as stats_lib
from orbax_pathways._compat import jax_distributed
from orbax_pathways._compat import orbax as compat
from orbax_pathways._compat import orbax_emergency
from orbax_pathways._compat import orbax_finalize
from orbax_pathways._compat import orbax_liveness
from orbax_pathways._compat import orbax_loop
from orbax_pathways._compat import orbax_logs
from orbax_pathways._compat import orbax_manager
from orbax_pathways._compat import orbax_signals
from orbax_pathways._compat import orbax_small_writes
from orbax_pathways._compat import orbax_tmp_cleanup
from orbax_pathways._compat import orbax_step_metadata
from orbax_pathways._compat import orbax_v1_seams as compat_v1
from orbax_pathways._compat import storage_clients
from orbax_pathways.frontends import orbax_v1
from orbax_pathways.storage import deadline as deadline_lib
from orbax_pathways.storage import index as index_lib
from orbax_pathways.tier import store as tier_store

log = logging.getLogger('orbax_pathways')
DISABLE_ENV = 'ORBAX_PATHWAYS_DISABLE'

_lock = threading.RLock()


class _State:
  """This module's process-wide state (one object: no `global` statement)."""

  ours: handler_lib.ProxyArrayHandler | None = None  # the handler install() registered
  previous: Any = None  # the handler that was registered before install()
  previous_numpy: dict | None = None  # likewise for np.ndarray and the scalar types, by type


_state = _State()
_warned: set[int] = set()
_warned_env: set[str] = set()


def disabled_by_env() -> bool:
  """``ORBAX_PATHWAYS_DISABLE`` as a boolean (ValueError naming it when malformed)."""
  return options_lib.env_value(DISABLE_ENV)


def _check_env() -> None:
  """Parses every ORBAX_PATHWAYS_* variable now, so that a typo fails at import, not at the
  first save (or never)."""
  values = options_lib.parse_env()
  for name, close in values['unknown'].items():
    if name not in _warned_env:
      _warned_env.add(name)
      hint = f' Did you mean {close}?' if close else ''
      warnings.warn(f'orbax_pathways: unknown environment variable {name}={os.environ[name]!r} '
                    f'is ignored.{hint} Known: {", ".join(options_lib.ENV_VARS)}.',
                    RuntimeWarning, stacklevel=4)
  for old, new in options_lib.FORMER_ENV.items():
    if old in os.environ and old not in _warned_env:
      _warned_env.add(old)
      used = 'is ignored: ' + new + ' is set too' if new in os.environ else 'is read for ' + new
      warnings.warn(f'orbax_pathways: {old} is now {new}; {old} {used}. The former name will go '
                    'away in a later release.', DeprecationWarning, stacklevel=4)


def _check_slices(mngr) -> None:
  """``num_slices`` (Options or ORBAX_PATHWAYS_NUM_SLICES) must divide the device count: checked
  when a CheckpointManager is constructed, not at the first commit."""
  handler = _state.ours
  n = handler.options.num_slices if handler is not None else None
  if not n:
    return
  import jax  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  try:
    layout.slice_of_devices(devices, num_slices=n)
  except ValueError:
    source = ('ORBAX_PATHWAYS_NUM_SLICES' if os.environ.get('ORBAX_PATHWAYS_NUM_SLICES', '').strip()
              else 'Options.num_slices')
    try:
      mngr.close()
    except Exception:  # pylint: disable=broad-except
      pass
    raise ValueError(
        f'orbax_pathways: {source}={n} does not divide the {len(devices)} devices of this job '
        f'into equal slices. Use a divisor of {len(devices)}, or unset it to take slices from '
        'the devices.') from None


class _Checks(manager_hooks.ManagerHooks):
  """At each manager's construction, ``num_slices`` against the devices; at each save, that our
  handler is still the registered one (``check_installed``)."""

  name = 'checks'

  def manager_init(self, mngr) -> None:
    _check_slices(mngr)

  def before_save(self, mngr, step: int) -> None:
    check_installed()


class _TierCommit(manager_hooks.ManagerHooks):
  """Every process, once a step committed: the node-local tier's copy of it becomes the
  committed one, then the commit's log line."""

  name = 'tier_commit'

  def after_commit(self, mngr, step: int, commit_s: float) -> None:
    _after_commit(mngr, step, commit_s)


def _manager_hooks() -> list[manager_hooks.ManagerHooks]:
  """What the package does around every CheckpointManager, in ``manager/hooks.ORDER``."""
  return [step_metadata.StepMetadata(), _Checks(), step_errors.StepErrors(), _TierCommit(),
          local_steps.LocalStepHooks(lambda: _installed_options().local_save_interval_steps,
                                     lambda: _local_steps_keep(_installed_options()),
                                     background=_local_saves_in_background,
                                     when_busy=lambda: _installed_options().local_save_when_busy,
                                     options=_installed_options)]


def _local_steps_keep(o: options_lib.Options) -> int:
  """Local-only steps kept per directory: ``Options.local_steps_keep``, else ``tier_keep``."""
  return o.local_steps_keep if o.local_steps_keep is not None else o.tier_keep


def _local_saves_in_background() -> bool:
  """Local-only saves run on a background thread where this process holds its own shards
  (the in-process transport); under Pathways the bytes stay on the workers."""
  requested = _installed_options().transport
  return runtime.choose_transport(requested=requested) is options_lib.TransportName.IN_PROCESS


def _install_manager_side() -> None:
  """Safe retention and strict listing with the writer lease, the preemption notice, and the
  package's own hooks (``_manager_hooks``), all reversible (``_compat/orbax_manager.py`` patches
  Orbax and calls them in ``manager/hooks.ORDER``)."""
  retention.install()  # and manager/lease.py
  preemption.install()
  for h in _manager_hooks():
    orbax_manager.register(h)
  # the _pathways index, written before commit; v1 partial saves' parts joined at finalize
  orbax_finalize.install(_merge_item, _merge_pending)
  orbax_signals.install()  # a failed step directory releases its waiters (no hang at exit)
  orbax_step_metadata.install()  # a manager save's own step metadata read from memory
  # and its small files written in one request each on gs://, read back from memory
  orbax_small_writes.install(orbax_step_metadata)
  # Orbax's clean-up of unfinished steps (cleanup_tmp_directories) spares the local-only steps
  orbax_tmp_cleanup.install()
  # a process that dies mid-save is named by the others, who raise and exit (coord/liveness.py)
  orbax_liveness.install(_save_round, liveness.lost_error)
  if options_lib.env_value('ORBAX_PATHWAYS_EMERGENCY') == 'pathways':
    try:  # Orbax's experimental module: an Orbax that cannot import it keeps working without it
      from orbax_pathways.multitier import emergency  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      log.warning('orbax_pathways: Orbax\'s emergency CheckpointManager cannot be imported (%s: '
                  '%s); its drop-in is not installed.', type(e).__name__, e)
    else:
      orbax_emergency.install(emergency.EmergencyCheckpointManager, emergency.accepts)


def _installed_options() -> options_lib.Options:
  """The installed handler's options (every handler is built from them); the environment's
  before ``install()``."""
  handler = _state.ours
  return handler.options if handler is not None else options_lib.Options.from_env()


def _bounds() -> deadline_lib.Bounds:
  o = _installed_options()
  return deadline_lib.Bounds(o.request_deadline_floor_s, o.request_deadline_cap_s)


def _merge_item(item_dir):
  """The item's index, merged at Orbax's finalize (primary host), under the installed options'
  storage deadlines (no handler runs the finalize)."""
  with deadline_lib.bounded(_bounds()):
    return index_lib.merge_item(item_dir)


def _merge_pending(item_dir, part_dir):
  with deadline_lib.bounded(_bounds()):
    return index_lib.merge_pending(item_dir, part_dir)


def _save_round(**kwargs) -> liveness.SaveRound:
  """One async save's liveness round on this process (``_compat/orbax_liveness``), with the
  peer deadline of the installed handler's options (Orbax's async manager, which starts the
  round, does not know which handler wrote the save; every handler is built from them)."""
  return liveness.save_round(jax_distributed.distributed_client(),
                             timeout_s=_installed_options().peer_timeout_s, **kwargs)


def _after_commit(mngr, step: int, commit_s: float) -> None:
  """Every process, once ``step`` committed: its node-local tier copy of the step becomes the
  committed one (older copies dropped), then the commit's log line."""
  try:
    tier_store.on_commit(str(mngr.directory), step)
  except Exception as e:  # pylint: disable=broad-except  # the tier never costs a save
    log.warning('orbax_pathways: node-local tier after step %d committed: %s: %s', step,
                type(e).__name__, e)
  _log_commit(mngr, step, commit_s)


def _log_commit(mngr, step: int, commit_s: float) -> None:
  """One line per committed step, on every process: save() to committed, and this process's
  share (the arrays' bytes it wrote, how long save() blocked it). Sets each of the step's
  saves' ``commit_s``."""
  saves = [s for s in stats_lib.saves_for_step(step, str(mngr.directory)) if s.commit_s is None]
  if not saves or _state.ours is None:
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
  Ours takes the constructor settings of the handler it replaces (``primary_host``,
  ``metadata_key``, ``enable_write_sharding_file``, the array-metadata store, ...), so handlers
  configured before ``import orbax_pathways`` keep writing and reading the same files; likewise
  for ``np.ndarray``.

  Also turns on the CheckpointManager side: retention that never leaves a torn step listed,
  listing that skips incomplete steps, and SIGTERM as a preemption notice in the main process
  once it constructs a CheckpointManager (unless ``ORBAX_PATHWAYS_NO_SIGTERM`` is true). Parses
  every ``ORBAX_PATHWAYS_*`` variable first (ValueError naming a malformed one)."""
  with _lock:
    _check_env()
    _install_manager_side()
    orbax_loop.install()  # a failed Orbax call leaves no task behind in its closed loop
    current = compat.registered_array_handler()
    ours = _state.ours
    if ours is not None and current is ours and (options is None or options == ours.options):
      return ours
    if ours is None or current is not ours and not isinstance(current,
                                                              handler_lib.ProxyArrayHandler):
      _state.previous = current
    ours = _state.ours = handler_lib.ProxyArrayHandler(options=options, **_settings_of(current))
    compat.register_array_handler(ours)
    _install_numpy(options)
    compat_v1.install(_v1_handler, _v1_host_handler)
    _warned.clear()
    log.info('orbax_pathways: installed %s for jax.Array in Orbax %s (replacing %s); '
             'uninstall() restores it.', type(ours).__name__, compat.ORBAX_VERSION,
             type(_state.previous).__name__)
    return ours


def _settings_of(current) -> dict:
  """The constructor settings of the jax.Array handler ``install()`` replaces (what the user
  registered, e.g. with ``register_standard_handlers_with_options``, or Orbax's default, which
  has an array-metadata store); Orbax's defaults if it is not an ``ArrayHandler``."""
  if isinstance(current, compat.ArrayHandler):
    return compat.handler_constructor_kwargs(current)
  return {'array_metadata_store': compat.array_metadata_store()}


# Scalar leaf types that Orbax's ScalarHandler serves and ours replaces (one instance for all,
# so one item's scalars make one record). ``bytes`` stays Orbax's: it has no numeric dtype.
SCALAR_TYPES: tuple[type, ...] = (int, float, np.number)


def _install_numpy(options) -> None:
  """Our np.ndarray and scalar handlers (numpy and scalar leaves saved with checksums, verified
  restores of our arrays into numpy targets), with the settings (``metadata_key``,
  ``ocdbt_process_id``) of the ones they replace. A type whose registered handler is not
  Orbax's (a user's own) is left alone."""
  current = compat.registered_handler(np.ndarray)
  if not isinstance(current, handler_lib.ProxyNumpyHandler):
    _state.previous_numpy = {np.ndarray: current}
    for ty in SCALAR_TYPES:
      _state.previous_numpy[ty] = compat.registered_handler(ty)
  assert _state.previous_numpy is not None
  previous = _state.previous_numpy[np.ndarray]
  kwargs = (compat.numpy_handler_constructor_kwargs(previous)
            if isinstance(previous, compat.NumpyHandler) else {})
  if previous is None or type(previous) is compat.NumpyHandler or isinstance(
      previous, handler_lib.ProxyNumpyHandler):
    compat.register_handler(np.ndarray, handler_lib.ProxyNumpyHandler(options=options, **kwargs))
  scalar_previous = [_state.previous_numpy[ty] for ty in SCALAR_TYPES]
  first = next((h for h in scalar_previous if isinstance(h, compat.ScalarHandler)), None)
  scalar = handler_lib.ProxyScalarHandler(
      options=options, **(compat.numpy_handler_constructor_kwargs(first) if first else {}))
  for ty, prev in zip(SCALAR_TYPES, scalar_previous):
    if prev is None or type(prev) is compat.ScalarHandler:
      compat.register_handler(ty, scalar)


def _v1_handler(context, stock):
  """Orbax v1's array handler for ``context``: ours while installed (``frontends/orbax_v1.py``)."""
  ours = _state.ours
  return orbax_v1.handler_for(context, stock, ours.options) if ours is not None else stock


def _v1_host_handler(kind, stock):
  """Orbax v1's np.ndarray / scalar handler: ours while installed (``frontends/orbax_v1.py``)."""
  ours = _state.ours
  return orbax_v1.host_handler_for(kind, stock, ours.options) if ours is not None else stock


def uninstall() -> None:
  """Restores the handler that was registered before ``install()``. No-op if not installed."""
  with _lock:
    if _state.ours is None:
      return
    for h in _manager_hooks():
      orbax_manager.unregister(h)
    preemption.uninstall()
    retention.uninstall()
    compat_v1.uninstall()
    orbax_finalize.uninstall()
    orbax_signals.uninstall()
    orbax_step_metadata.uninstall()
    orbax_small_writes.uninstall()
    orbax_tmp_cleanup.uninstall()
    orbax_liveness.uninstall()
    orbax_emergency.uninstall()
    storage_clients.uninstall()  # gcsfs / google-cloud-storage deadlines (set by the Engine)
    orbax_loop.uninstall()
    orbax_logs.uninstall()
    if _state.previous is not None:
      compat.register_array_handler(_state.previous)
    if _state.previous_numpy is not None:
      for ty, handler in _state.previous_numpy.items():
        if handler is not None:
          compat.register_handler(ty, handler)
    log.info('orbax_pathways: uninstalled; jax.Array handled by %s again.',
             type(_state.previous).__name__)
    _state.previous, _state.ours = None, None
    _state.previous_numpy = None


def installed() -> handler_lib.ProxyArrayHandler | None:
  """Our handler if it is what Orbax will use for jax.Array now, else None."""
  current = compat.registered_array_handler()
  return current if _state.ours is not None and current is _state.ours else None


def check_installed() -> bool:
  """Warns (once per intruding handler) if something replaced our handler after install()."""
  if _state.ours is None:
    return False
  current = compat.registered_array_handler()
  if current is _state.ours:
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
