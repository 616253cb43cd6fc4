"""Local-only steps on the nodes alone (``Options.local_steps_in='nodes'``, ``docs/multi_tier.md``).

Each process saves its part of a local-only step by itself into its node: a synchronous
``CheckpointManager`` of this process only (``active_processes={process}``,
``primary_host=None``) over ``<tier directory>/.node-steps/<digest of the manager's
directory>``, whose array handler writes every shard this process holds (Orbax's
``replica_id=None``: its save alone is complete for what it holds) and whose Orbax operation ids
and signals are its own (``_compat/orbax_process_local.alone``). So a local-only save makes no
storage request and meets no other process (no barrier: Orbax's own skip a manager of one
process, and its signals stay in the save's namespace), and a storage
save never waits for it (nor it for a storage save). Each node keeps its newest ``keep`` steps,
and at least two (``node_layout.kept``: the step before the newest, for a process that had not
committed the newest at a kill), by Orbax's own retention of that manager, on this node only.
The step is in Orbax's format there (``PyTreeSave`` / ``JsonSave`` items of ``jax.Array``,
numpy and scalar leaves, each written by this process; a ``StandardSave`` is saved as the
``PyTreeSave`` it wraps), without OCDBT and in row-band chunks (``_registry``), so that a
restore on the node maps each chunk file into the restored array (``fleet/step_files.py``).

Who calls what, on which host (every process that calls the manager):

- ``applies(mngr, options, args)`` and ``save(mngr, options, step, args, keep)``
  (``multitier/local_steps.py``: the loop's thread decides, the background thread saves);
- ``resume(mngr, options, keep, abstract_state, newest_storage, ...)`` (``preemption.resume``
  through ``local_steps.resume_on_nodes``, before the storage
  steps): one key-value round among the manager's processes (each publishes the steps its node
  holds newer than the newest storage step; the leader publishes those every process holds),
  then the newest of them each process restores from its own node, every process agreeing on
  each step tried, as for any step. Node steps newer than the one chosen (or all, when none
  is) are deleted on each node: a rolled-back run saved them.

With ``Options.local_copies=2`` (multi-controller JAX), each node step is also copied to the
node of this process's partner (a process of another slice, ``fleet/partners.py``) on the same
background thread once saved (``node_partners.copy_to_partner``, ``fleet/node_copy.py``): no
key-value request after the job's first copy. A resume counts those copies: a step is restorable when
every process's node holds its part or a node keeps a copy of it, and a process whose node lacks
its part (a new node in place of a lost one) fetches it from that copy before restoring.

Orbax v1's ``training.Checkpointer`` saves node steps too: its checkpointable (a tree) is saved
as a ``PyTreeSave`` under its name, with the save's ``custom_metadata``, a checkpointable that is
not a tree (a v1 data iterator) by v1's own handler as a loop item (below), and a resume of a v1
Checkpointer restores the tree (``_restore``, ``node_layout.AUTO_ITEM``) as v1's ``load`` would
return it.

Orbax's emergency manager (the drop-in of ``multitier/emergency.py``) saves node steps into its
``local_directory`` (``node_layout.tier``), and lists, restores and deletes them there
(``listed``, ``restore_items``, ``delete``; its restart through ``resume`` with ``item='state'``).

A ``Composite`` item only its own handler can save (a data iterator, whose handler reads the
iterator's position as it saves; a custom handler's arguments) is saved by that handler in the
loop's thread into the node, and moved into the step by its save (``node_loop_items.py``);
restores with that item's restore arguments read it through the same handler
(``_restore_items``).

Not done on the nodes yet (those saves keep their local-only steps in storage's records, the
hidden manager of ``multitier/local_steps.py``): an item whose handler saves in the background
(a v0 manager's ``AsyncCheckpointHandler`` other than Orbax's PyTree and JSON ones), a save of
such items alone (no tree beside them), the legacy ``items=`` form, Pathways (the colocated
transport).

A resume onto another process count (or with processes on other processes' nodes) restores
a node step onto the current layout (``node_gather.py``): each part of a node step records
which process saved each device (``node_layout.write_processes``), each process says which
parts its node holds (its own steps, others' steps, partner copies), and each process fetches
the parts its devices overlap now from the nodes holding them, joins them and restores. Where
a part some process needs is on no live node, every process passes the step over and the
resume goes on to an older step, or to storage (a state whole in every slice needs one
slice's parts only). Where node steps lie: ``node_layout.py``; their partner copies:
``node_partners.py``; the resume's round: ``node_round.py`` (its verdict, pure:
``plan/node_verdict.py``).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable
import weakref

import jax
import numpy as np
import orbax.checkpoint as ocp

from orbax_pathways._compat import jax_distributed
from orbax_pathways._compat import orbax_logs
from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways._compat import orbax_process_local
from orbax_pathways._compat import orbax_v1_training as _v1
from orbax_pathways._util import said
from orbax_pathways.coord import rounds
from orbax_pathways.multitier import local_detach
from orbax_pathways.multitier import node_gather
from orbax_pathways.multitier import node_layout
from orbax_pathways.multitier import node_loop_items
from orbax_pathways.multitier import node_partners
from orbax_pathways.multitier import node_round
from orbax_pathways.plan import node_parts
from orbax_pathways.tier import fsafe

log = logging.getLogger('orbax_pathways')

_TREES = (ocp.args.StandardSave, ocp.args.PyTreeSave)
# The argument types the node manager's own handlers take (``_registry``).
_TREE_ARG_TYPES = (ocp.args.PyTreeSave, ocp.args.PyTreeRestore)
_ARG_TYPES = _TREE_ARG_TYPES + (ocp.args.JsonSave, ocp.args.JsonRestore)
# Manager -> this process's manager of its node steps (built at the first node save or resume).
_managers: 'weakref.WeakKeyDictionary[Any, Any]' = weakref.WeakKeyDictionary()


_LEAVES = (jax.Array, np.ndarray, np.number, int, float)


def _tree_leaves_ok(item: Any) -> bool:
  return all(isinstance(x, _LEAVES) for x in jax.tree.leaves(item))


def _v1_tree(a: Any) -> Any:
  """The tree an Orbax v1 checkpointable holds (its compatibility ``Args``, what v1's
  ``training.Checkpointer`` hands its v0 manager), or None when ``a`` is not one."""
  return a.checkpointable if isinstance(a, _v1.v1_args_type()) else None


def _convertible(a: Any) -> bool:
  if isinstance(a, ocp.args.Composite):
    return all(_convertible(v) for v in a.values())
  if node_loop_items.is_staged(a):
    return True
  if isinstance(a, _TREES):
    return _tree_leaves_ok(a.item)
  tree = _v1_tree(a)
  if tree is not None:
    return isinstance(tree, (dict, list, tuple)) and _tree_leaves_ok(tree)
  return isinstance(a, ocp.args.JsonSave)


def node_args(a: Any) -> Any:
  """The node manager's arguments for ``a`` (``_convertible``): ``StandardSave`` as the
  ``PyTreeSave`` it wraps (the same files), a v1 checkpointable's tree as a ``PyTreeSave``
  (what v1's PyTree handler writes too), the others as they are."""
  if isinstance(a, ocp.args.Composite):
    return ocp.args.Composite(**{k: node_args(v) for k, v in a.items()})
  if isinstance(a, ocp.args.StandardSave):
    return ocp.args.PyTreeSave(a.item, save_args=a.save_args)
  tree = _v1_tree(a)
  return ocp.args.PyTreeSave(tree) if tree is not None else a


@functools.lru_cache(maxsize=1)
def _device_processes() -> tuple[tuple[int, int], ...]:
  """(device id, process) of every device of this job (the same at every save)."""
  return tuple((d.id, d.process_index) for d in jax.devices())


def applies(mngr: Any, options: Any, args: Any, loop_items: dict | None = None) -> bool:
  """Whether this local-only save of ``mngr`` goes to the nodes: ``Options.local_steps_in``
  is ``'nodes'``, a tier directory is named, and ``args`` (the detached ``args=``) are trees of
  ``jax.Array``, numpy and scalar leaves, or JSON, but for ``Composite`` items a synchronous
  handler of ``mngr`` saves in the loop's thread (a data iterator's; ``loop_items``: such items
  detached apart, ``local_detach``); one log line, once per manager, when they are not."""
  if getattr(options, 'local_steps_in', 'storage') != 'nodes':
    return False
  if not orbax_process_local.install():  # this Orbax lacks a target: warned once, storage path
    return False
  if node_layout.tier_root(options, mngr) is None:
    said.once(logging.WARNING, ('node-steps-no-tier', str(mngr.directory)),
              'orbax_pathways: Options.local_steps_in=%r needs a node-local tier directory '
              '(Options.tier_dir or ORBAX_PATHWAYS_TIER_DIR); the local-only steps of %s '
              'keep their records in storage.', 'nodes', mngr.directory)
    return False
  # Items node steps cannot save from copies: their handlers save them in the loop's thread.
  given, loop = local_detach.split(args, _convertible) if args is not None else (None, {})
  loop = {**loop, **(loop_items or {})}
  if (given is None or not _convertible(given)
      or any(node_loop_items.handler_for(mngr, k, v) is None for k, v in loop.items())):
    said.once(logging.INFO, ('node-steps-args', str(mngr.directory)),
              'orbax_pathways: the local-only steps of %s keep their records in storage: their '
              'arguments are not trees of jax.Array, numpy and scalar leaves, JSON, or items '
              'a synchronous handler saves (Options.local_steps_in=%r '
              'saves those on the nodes only).', mngr.directory, 'nodes')
    return False
  return True


def _registry(options: Any) -> Any:
  """The node manager's handlers: Orbax's PyTree and JSON handlers for one process, whose
  ``jax.Array`` handler writes every shard this process holds (the package's handlers, with the
  installed ``options``)."""
  from orbax_pathways.frontends import orbax_v0  # pylint: disable=g-import-not-at-top
  me = _oms.process_index()
  mp = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={me},
                                          barrier_sync_key_prefix=f'orbax_pathways_node_{me}')
  numpy = orbax_v0.ProxyNumpyHandler(options=options)
  scalar = orbax_v0.ProxyScalarHandler(options=options)
  numpy.every_process = scalar.every_process = True
  arrays = orbax_v0.ProxyArrayHandler(options=options, primary_host=None, replica_id=None,
                                      use_replica_parallel=False)
  arrays.split_axes = (0,)  # row bands: each chunk one run of its shard (mapped at restore)
  types = ocp.type_handlers.create_type_handler_registry(
      (int, scalar), (float, scalar), (np.number, scalar), (np.ndarray, numpy),
      (jax.Array, arrays))
  # Without OCDBT: each chunk is a file of its own on the node, which a restore on this node
  # maps into the restored array in place of reading and copying it (``fleet/step_files.py``).
  tree = ocp.PyTreeCheckpointHandler(multiprocessing_options=mp, type_handler_registry=types,
                                     use_ocdbt=False)
  json = ocp.JsonCheckpointHandler(multiprocessing_options=mp)
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for args_type in _ARG_TYPES:
    registry.add(None, args_type, tree if args_type in _TREE_ARG_TYPES else json)
  return registry, mp


