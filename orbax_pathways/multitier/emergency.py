"""Orbax's emergency ``CheckpointManager`` as a drop-in on the package's multi-tier path
(``docs/multi_tier.md``).

While the package is installed, building Orbax's
``experimental.emergency.checkpoint_manager.CheckpointManager`` builds
``EmergencyCheckpointManager`` (a subclass of it) instead, through whatever name the class was
bound to and whether that happened before or after ``import orbax_pathways``
(``_compat/orbax_emergency.py``). So MaxText's construction, unchanged::

    CheckpointManager(local_directory, persistent_directory, global_mesh, abstract_state,
                      options=CheckpointManagerOptions(
                          local=LocalCheckpointOptions(save_interval_steps=N),
                          persistent=PersistentCheckpointOptions(save_interval_steps=M)))

builds one ordinary ``ocp.CheckpointManager`` over ``persistent_directory`` on every process
(Orbax's persistent options, ``_get_persistent_options``), with ``local_directory`` as the
node-local tier of every save and restore of it (``tier/assigned.py``). On a mesh of several
slices, its declined steps on the local interval are saved local-only
(``multitier/local_steps.py``): every slice writes local (Orbax's slice 0 never does), the data
iterator's state (any item of the ``Composite`` beside ``state``) goes with each step at the
local cadence, every chunk is checked against its crc32c, and a step restores onto any slice
count, chunk by chunk, from the tiers the live processes hold (a lost node's share from a
partner copy or a replica), never from storage for a local-only step. On one slice, as Orbax's
class, it saves to storage on the persistent interval only and lists storage steps only.
``ORBAX_PATHWAYS_EMERGENCY=orbax`` keeps Orbax's own class. With
``Options.local_steps_in='nodes'`` (``ORBAX_PATHWAYS_LOCAL_STEPS_IN``) the local steps are node
steps (``multitier/node_steps.py``): each process saves its part alone into
``local_directory``, no storage request, no barrier; listed, restored and deleted there, and
resumed on the same process count (a replaced node's part from its partner's copy).

Who calls what, on which host: every process that runs the job builds the manager and calls
each method (as with Orbax's); the agreements (a local-only step restored everywhere or
nowhere) are one key-value round among them (``multitier/resume.all_processes_ok``).

Differences from Orbax's class, each listed with its reason in ``docs/format.md``: the dataset
item is saved in the step (not in ``persistent_non_replicated_directory``); ``latest_step()``
before the first save restores the newest local-only step to know that it can be completed;
``local_directory`` must be private to this uid (the tier's rule) and holds the tier's copies
of storage steps, on one slice too.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Sequence

from etils import epath
import jax
import orbax.checkpoint as ocp

from orbax_pathways import errors
from orbax_pathways._compat import orbax_emergency
from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways.coord import agreement as agreement_lib
from orbax_pathways.multitier import local_steps
from orbax_pathways.multitier import node_steps
from orbax_pathways.multitier import resume as resume_lib
from orbax_pathways.tier import assigned as tier_assigned

log = logging.getLogger('orbax_pathways')

STATE = 'state'
PROCESS_METADATA = 'process_metadata'  # reserved by Orbax's class


def accepts(kwargs: dict[str, Any]) -> bool:
  """Whether a construction of Orbax's class with these keyword arguments builds ours; when
  not, one log line names the options that keep Orbax's own class."""
  options = kwargs.get('options')
  why = unsupported(options) if options is not None else []
  if why:
    log.info('orbax_pathways: emergency CheckpointManager with %s: Orbax\'s own class is used '
             '(its local manager, Orbax\'s handlers, same-topology local restores).',
             ', '.join(why))
  return not why


def unsupported(options: Any) -> list[str]:
  """The emergency options this drop-in does not map (each keeps Orbax's own class)."""
  local = options.local
  out = [f'local.{name}' for name in ('should_save_fn', 'save_decision_policy',
                                      'preservation_policy')
         if getattr(local, name, None) is not None]
  if getattr(local, 'read_only', False):
    out.append('local.read_only')
  return out


