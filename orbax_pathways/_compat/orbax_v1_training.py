"""What the package touches of Orbax v1's ``training.Checkpointer`` (the API MaxText saves
with), beyond the leaf-handler seams (``orbax_v1_seams.py``).

A v1 Checkpointer saves through a v0 ``CheckpointManager`` (its ``_manager``), whose checkpointer
it replaces before each save with one made for that save's checkpointables (v1's
``saving.get_v0_checkpointer_and_args``: a composite handler whose registry maps each
checkpointable's name to a compatibility handler around v1's own handler, and a
``CompositeArgs`` of compatibility ``Args``). Callers, on every process that calls the
Checkpointer:

- ``multitier/local_steps.py`` (the training loop's thread, inside v1's ``save`` of a step saved
  local-only): ``follow_v1_checkpointer`` gives the hidden manager of local-only steps a
  checkpointer that saves those arguments.
- ``multitier/local_detach.py``: ``v1_args_type`` (to detach the arguments for a background save).
- ``multitier/node_loop_items.py`` (the loop's thread, inside v1's ``save``): ``v1_handler`` and
  ``save_now`` (a checkpointable that is not a tree, a data iterator, saved by v1's own handler
  into the node).
- ``multitier/resume.py``: ``v0_manager_of`` (resume takes a v1 Checkpointer) and ``load``
  (a step read as v1's ``load`` or ``load_checkpointables`` reads it, joining its peers' last
  barrier when it fails here); ``multitier/node_steps.py``: ``load_items`` (a node step's data
  iterator, by v1's handler, this process alone).

SUPPORTED = ``supported.ORBAX``; the private modules through ``src.py``.
"""

from __future__ import annotations

import logging
from typing import Any

from etils import epath
import jax
import orbax.checkpoint as ocp

from orbax_pathways._compat import src

log = logging.getLogger('orbax_pathways')


def v0_manager_of(target: Any) -> tuple[Any, Any]:
  """``(manager, None)`` for a v0 ``CheckpointManager``; for Orbax v1's
  ``training.Checkpointer``, ``(the v0 CheckpointManager it saves through, the Checkpointer)``."""
  if isinstance(target, ocp.v1.training.Checkpointer):
    return target._manager, target  # pylint: disable=protected-access
  return target, None


def v1_args_type() -> Any:
  """The class of Orbax v1's compatibility ``Args`` (``Args(checkpointable)``): what v1's
  ``training.Checkpointer`` hands its v0 manager for each checkpointable, in a ``Composite``."""
  return src.orbax_v1('handlers.compatibility').Args


def v1_handler(handler: Any) -> Any | None:
  """The v1 ``CheckpointableHandler`` that ``handler`` (a v0 handler of v1's per-save
  checkpointer, ``handlers_of``) wraps, or None where it is not v1's compatibility handler. v1
  builds it for this save alone (``resolve_handler_for_save`` constructs one per call), so
  no other save uses it meanwhile."""
  compat = src.orbax_v1('handlers.compatibility').CompatibilityCheckpointHandler
  if not isinstance(handler, compat):
    return None
  return handler._handler  # pylint: disable=protected-access


class _Created(ocp.v1.path.PathAwaitingCreation):
  """A directory that exists already: what v1's handlers await is there at once (no signal,
  no other process: a node step is this process's alone)."""

  def __init__(self, path: epath.Path):
    self._path = path

  def __truediv__(self, other: Any) -> '_Created':
    return _Created(self._path / other)

  async def await_creation(self) -> epath.Path:
    return self._path

  @property
  def path(self) -> epath.Path:
    return self._path


def save_now(handler: Any, directory: epath.Path, checkpointable: Any) -> None:
  """Runs both phases of v1 ``handler``'s save of ``checkpointable`` into ``directory`` (made
  already) in the calling thread: the snapshot it takes as ``save`` is awaited (a data iterator's
  position), then the writes it returns; through Orbax's ``run_sync``, as v1's compatibility
  handler runs its own synchronous save."""

  async def both() -> None:
    background = await handler.save(_Created(directory), checkpointable)
    await background

  src.orbax('asyncio_utils').run_sync(both())


def _is_v1_args(args: Any) -> bool:
  compat = v1_args_type()
  return isinstance(args, ocp.args.Composite) and any(
      isinstance(a, compat) for a in args.values())