def manager(mngr: Any, options: Any, keep: int) -> Any | None:
  """This process's manager of ``mngr``'s node steps (built once), or None without a tier."""
  found = _managers.get(mngr)
  if found is not None:
    return found
  root = node_layout.tier_root(options, mngr)
  if root is None:
    return None
  registry, mp = _registry(options)
  orbax_logs.install()  # Orbax's "no OCDBT trees to merge" at each save: node steps have none
  node_loop_items.discard(node_layout.directory(mngr, root))  # an earlier run's, unsaved
  node = ocp.CheckpointManager(
      node_layout.directory(mngr, root),
      options=ocp.CheckpointManagerOptions(
          save_interval_steps=1, max_to_keep=node_layout.kept(keep), create=False,
          save_root_metadata=False, enable_async_checkpointing=False,
          multiprocessing_options=mp),
      handler_registry=registry)
  _oms.mark_node_manager(node, mngr)
  _managers[mngr] = node
  return node


def directory_of(mngr: Any) -> str | None:
  """The directory of ``mngr``'s node steps on this node, once its node manager is built."""
  found = _managers.get(mngr)
  return None if found is None else str(found.directory)


def close(mngr: Any) -> None:
  """Closes this process's manager of ``mngr``'s node steps, if one was built."""
  found = _managers.pop(mngr, None)
  if found is not None:
    found.close()