class EmergencyCheckpointManager(orbax_emergency.stock_class()):  # type: ignore[misc]
  """Orbax's emergency ``CheckpointManager`` API on one ``CheckpointManager`` with local-only
  steps (module docstring). Orbax's own class is built instead (with one log line naming why)
  for options this one does not map (``unsupported``)."""

  def __new__(cls, *args: Any, **kwargs: Any):
    if not accepts(kwargs):
      return orbax_emergency.build_stock(*args, **kwargs)
    return object.__new__(cls)

  def __init__(self, local_directory: epath.PathLike, persistent_directory: epath.PathLike,
               global_mesh: jax.sharding.Mesh, abstract_state: Any, *, options: Any = None,
               metadata: dict[str, Any] | None = None, logger: Any = None,
               item_handlers: Any = None, handler_registry: Any = None,
               persistent_non_replicated_directory: epath.PathLike | None = None):
    # Orbax's __init__ is not called: it builds per-slice managers around its own handlers.
    stock = orbax_emergency.module()
    options = options or stock.CheckpointManagerOptions()
    self._options = options
    self._global_mesh = global_mesh
    self._abstract_state = abstract_state
    self._local_directory = epath.Path(local_directory)
    self._replica_axis_index = options.replica_axis_index
    self._slice_count = orbax_emergency.replica_count(global_mesh, options.replica_axis_index)
    if self._slice_count <= 0:
      raise ValueError(f'Slice count must be positive, but got {self._slice_count} for mesh '
                       f'{global_mesh}.')
    del persistent_non_replicated_directory  # the dataset is saved in the step (docs/format.md)
    # Orbax's class creates the root itself before its managers; create=True does the same.
    mngr_options = dataclasses.replace(
        orbax_emergency.persistent_options(options, ocp.options.MultiprocessingOptions()),
        create=True)
    if isinstance(item_handlers, dict) or item_handlers is None:
      handlers = item_handlers
    else:  # Orbax gives a single handler to its non-replicated manager: the dataset's
      handlers = {'dataset': item_handlers}
    if handlers is not None and STATE not in handlers:
      # Orbax's class gives these to the data iterator's manager only and handles the state
      # itself; one manager here holds both, and a dict of handlers confines it to its keys.
      # The state's handler is the one its args (PyTreeSave) name, built as Orbax builds it.
      handlers = {**handlers, STATE: ocp.PyTreeCheckpointHandler()}
    self._mngr = ocp.CheckpointManager(persistent_directory, options=mngr_options,
                                       metadata=metadata, logger=logger, item_handlers=handlers,
                                       handler_registry=handler_registry)
    self._checkpoint_manager = self._mngr  # what Orbax's inherited helpers delegate to
    local = options.local
    tier_assigned.assign(self._mngr.directory, str(self._local_directory), local.max_to_keep)
    # Orbax's class on one slice is a plain manager over persistent storage: no local saves,
    # none listed or restored. Its local steps exist only on several slices.
    self._multislice = self._slice_count > 1
    self._interval = local.save_interval_steps if self._multislice else 0
    local_steps.assign(self._mngr, self._interval, local.max_to_keep)
    self._started = False  # a save or restore ran: latest_step() no longer probes
    self._probed: tuple[int, Any] | None = None  # (step, restored state) of the probe
    self._passed_over: dict[int, str] = {}  # local-only steps that could not be completed

  # -- what Orbax's class answers -------------------------------------------------------------

  @property
  def directory(self) -> epath.Path:
    return self._mngr.directory

  @property
  def in_primary_slice(self) -> bool:
    if self._slice_count == 1:
      return True
    return orbax_emergency.in_primary_replica(_oms.process_index(), self._global_mesh,
                                              self._replica_axis_index)

  @property
  def global_mesh(self) -> jax.sharding.Mesh:
    return self._global_mesh

  def _local_steps(self) -> list[int]:
    """Committed local-only steps, newest first (not those passed over); none on one slice.
    Node steps (``Options.local_steps_in='nodes'``): this process's, in its node."""
    if not self._multislice:
      return []
    nodes = local_steps.on_nodes(self._mngr)
    if nodes is not None:
      steps = node_steps.listed(self._mngr, *nodes)
    else:
      _, steps = local_steps.newer_steps(self._mngr, None)
    return [s for s in steps if s not in self._passed_over]

  def all_steps(self, read: bool | None = None) -> Sequence[int]:
    """Storage steps and the local-only steps Orbax's class would list, ascending: its local
    manager saves every step on the local interval (storage steps too) and keeps the newest
    ``local.max_to_keep`` of them, so a local-only step is listed while it is among the newest
    ``max_to_keep`` steps on the local interval."""
    del read
    stored = set(self._mngr.all_steps())
    local = self._local_steps()
    on_interval = sorted(set(local) | {s for s in stored if self._local_due(s)}, reverse=True)
    kept = set(on_interval[:self._options.local.max_to_keep])
    return sorted(stored | {s for s in local if s in kept})

  def latest_step(self) -> int | None:
    """The newest step: before this manager's first save or restore (a restart), the newest
    one every live process can complete (``_probe``); after it, the newest listed."""
    if not self._started:
      self._started = True
      return self._probe()
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    raise NotImplementedError(
        'Metrics tracking not yet implemented for emergency.CheckpointManager.')

  def reload(self):
    return self._mngr.reload()

  def reached_preemption(self, step: int) -> bool:
    return self._mngr.reached_preemption(step)

  def should_save(self, step: int) -> bool:
    return self._mngr.should_save(step) or self._local_due(step)

  def _local_due(self, step: int) -> bool:
    return self._interval > 0 and step % self._interval == 0

  def delete(self, step: int):
    """Deletes ``step`` from storage and its local-only copy (Orbax's class cannot delete)."""
    if step in self._mngr.all_steps():
      self._mngr.delete(step)
    nodes = local_steps.on_nodes(self._mngr)
    if nodes is not None:
      node_steps.delete(self._mngr, *nodes, step)
    inner = local_steps.local_manager(self._mngr)
    if inner is not None and step in inner.all_steps():
      inner.delete(step)

  # -- saving --------------------------------------------------------------------------------

  def save(self, step: int, args: Any, *, force: bool = False,
           custom_metadata: dict[str, Any] | None = None) -> bool:
    """Orbax's persistent policy decides a storage save; a declined step on the local
    interval is saved local-only (``multitier/local_steps.py``). True when either happened."""
    keys = list(args.keys()) if isinstance(args, ocp.args.Composite) else None
    if keys is None:  # Orbax's class checks these first, with these errors
      raise ValueError(f'Expected args must be a Composite object, but got {type(args)}.')
    if STATE not in keys:
      raise ValueError(f'{STATE} is a required key and should be specified by the user.')
    if PROCESS_METADATA in keys:
      raise ValueError(f'{PROCESS_METADATA} is a reserved key and should not be specified by '
                       'the user.')
    self._started = True
    self._probed = None
    self._passed_over.pop(step, None)  # saved again (a rollback): a new step of that number
    kwargs = {} if custom_metadata is None else {'custom_metadata': custom_metadata}
    # A storage step on the local interval is saved on the nodes too, as Orbax's local manager
    # saves it (``local_steps.LocalStepHooks.after_save``).
    saved = bool(self._mngr.save(step, args=args, force=force, **kwargs))
    return saved or self._local_due(step)

  # -- restoring -----------------------------------------------------------------------------

  def _args(self, extra: dict[str, Any]) -> Any:
    """What every restore reads: the state as ``abstract_state`` describes it (as Orbax's class
    does, whatever ``args`` holds for it), and the other items ``args`` asks for."""
    state = ocp.args.PyTreeRestore(
        item=self._abstract_state,
        restore_args=ocp.checkpoint_utils.construct_restore_args(self._abstract_state))
    return ocp.args.Composite(**{STATE: state, **extra})

  def _restore_local(self, step: int, extra: dict[str, Any],
                     as_saved: bool = False) -> tuple[Any, BaseException | None]:
    """A local-only step restored on every process or on none (one agreement round);
    ``as_saved``: a node step each process saved with the job's current layout only."""
    nodes = local_steps.on_nodes(self._mngr)
    inner = local_steps.local_manager(self._mngr)
    state, error = None, None
    try:
      if nodes is not None:
        restore = node_steps.restore_as_saved if as_saved else node_steps.restore_items
        state = restore(self._mngr, *nodes, step, self._args(extra))
      elif inner is None:
        raise FileNotFoundError(f'no local-only steps under {local_steps.directory_of(self._mngr)}')
      else:
        state = inner.restore(step, args=self._args(extra))
    except Exception as e:  # pylint: disable=broad-except
      error = e
    if resume_lib.all_processes_ok(self._mngr, error is None, step):
      return state, None
    return None, error or errors.RestoreError(
        f'local-only step {step} of {self.directory} could not be completed on another '
        'process of this job')

  def _probe(self) -> int | None:
    """The newest step this job can restore: local-only steps newer than the newest storage
    step are restored (every process agreeing), newest first, the first that every process
    completes is kept for ``restore`` (so it is read once) and the newer ones, passed over, are
    deleted (a rolled-back run's, or incomplete); else the newest storage step. Storage's
    steps as this manager listed them when it was built (as Orbax's class does): not listed
    again, which at GCS latency costs a request per step."""
    newest_storage = self._mngr.latest_step()
    if not self._multislice:
      return newest_storage
    nodes = local_steps.on_nodes(self._mngr)
    if nodes is not None:  # node steps: one round over what the nodes hold (node_steps.resume)
      found = node_steps.resume(
          self._mngr, *nodes, self._abstract_state, newest_storage,
          all_ok=lambda ok, step: resume_lib.all_processes_ok(self._mngr, ok, step),
          timeout_s=agreement_lib.current().timeout_s, item=STATE)
      if found is None:
        return newest_storage
      self._probed = (found[0], {STATE: found[1]})
      log.info('orbax_pathways: emergency CheckpointManager: resuming from node step %d (newest '
               'storage step: %s).', found[0], newest_storage)
      return found[0]
    # Listed once, before any agreement round (local_steps.drop_newer says why).
    _, listed = local_steps.newer_steps(self._mngr, None)
    candidates = [s for s in listed if newest_storage is None or s > newest_storage]
    for step in candidates:
      state, error = self._restore_local(step, {})
      if error is None:
        self._probed = (step, state)
        log.info('orbax_pathways: emergency CheckpointManager: resuming from local-only step %d '
                 '(newest storage step: %s).', step, newest_storage)
        local_steps.drop_newer(self._mngr, step, listed)
        return step
      self._passed_over[step] = f'{type(error).__name__}: {str(error)[:500]}'
      log.warning('orbax_pathways: emergency CheckpointManager: local-only step %d cannot be '
                  'restored (%s); trying the next older step.', step, self._passed_over[step])
    if candidates:
      local_steps.drop_newer(self._mngr, newest_storage, listed)
    return newest_storage

  def restore(self, step: int | None, args: Any = None) -> Any:
    """``Composite(state=...)`` (and the other items ``args`` names, e.g. ``dataset``) of
    ``step`` (None: ``latest_step()``), onto ``abstract_state``'s shardings: from the node-local
    tiers only for a local-only step (every process or none); for a storage step on the local
    interval with node steps, from the nodes where every process's node holds it as saved, else
    from storage; from storage for the other storage steps."""
    self._started = True
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f'No steps found in {self.directory} or its local-only steps.')
    extra = {k: v for k, v in (args.items() if args is not None else ()) if k != STATE}
    probed, self._probed = self._probed, None
    if probed is not None and probed[0] == step:
      restored = {STATE: probed[1][STATE]}
      if extra:
        restored.update(self._restore_items(step, extra))
      return ocp.args.Composite(**restored)
    if step in self._passed_over:
      raise errors.LocalStepIncompleteError(
          f'local-only step {step} of {self.directory} cannot be restored by this job '
          f'({self._passed_over[step]}); restore latest_step() instead.')
    if step not in self._mngr.all_steps() and step in self._local_steps():
      state, error = self._restore_local(step, extra)
      if error is not None:
        raise error
      return ocp.args.Composite(**{k: state[k] for k in (STATE, *extra)})
    if self._multislice and self._local_due(step) and local_steps.on_nodes(self._mngr):
      # A storage step on the local interval is a node step too: restored from the nodes
      # first, as Orbax's class restores a step from its slices' local copies before its
      # persistent one. Decided by the step's number and the options alone, so every process
      # takes this branch; where any process's node lacks it, every process reads storage.
      state, error = self._restore_local(step, extra, as_saved=True)
      if error is None:
        return ocp.args.Composite(**{k: state[k] for k in (STATE, *extra)})
      log.info('orbax_pathways: emergency CheckpointManager: step %d restored from storage '
               '(its node step: %s).', step, f'{type(error).__name__}: {str(error)[:300]}')
    restored = self._mngr.restore(step, args=self._args(extra))
    return ocp.args.Composite(**{k: restored[k] for k in (STATE, *extra)})

  def _restore_items(self, step: int, extra: dict[str, Any]) -> dict[str, Any]:
    nodes = local_steps.on_nodes(self._mngr)
    if nodes is not None and step not in self._mngr.all_steps():
      restored = node_steps.restore_items(self._mngr, *nodes, step, ocp.args.Composite(**extra))
      return {k: restored[k] for k in extra}
    inner = local_steps.local_manager(self._mngr)
    source = self._mngr if step in self._mngr.all_steps() or inner is None else inner
    restored = source.restore(step, args=ocp.args.Composite(**extra))
    return {k: restored[k] for k in extra}

  def item_metadata(self, step: int) -> Any:
    raise NotImplementedError('Item metadata not implemented for emergency.CheckpointManager.')

  def metadata(self, step: int | None = None) -> Any:
    raise NotImplementedError('Metadata not yet implemented for emergency.CheckpointManager.')

  def metrics(self, step: int) -> Any:
    raise NotImplementedError('Metrics not yet implemented for emergency.CheckpointManager.')

  # -- the rest ------------------------------------------------------------------------------

  def wait_until_finished(self):
    return self._mngr.wait_until_finished()

  def check_for_errors(self):
    return self._mngr.check_for_errors()

  def close(self):
    try:
      return self._mngr.close()
    finally:
      tier_assigned.release(self._mngr.directory)

  def __contextmanager__(self) -> Iterable['EmergencyCheckpointManager']:
    try:
      yield self
    finally:
      self.close()