def follow_v1_checkpointer(mngr: ocp.CheckpointManager, inner: ocp.CheckpointManager,
                           args: Any) -> None:
  """Orbax v1's ``training.Checkpointer`` saves through a v0 ``CheckpointManager`` whose
  checkpointer it replaces before each save: one made for that save's checkpointables, whose
  composite handler knows v1's compatibility ``Args`` (the manager's own checkpointer does not).
  When ``args`` are such, the hidden manager ``inner`` gets, for its save of the same ``args``,
  a checkpointer of the same class (v1's memory regulation included) over the same item
  handlers, with ``inner``'s own options: its processes and barrier names, async options and
  metadata store. Waits for ``inner``'s previous save first (its finalize reads the
  checkpointer). v0 arguments: nothing done (``inner``'s own checkpointer saves them). Called
  in the training loop's thread, inside v1's ``save`` (the checkpointer v1 set is this
  step's)."""
  if not _is_v1_args(args):
    return
  made = mngr.__dict__['_checkpointer']  # set by v1 for this very save
  # pylint: disable=protected-access
  options, store = inner._options, inner._non_blocking_metadata_store
  if not isinstance(made, ocp.AsyncCheckpointer) or not options.enable_async_checkpointing:
    raise TypeError(f'orbax_pathways: a local-only save of Orbax v1 arguments needs an async '
                    f'checkpointer; found {type(made).__name__} (enable_async_checkpointing='
                    f'{options.enable_async_checkpointing}).')
  inner.wait_until_finished()
  kwargs = dict(
      multiprocessing_options=options.multiprocessing_options,
      async_options=options.async_options or ocp.AsyncOptions(),
      file_options=options.file_options or ocp.options.FileOptions(),
      atomicity_options=options.atomicity_options,
      checkpoint_metadata_store=store,
      temporary_path_class=options.temporary_path_class)
  if getattr(made, '_context', None) is not None:  # _RegulatedAsyncCheckpointer: 0.12.8, not 0.12.4
    kwargs['context'] = made._context  # pylint: disable=protected-access
  inner.__dict__['_checkpointer'] = type(made)(_with_processes(made.handler, options), **kwargs)


def _with_processes(handler: Any, options: Any) -> Any:
  """v1's composite handler for the step, rebuilt over the same item handlers with the hidden
  manager's ``MultiprocessingOptions``: its barriers (creating the item directories) then name
  every process, so they are key-value ones, never a collective over the devices (which only
  the loop's thread may launch; the hidden manager's save may run on a background thread)."""
  composite = src.orbax('handlers.composite_checkpoint_handler')
  # pylint: disable=protected-access
  return composite.CompositeCheckpointHandler(
      handler_registry=handler._handler_registry,
      composite_options=composite.CompositeOptions(
          multiprocessing_options=options.multiprocessing_options,
          temporary_path_class=handler._temporary_path_class,
          file_options=handler._file_options,
          atomicity_options=handler._atomicity_options,
          async_options=handler._async_options))


def load(checkpointer: Any, path: Any, abstract_state: Any,
         checkpointables: dict[str, Any] | None = None) -> Any:
  """The pytree of the step directory ``path`` as ``checkpointer``'s own ``load`` reads it: v1's
  ``load`` under the Checkpointer's ``Context`` (the active one, else its own, as it chooses).
  With ``checkpointables`` (name -> abstract checkpointable: a tree's abstract state, a data
  iterator), v1's ``load_checkpointables`` of them instead, and what it returns.

  v1's ``load`` ends in a barrier of every process (``_load_impl``). A process whose read fails
  (a chunk no live process holds, a checksum that does not match) would leave the others waiting
  in it until v1's coordination timeout; here it joins that barrier first (same key, same
  operation id), then raises, so every process reaches the resume's agreement round. It joins
  only when the failed load had taken its operation id (the failure came after v1's first
  barrier, as every read failure does): otherwise no peer is in that barrier."""
  context_mod = src.orbax_v1('context.context')
  sync = src.orbax_v1('synchronization.synchronization')
  multihost = src.orbax_v1('synchronization.multihost')
  asyncio_utils = src.orbax('asyncio_utils')
  own = checkpointer._context  # pylint: disable=protected-access
  with context_mod.get_context(own) as context:
    before = sync.get_operation_id()
    try:
      if checkpointables is not None:
        return ocp.v1.load_checkpointables(path, checkpointables)
      return ocp.v1.load(path, abstract_state)
    except Exception:
      operation = sync.get_operation_id()
      if jax.process_count() > 1 and operation != before:
        mp = context.multiprocessing_options
        try:
          asyncio_utils.run_sync(multihost.sync_global_processes(
              multihost.unique_barrier_key('_load_impl', prefix=mp.barrier_sync_key_prefix),
              operation_id=operation, processes=mp.active_processes))
        except Exception as barrier_error:  # pylint: disable=broad-except
          log.warning('orbax_pathways: after a failed load of %s, joining the peers\' barrier '
                      'failed too: %s', path, barrier_error)
      raise


def load_items(checkpointer: Any, step_dir: Any, checkpointables: dict[str, Any]) -> dict[str, Any]:
  """Each of ``checkpointables`` (name -> abstract checkpointable that is not a tree: a data
  iterator) loaded from its item of the node step at ``step_dir`` by the v1 handler v1's
  ``load`` would resolve for it under ``checkpointer``'s ``Context``, in the calling thread on
  this process alone (Orbax's ``run_sync``, as v1's compatibility handler runs it): a node step
  is its own process's, so no barrier (v1's ``load`` ends in one of every process). Called by
  ``multitier/node_steps.resume`` once the step's tree restored."""
  context_mod = src.orbax_v1('context.context')
  registration = src.orbax_v1('handlers.registration')
  out: dict[str, Any] = {}
  with context_mod.get_context(checkpointer._context) as context:  # pylint: disable=protected-access
    registry = context.checkpointables_options.registry
    for name, abstract in checkpointables.items():
      handler = registration.resolve_handler_for_load(registry, abstract, name=name)

      async def both(handler=handler, name=name, abstract=abstract) -> Any:
        background = await handler.load(epath.Path(step_dir) / name, abstract)
        return await background

      out[name] = src.orbax('asyncio_utils').run_sync(both())
  return out