def _node(mngr: Any, options: Any, keep: int) -> Any:
  node = manager(mngr, options, keep)
  if node is None:
    raise RuntimeError(f'orbax_pathways: no node-local tier directory for the local-only '
                       f'steps of {mngr.directory}')
  return node


def stage(mngr: Any, options: Any, keep: int, step: int, items: dict[str, Any]) -> dict[str, Any]:
  """``node_loop_items.stage`` into this process's node steps of ``mngr`` (the loop's thread,
  ``multitier/local_steps.py``): the arguments standing for ``items`` in ``save``'s."""
  return node_loop_items.stage(mngr, str(_node(mngr, options, keep).directory), step, items)


def joined(args: Any, staged: dict[str, Any]) -> Any:
  """``args`` (a ``Composite``) with the ``staged`` items (``stage``) beside its own."""
  return ocp.args.Composite(**dict(args.items()), **staged)


def save(mngr: Any, options: Any, step: int, args: Any, keep: int,
         custom_metadata: dict | None = None) -> None:
  """Saves ``args`` (the detached ``args=``, its loop items staged: ``stage``) as node step
  ``step`` of ``mngr`` on this process alone, with the save's ``custom_metadata`` (the
  background thread of ``multitier/local_steps.py``; the loop's thread for the preemption step,
  whose loop items are staged here)."""
  node = _node(mngr, options, keep)
  try:
    given, loop = local_detach.split(args, _convertible)
    if loop:
      given = joined(given, stage(mngr, options, keep, step, loop))
    with orbax_process_local.alone(_oms.process_index()):
      node.save(step, args=node_args(given), force=True, custom_metadata=custom_metadata)
  finally:
    node_loop_items.discard(str(node.directory), step)
  node_layout.write_processes(os.path.join(str(node.directory), str(step)),
                              jax_distributed.process_count(),
                              _device_processes())


