"""Local-only steps on the nodes alone (``Options.local_steps_in='nodes'``, ``docs/multi_tier.md``).

Each process saves its part of a local-only step by itself into its node: a synchronous
``CheckpointManager`` of this process only (``active_processes={process}``,
``primary_host=None``) over ``<tier directory>/.node-steps/<digest of the manager's
directory>``, whose array handler writes every shard this process holds (Orbax's
``replica_id=None``: its save alone is complete for what it holds) and whose Orbax operation ids
and signals are its own (``_compat/orbax_process_local.alone``). So a local-only save makes no
storage request and meets no other process (no barrier: Orbax's own skip a manager of one
process, and its signals stay in the save's namespace), and a storage
save never waits for it (nor it for a storage save). Each node keeps its newest ``keep`` steps
(Orbax's own retention of that manager, on this node only). The step is in Orbax's format there
(``PyTreeSave`` / ``JsonSave`` items of ``jax.Array``, numpy and scalar leaves, each written by
this process; a ``StandardSave`` is saved as the ``PyTreeSave`` it wraps).

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

Not done on the nodes yet (those saves keep their local-only steps in storage's records, the
hidden manager of ``multitier/local_steps.py``): Orbax's emergency manager and v1's
``training.Checkpointer``, arguments other than trees and JSON, Pathways (the colocated
transport). A resume onto another process count, or after a node was lost, passes node steps
over (some process cannot restore its part) and resumes from storage; partner copies of node
steps are not made.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable
import weakref

import jax
import numpy as np
import orbax.checkpoint as ocp

from orbax_pathways._compat import jax_distributed
from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways._compat import orbax_process_local
from orbax_pathways._util import said
from orbax_pathways.coord import rounds
from orbax_pathways.format import names as format_names
from orbax_pathways.tier import config as tier_config
from orbax_pathways.tier import fsafe

log = logging.getLogger('orbax_pathways')

_TREES = (ocp.args.StandardSave, ocp.args.PyTreeSave)
# Manager -> this process's manager of its node steps (built at the first node save or resume).
_managers: 'weakref.WeakKeyDictionary[Any, Any]' = weakref.WeakKeyDictionary()


def tier_root(options: Any) -> str | None:
  """This node's tier directory when the user named one (``Options.tier_dir``, else
  ``ORBAX_PATHWAYS_TIER_DIR``) and it passes the private-root check; None otherwise."""
  cfg = tier_config.usable(tier_config.resolve(tier_config.named_dir(options.tier_dir)))
  return cfg.tier_dir if cfg is not None and cfg.explicit else None


def directory(mngr: Any, root: str) -> str:
  """``<root>/.node-steps/<digest of mngr.directory>``, made ``0700`` (never through a
  symlink)."""
  digest = hashlib.sha256(str(mngr.directory).encode()).hexdigest()[:16]
  return fsafe.private_dirs(root, format_names.NODE_STEPS_DIR, digest)


_LEAVES = (jax.Array, np.ndarray, np.number, int, float)


def _tree_leaves_ok(item: Any) -> bool:
  return all(isinstance(x, _LEAVES) for x in jax.tree.leaves(item))


def _convertible(a: Any) -> bool:
  if isinstance(a, ocp.args.Composite):
    return all(_convertible(v) for v in a.values())
  if isinstance(a, _TREES):
    return _tree_leaves_ok(a.item)
  return isinstance(a, ocp.args.JsonSave)


def node_args(a: Any) -> Any:
  """The node manager's arguments for ``a`` (``_convertible``): ``StandardSave`` as the
  ``PyTreeSave`` it wraps (the same files), the others as they are."""
  if isinstance(a, ocp.args.Composite):
    return ocp.args.Composite(**{k: node_args(v) for k, v in a.items()})
  if isinstance(a, ocp.args.StandardSave):
    return ocp.args.PyTreeSave(a.item, save_args=a.save_args)
  return a


def applies(mngr: Any, options: Any, args: Any) -> bool:
  """Whether this local-only save of ``mngr`` goes to the nodes: ``Options.local_steps_in``
  is ``'nodes'``, a tier directory is named, and ``args`` (the detached ``args=``) are trees of
  ``jax.Array``, numpy and scalar leaves, or JSON (one log line, once per manager, when they
  are not)."""
  if getattr(options, 'local_steps_in', 'storage') != 'nodes':
    return False
  if not orbax_process_local.install():  # this Orbax lacks a target: warned once, storage path
    return False
  if tier_root(options) is None:
    said.once(logging.WARNING, ('node-steps-no-tier', str(mngr.directory)),
              'orbax_pathways: Options.local_steps_in=%r needs a node-local tier directory '
              '(Options.tier_dir or ORBAX_PATHWAYS_TIER_DIR); the local-only steps of %s '
              'keep their records in storage.', 'nodes', mngr.directory)
    return False
  if args is None or not _convertible(args):
    said.once(logging.INFO, ('node-steps-args', str(mngr.directory)),
              'orbax_pathways: the local-only steps of %s keep their records in storage: their '
              'arguments are not trees of jax.Array, numpy and scalar leaves, or JSON '
              '(Options.local_steps_in=%r '
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
  types = ocp.type_handlers.create_type_handler_registry(
      (int, scalar), (float, scalar), (np.number, scalar), (np.ndarray, numpy),
      (jax.Array, orbax_v0.ProxyArrayHandler(options=options, primary_host=None,
                                             replica_id=None, use_replica_parallel=False)))
  tree = ocp.PyTreeCheckpointHandler(multiprocessing_options=mp, type_handler_registry=types)
  json = ocp.JsonCheckpointHandler(multiprocessing_options=mp)
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for args_type, handler in ((ocp.args.PyTreeSave, tree), (ocp.args.PyTreeRestore, tree),
                             (ocp.args.JsonSave, json), (ocp.args.JsonRestore, json)):
    registry.add(None, args_type, handler)
  return registry, mp


def manager(mngr: Any, options: Any, keep: int) -> Any | None:
  """This process's manager of ``mngr``'s node steps (built once), or None without a tier."""
  found = _managers.get(mngr)
  if found is not None:
    return found
  root = tier_root(options)
  if root is None:
    return None
  registry, mp = _registry(options)
  node = ocp.CheckpointManager(
      directory(mngr, root),
      options=ocp.CheckpointManagerOptions(
          save_interval_steps=1, max_to_keep=max(1, keep), create=False,
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


def save(mngr: Any, options: Any, step: int, args: Any, keep: int) -> None:
  """Saves ``args`` (the detached ``args=``) as node step ``step`` of ``mngr`` on this process
  alone (the background thread of ``multitier/local_steps.py``)."""
  node = manager(mngr, options, keep)
  if node is None:
    raise RuntimeError(f'orbax_pathways: no node-local tier directory for the local-only '
                       f'steps of {mngr.directory}')
  with orbax_process_local.alone(_oms.process_index()):
    node.save(step, args=node_args(args), force=True)


def _agreed(mngr: Any, held: list[int], timeout_s: float) -> list[int]:
  """The steps of ``held`` that every process of ``mngr`` holds, newest first: one round (each
  member publishes its steps, the leader publishes the steps all hold)."""
  client = jax_distributed.distributed_client()
  part = _oms.manager_participants(mngr)
  n, me = jax_distributed.process_count(), _oms.process_index()
  if client is None or n <= 1 or part.size(n) <= 1 or not part.includes(me, n):
    return sorted(held, reverse=True)
  seq = rounds.sequence(part.name('node_steps'), keep=1)

  def common(lists: list[str]) -> str:
    held_by_all = set.intersection(*({int(s) for s in v.split(',') if s} for v in lists))
    return ','.join(map(str, sorted(held_by_all, reverse=True)))

  verdict = rounds.agree(
      client, seq, seq.next(), me=me, members=part.members(n), count=n, leader=part.leader(n),
      value=','.join(map(str, held)), decide=common, timeout_s=timeout_s,
      what=f'orbax_pathways: node steps every process holds, {part.describe(n)}')
  return [int(s) for s in verdict.split(',') if s]


def resume(mngr: Any, options: Any, keep: int, abstract_state: Any,
           newest_storage: int | None, *, all_ok: Callable[[bool, int], bool],
           timeout_s: float) -> tuple[int, Any] | None:
  """``(step, state)`` from the newest node step newer than ``newest_storage`` that every
  process restored from its own node, or None (module docstring). Every process of ``mngr``
  calls it, whether or not its node holds any. ``all_ok(ok, step)``: whether every process
  restored ``step`` (``multitier.resume``'s agreement round); ``timeout_s``: the longest
  silence of the round that agrees on the candidates."""
  if getattr(options, 'local_steps_in', 'storage') != 'nodes' or not orbax_process_local.install():
    return None
  node = manager(mngr, options, keep)
  if node is None:
    return None
  alone = lambda: orbax_process_local.alone(_oms.process_index())  # pylint: disable=unnecessary-lambda-assignment
  with alone():
    node.reload()
    held = [s for s in node.all_steps() if newest_storage is None or s > newest_storage]
  agreed = _agreed(mngr, held, timeout_s) if abstract_state is not None else []
  chosen = None
  for step in agreed:
    try:
      with alone():
        state = node.restore(step, args=ocp.args.PyTreeRestore(
            abstract_state,
            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state)))
      error = None
    except Exception as e:  # pylint: disable=broad-except
      state, error = None, e
    if all_ok(error is None, step):
      log.info('orbax_pathways.preemption.resume: resumed from node step %d (newer than the '
               'newest storage step, %s), every process from its own node.', step,
               newest_storage)
      chosen = (step, state)
      break
    log.warning('orbax_pathways.preemption.resume: node step %d cannot be restored (%s); '
                'trying the next older step.', step,
                f'{type(error).__name__}: {str(error)[:500]}' if error is not None
                else 'another process of this job could not')
  for s in held:  # a rolled-back run's: never resumed from later, never in a new save's way
    if chosen is None or s > chosen[0]:
      with alone():
        node.delete(s)
  return chosen