def _others(node: Any, steps: list[int], item: str | None) -> list[int]:
  """Of ``steps`` (node steps another process saved on this node: a restart put this process
  on another's node, or onto another process count), those a resume may restore its tree
  from: a step of that one tree alone (``item``, else any one name), no JSON beside it (a data
  iterator's state is its process's own). A state replicated over slices is the same on every
  slice's node, so such a step holds what this process needs whenever its devices hold the
  same part of it as the saver's did; where it does not, the restore raises (a shard no record
  covers) and every process passes the step over (``resume``)."""
  out = []
  for s in steps:
    items = fsafe.subdirs(os.path.join(str(node.directory), str(s)))
    if len(items) == 1 and (item in (None, node_layout.AUTO_ITEM) or items == [item]):
      out.append(s)
  return out


def _from_partner_copy(mngr: Any, options: Any, root: str, node: Any, step: int,
                       restore: Callable[[int], Any], timeout_s: float,
                       why: BaseException) -> Any | None:
  """This process's part of node step ``step`` restored from the copy its partner keeps
  (``Options.local_copies=2``), fetched over this node's failed one; None where there is no
  partner, its server did not publish its address (it keeps no copies) or the copy fails too.
  ``restore(step)``: the step restored from this node (``resume``'s). One key-value read, only
  after a failure."""
  to = node_partners.partner(mngr, options)
  client = jax_distributed.distributed_client()
  if to is None or client is None:
    return None
  address = rounds.try_read(client, rounds.partner_address_key(to))
  if not address:
    return None
  try:
    node_partners.fetch(mngr, options, root, step, (to, address), timeout_s)
    with orbax_process_local.alone(_oms.process_index()):
      node.reload()
      state = restore(step)
  except Exception as e:  # pylint: disable=broad-except  (the step is passed over as before)
    log.warning('orbax_pathways.preemption.resume: node step %d failed on this node (%s), and '
                'restoring it from process %d\'s node (this process\'s partner, which keeps its '
                'copies) failed too (%s: %s).', step, f'{type(why).__name__}: {why}'[:300],
                to, type(e).__name__, str(e)[:300])
    return None
  log.warning('orbax_pathways.preemption.resume: node step %d failed on this node (%s); '
              'restored from the copy process %d keeps.', step,
              f'{type(why).__name__}: {why}'[:300], to)
  return state


def _restore(node: Any, step: int, abstract_state: Any, item: str | None = None) -> Any:
  """Node step ``step`` restored by this process's node manager as ``abstract_state``: its
  item ``item`` (Orbax's emergency manager's ``state``), else its one item, ``default`` (a v0
  save's) or another name; for an Orbax v1 ``training.Checkpointer`` (``node_layout.AUTO_ITEM``)
  the tree its ``load`` returns, beside a data iterator too (``node_layout.tree_item``)."""
  tree = ocp.args.PyTreeRestore(
      abstract_state, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))
  step_dir = os.path.join(str(node.directory), str(step))
  name = node_layout.tree_item(step_dir, item)
  if name is None:
    raise ValueError(f'node step {step} holds the items {fsafe.subdirs(step_dir)}: a resume '
                     f'restores a step of one tree{"" if item is None else f" ({item!r})"}')
  if item is None and name == 'default':
    return node.restore(step, args=tree)
  return node.restore(step, args=ocp.args.Composite(**{name: tree}))[name]


def _restore_at(options: Any, directory: str, *, step: int, abstract_state: Any,
                item: str | None) -> Any:
  """Step ``step`` of the Orbax step directory ``directory`` (a node step joined from its
  parts, ``node_gather.py``) restored by this process alone with the node steps' handlers
  (``_restore``)."""
  registry, mp = _registry(options)
  with orbax_process_local.alone(_oms.process_index()):
    joined = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(
            create=False, save_root_metadata=False, enable_async_checkpointing=False,
            read_only=True, multiprocessing_options=mp),
        handler_registry=registry)
    try:
      return _restore(joined, step, abstract_state, item)
    finally:
      joined.close()


def active(mngr: Any, options: Any) -> bool:
  """Whether ``mngr``'s local-only steps are node steps here (``Options.local_steps_in='nodes'``,
  this Orbax has the targets, a tier directory is named or assigned); no log line."""
  return (getattr(options, 'local_steps_in', 'storage') == 'nodes'
          and orbax_process_local.install() and node_layout.tier_root(options, mngr) is not None)


def _own(node: Any, me: int) -> list[int]:
  """The steps of ``node`` (just reloaded) that process ``me`` saved, newest first."""
  return sorted((s for s in node.all_steps()
                 if node_layout.saver(os.path.join(str(node.directory), str(s))) in (None, me)),
                reverse=True)


def listed(mngr: Any, options: Any, keep: int) -> list[int]:
  """This process's own node steps of ``mngr`` in its node, newest first (Orbax's emergency
  manager's listing of its local steps)."""
  node = manager(mngr, options, keep)
  if node is None:
    return []
  me = _oms.process_index()
  with orbax_process_local.alone(me):
    node.reload()
    return _own(node, me)


def _restore_items(node: Any, mngr: Any, options: Any, step: int, args: Any) -> Any:
  """``node.restore(step, args=args)``; where ``args`` name an item the node steps' handlers
  do not restore (a loop item's own restore arguments, ``node_loop_items``), through a manager
  of its own over the same directory that has ``mngr``'s handlers for such items too (the node
  manager's Orbax handler registry keeps the handler each item was saved with)."""
  if all(type(v) in _ARG_TYPES for v in args.values()):
    return node.restore(step, args=args)
  registry, mp = _registry(options)
  for (name, args_type), handler in _oms.handlers_of(mngr).get_all_entries().items():
    if name is not None and args_type not in _ARG_TYPES:
      registry.add(name, args_type, handler)
  own = ocp.CheckpointManager(
      node.directory, options=ocp.CheckpointManagerOptions(
          create=False, save_root_metadata=False, enable_async_checkpointing=False,
          read_only=True, multiprocessing_options=mp),
      handler_registry=registry)
  try:
    return own.restore(step, args=args)
  finally:
    own.close()


def _restore_others(node: Any, mngr: Any, options: Any, step: int, others: dict,
                    v1: Any) -> dict:
  """The items ``others`` of node step ``step`` beside its tree (``resume``), each by its own
  handler on this process alone: a v0 manager's through its handlers (``_restore_items``), an
  Orbax v1 Checkpointer's through v1's (``_v1.load_items``)."""
  if not others:
    return {}
  if v1 is not None:
    return _v1.load_items(v1, os.path.join(str(node.directory), str(step)), others)
  got = _restore_items(node, mngr, options, step, ocp.args.Composite(**others))
  return {name: got[name] for name in others}


def restore_items(mngr: Any, options: Any, keep: int, step: int, args: Any) -> Any:
  """``args`` (a ``Composite``) of node step ``step`` from this process's node alone (the
  caller agrees with the other processes on the outcome)."""
  node = manager(mngr, options, keep)
  if node is None:
    raise FileNotFoundError(f'no node-local tier directory for the node steps of '
                            f'{mngr.directory}')
  with orbax_process_local.alone(_oms.process_index()):
    node.reload()
    return _restore_items(node, mngr, options, step, args)


def restore_as_saved(mngr: Any, options: Any, keep: int, step: int, args: Any) -> Any:
  """``restore_items`` of a node step this process saved into its node with the job's current
  layout (its process count and which process holds each device); ``FileNotFoundError``
  otherwise (the caller agrees with the other processes on the outcome, and reads storage where
  any process could not). The emergency drop-in's restore of a storage step that is a node
  step too, as Orbax's class restores a step from its local copies first."""
  node = manager(mngr, options, keep)
  if node is not None:
    me = _oms.process_index()
    saved = node_layout.read_processes(os.path.join(str(node.directory), str(step)))
    here = (jax_distributed.process_count(),
            node_parts.encode_processes(_device_processes()))
    if saved is not None and saved == here:
      with orbax_process_local.alone(me):
        node.reload()
        if step in _own(node, me):
          return _restore_items(node, mngr, options, step, args)
  raise FileNotFoundError(f'no node step {step} this process saved with this layout in its node '
                          f'({directory_of(mngr)})')


def delete(mngr: Any, options: Any, keep: int, step: int) -> None:
  """Deletes this process's node step ``step`` of ``mngr``, if its node holds it."""
  node = manager(mngr, options, keep)
  if node is None:
    return
  with orbax_process_local.alone(_oms.process_index()):
    node.reload()
    if step in node.all_steps():
      node.delete(step)


def resume(mngr: Any, options: Any, keep: int, abstract_state: Any,
           newest_storage: int | None, *, all_ok: Callable[[bool, int], bool],
           timeout_s: float, item: str | None = None, others: dict | None = None,
           v1: Any = None) -> tuple[int, Any] | None:
  """``(step, state)`` from the newest node step newer than ``newest_storage`` that every
  process restored from its own node, or None (module docstring). Every process of ``mngr``
  calls it, whether or not its node holds any. ``all_ok(ok, step)``: whether every process
  restored ``step`` (``multitier.resume``'s agreement round); ``timeout_s``: the longest
  silence of the round that agrees on the candidates; ``item``: the step's item that
  ``abstract_state`` describes (``_restore``). ``others``: the step's other items to restore
  beside it (a data iterator; v0: name -> restore arguments, v1, the Orbax v1 Checkpointer
  ``v1``: name -> abstract checkpointable; ``_restore_others``); the state is then ``(tree,
  {name: item})``, and only a step this process saved, onto the layout it saved, is taken."""
  if getattr(options, 'local_steps_in', 'storage') != 'nodes' or not orbax_process_local.install():
    return None
  node = manager(mngr, options, keep)
  root = node_layout.tier_root(options, mngr)
  if node is None or root is None:
    return None
  me = _oms.process_index()
  alone = lambda: orbax_process_local.alone(me)  # pylint: disable=unnecessary-lambda-assignment

  def own(step: int) -> Any:  # this node's step (inside ``alone``, reloaded)
    state = _restore(node, step, abstract_state, item)
    return (state if others is None
            else (state, _restore_others(node, mngr, options, step, others, v1)))

  with alone():
    node.reload()
    listed = [s for s in node.all_steps() if newest_storage is None or s > newest_storage]
  # This process's own steps; a node this process now runs on may hold another's (``_others``).
  held = [s for s in listed
          if node_layout.saver(os.path.join(str(node.directory), str(s))) in (None, me)]
  # With other items (a data iterator: its process's own), only this process's own steps.
  other = _others(node, [s for s in listed if s not in held], item) if not others else []
  digest = node_layout.digest_of(mngr)
  copies = node_partners.copies_held(root, digest, newest_storage)
  # The parts of steps saved by another process count or by another process (restored onto
  # the current layout): said in the round only for those, so the usual resume (the same
  # processes on the same nodes) publishes what it did before.
  parts: dict[int, list[int]] = {}
  counts: dict[int, int] = {}
  copied: set[tuple[int, int]] = set()  # of those, the parts this node keeps as copies
  n = jax_distributed.process_count()
  in_copies = node_layout.copies_dir(root, digest) + os.sep
  for s in sorted(set(listed).union(*copies.values())):
    here = node_gather.parts_here(root, digest, s)
    saved = next((c for c in map(node_layout.read_processes, here.values()) if c), None)
    # Parts whose layout this node does not know (a kill between a step's commit and its
    # ``_node_processes.msgpack``) are said too: another node's part may know it, and the
    # step can then be restored onto another layout with this node's part in it.
    if here and (saved is None or saved[0] != n or s in other):
      parts[s] = sorted(here)
      if saved is not None:
        counts[s] = saved[0]
      copied.update((s, w) for w, path in here.items() if path.startswith(in_copies))
  published: list[str] = []
  agreed, fetch, elastic = (
      node_round.agreed(mngr, options, held, copies, timeout_s, other, parts, counts,
                        published, frozenset(copied))
      if abstract_state is not None else ([], {}, {}))
  chosen = None
  for step in agreed:
    try:
      if step in elastic and others:
        raise ValueError(f'node step {step} would be restored onto another layout, and its '
                         f'items {sorted(others)} are restored only by the process that saved '
                         'them, onto its layout')
      if step in elastic:
        state = node_gather.restore(
            root, digest, step, elastic[step], elastic[step].first, abstract_state, item,
            timeout_s,
            functools.partial(_restore_at, options, step=step,
                              abstract_state=abstract_state, item=item),
            elastic[step].other)
        if others is not None:  # ``args`` naming the tree alone
          state = (state, {})
      else:
        if step in fetch:
          node_partners.fetch(mngr, options, root, step, fetch[step], timeout_s)
          held.append(step)
        with alone():
          node.reload()
          state = own(step)
      error = None
    except Exception as e:  # pylint: disable=broad-except
      state, error = None, e
      if step in held and step not in fetch and step not in elastic:  # a damaged own step
        state = _from_partner_copy(mngr, options, root, node, step, own, timeout_s, e)
        error = None if state is not None else e
    if all_ok(error is None, step):
      log.info('orbax_pathways.preemption.resume: resumed from node step %d (newer than the '
               'newest storage step, %s), %s.', step, newest_storage,
               'restored onto this layout from the parts the nodes hold' if step in elastic
               else 'every process from its node' if step in held or step in fetch
               else 'every process from its node (this one from the step another process '
               'saved there)')
      chosen = (step, state)
      break
    log.warning('orbax_pathways.preemption.resume: node step %d cannot be restored (%s); '
                'trying the next older step.', step,
                f'{type(error).__name__}: {str(error)[:500]}' if error is not None
                else 'another process of this job could not')
  with alone():
    node.reload()
    kept = set(node.all_steps())
  for s in sorted(set(held) | set(listed)):  # a rolled-back run's (another process's too):
    if chosen is None or s > chosen[0]:     # never resumed from later, nor in a save's way
      if s in kept:
        with alone():
          node.delete(s)
      else:  # a fetch or a save that did not end whole: not Orbax's to delete
        fsafe.remove_tree(os.path.join(str(node.directory), str(s)))
  # And the copies of them this node keeps.
  node_partners.drop_copies(root, digest, copies,
                            None if chosen is None else chosen[0])
  # Every process is past the last step tried (its agreement round): no one looks a part up.
  client = jax_distributed.distributed_client()
  for name in published:
    rounds.delete_quietly(client, name)
  return chosen
