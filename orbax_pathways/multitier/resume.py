"""Resume: restore the newest complete step that restores, falling back past damaged ones.

Called by the user's program on every controller process at start (``preemption.resume``), before
training. All processes that call the manager (its ``active_processes``; every process by
default) agree on each step's outcome (one round through the coordination service's key-value
store per step tried), so they resume from the same step.
"""

from __future__ import annotations

from typing import Any, Callable
import warnings

from absl import logging

from orbax_pathways import errors
from orbax_pathways.multitier import local_steps
from orbax_pathways.multitier import node_layout
from orbax_pathways.multitier import resume_args
from orbax_pathways.manager import retention
from orbax_pathways.coord import rounds
from orbax_pathways._compat import jax_distributed
from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways._compat import orbax_v1_training as _v1
from orbax_pathways.coord import agreement as agreement_lib


def latest_complete_step(mngr, exclude=()) -> int | None:
  """Newest step in ``mngr.directory`` that is complete per ``retention.is_step_complete``."""
  steps = _oms.manager_steps_on_disk(mngr)
  for step, path in reversed(steps):
    if step not in exclude and retention.is_step_complete(path):
      return step
  return None


def all_processes_ok(mngr, ok: bool, step: int) -> bool:
  """Whether every process that calls ``mngr`` (its ``active_processes``) restored ``step``
  (one KV round among them)."""
  client = jax_distributed.distributed_client()
  part = _oms.manager_participants(mngr)
  n, me = jax_distributed.process_count(), _oms.process_index()
  if client is None or n <= 1 or part.size(n) <= 1 or not part.includes(me, n):
    return ok
  seq = rounds.sequence(part.name('resume'), keep=1)
  # The n-th resume round of these participants on this process, on the step it tried.
  verdict = rounds.agree(
      client, seq, seq.next(suffix=str(step)), me=me, members=part.members(n), count=n,
      leader=part.leader(n), value='1' if ok else '0',
      decide=lambda flags: '1' if all(f == '1' for f in flags) else '0',
      timeout_s=agreement_lib.current().timeout_s,
      what=f'orbax_pathways: resume agreement on step {step} among {part.describe(n)}')
  return verdict == '1'


def _still_complete(mngr, step: int) -> bool:
  return any(s == step and retention.is_step_complete(p)
             for s, p in _oms.manager_steps_on_disk(mngr))


def _damaged_warning(step: int, path, error: BaseException | None, fallback_step: int) -> str:
  what = ('another process of this job failed to restore it' if error is None else
          f'{type(error).__name__}: {str(error)[:1000]}')
  instead = (f'Resuming step {step} from the nodes\' copy of it (a node step) instead'
             if fallback_step == step else f'Resuming from step {fallback_step} instead')
  return (f'orbax_pathways.preemption.resume: step {step} at {path} is DAMAGED and was '
          f'skipped ({what}). {instead}. The damaged step stays '
          f'on storage for inspection (`orbax-pathways verify {path}`); this manager no longer '
          'lists it, so saving that step again replaces it. Pass fallback=False to raise '
          'instead.')


def _try_restore(mngr, step: int, abstract_state: Any, v1: Any = None,
                 args: Any = None) -> tuple[Any, BaseException | None]:
  """``mngr.restore(step)`` with ``abstract_state`` (or ``args``, every item's: ``resume``):
  (state, None), or (None, the error). ``v1``: the Orbax v1 ``training.Checkpointer`` whose
  manager (or hidden manager of local-only steps) ``mngr`` is; its steps are read as v1's
  ``load`` (``load_checkpointables``) reads them."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  try:
    if v1 is None:
      return mngr.restore(step, args=(args if args is not None
                                      else ocp.args.StandardRestore(abstract_state))), None
    return _v1.load(v1, _oms.manager_step_path(mngr, step), abstract_state, args), None
  except Exception as e:  # pylint: disable=broad-except
    return None, e


def _from_local_step(mngr, abstract_state: Any, newest_storage: int | None, listed: list[int],
                     v1: Any = None, args: Any = None):
  """``(step, state)`` of the newest local-only step of ``listed`` newer than ``newest_storage``
  that every process restored (one agreement round per step tried, as for storage steps), or
  None. A step that cannot be completed (a chunk in no live process's tier:
  ``LocalStepIncompleteError``, or any other failure on some process) is passed over with one
  log line naming it and why."""
  inner = local_steps.local_manager(mngr)
  if inner is None:
    return None
  for step in [s for s in listed if newest_storage is None or s > newest_storage]:
    state, error = _try_restore(inner, step, abstract_state, v1, args)
    if all_processes_ok(mngr, error is None, step):
      logging.info('orbax_pathways.preemption.resume: resumed from local-only step %d (newer '
                   'than the newest storage step, %s).', step, newest_storage)
      local_steps.drop_newer(mngr, step, listed)
      return step, state
    logging.warning('orbax_pathways.preemption.resume: local-only step %d cannot be restored '
                    '(%s); trying the next older step.', step,
                    f'{type(error).__name__}: {str(error)[:500]}' if error is not None
                    else 'another process of this job could not complete it')
  return None


def _report_damaged(mngr: Any, damaged: list[tuple[int, Any, BaseException | None]],
                    resumed: int) -> None:
  """The loud warning for each storage step that failed before ``resumed`` restored; they are
  dropped from ``mngr``'s listing so that training saves normally."""
  for s, p, err in damaged:
    message = _damaged_warning(s, p, err, resumed)
    logging.error(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    _oms.forget_step(mngr, s)


def resume(mngr, init_fn: Callable[[], Any], *, abstract_state: Any = None,
           fallback: bool = True, args: Any = None):
  """Returns ``(step, state)`` from the newest complete step that restores, or
  ``(None, init_fn())`` when the directory has no complete step.

  ``abstract_state`` goes to ``ocp.args.StandardRestore`` unchanged (None: restore with the saved
  shardings). If restoring the newest step fails (checksum mismatch, missing or truncated files),
  the next older step is tried, and once one restores, a loud warning (``RuntimeWarning`` and an
  ERROR log line) names each damaged step's path; the damaged steps are dropped from ``mngr``'s
  listing so that training saves normally. ``fallback=False`` raises the first error instead.
  Two consecutive failures of the same kind other than a checksum mismatch, or a
  ``TopologyError``, point at the request (``abstract_state``), not the data: the newest step's
  error is raised. If no step restores, ``RestoreError`` lists them all. A step deleted while it
  is read (another process's retention) is not damage: the newest step is looked up again.

  On the primary host, provably abandoned leftovers of interrupted deletes and saves are removed
  first (see ``retention``); work in progress of other processes (a trainer saving into this
  directory while an evaluator resumes) is left alone.

  ``mngr`` may also be Orbax v1's ``training.Checkpointer``: its steps (storage and local-only)
  are read as its ``load`` reads them (``abstract_state`` is ``load``'s), under its
  ``Context``.

  ``args``, in place of ``abstract_state``, for a step saved as several items (a data iterator
  beside the state): what the manager's own restore takes (v0: an ``ocp.args.Composite`` of
  restore arguments; v1: a dict of name -> abstract checkpointable, as for its
  ``load_checkpointables``), one of them the tree (``multitier/resume_args.py``). The step
  returned is one every item restored from, storage step, local-only step or node step, and the
  state is what that restore returns (the ``Composite`` or dict of restored items). A node step
  is then restored only by the process that saved it, onto the layout it saved (a data
  iterator's state is its process's own): a step of other processes is passed over.
  """
  mngr, v1 = _v1.v0_manager_of(mngr)
  split = None
  if args is not None:
    if abstract_state is not None:
      raise ValueError('orbax_pathways.preemption.resume: pass the tree\'s abstract state inside '
                       'args= (its StandardRestore, or its entry of the dict), not as well as '
                       'abstract_state=.')
    split = resume_args.split(args, v1 is not None)
  # What node steps restore: a v1 Checkpointer's step is read as its ``load`` reads a step (the
  # tree beside a data iterator too); a v0 manager's holds one tree; with ``args``, its tree
  # item, and the other items beside it.
  nodes: dict[str, Any] = {'item': None if v1 is None else node_layout.AUTO_ITEM}
  if split is not None:
    nodes = {'item': split.tree, 'others': split.others, 'v1': v1}
    abstract_state = split.abstract_state

  def from_nodes(found):
    if found is None or split is None:
      return found
    step, (tree, others) = found
    return step, resume_args.joined(split, tree, others, v1 is not None)

  mngr.wait_until_finished()
  if _oms.is_primary_host(_oms.manager_primary_host(mngr)) and not _oms.manager_read_only(mngr):
    retention.cleanup_leftovers(mngr.directory)
    retention.cleanup_abandoned_temporary_steps(mngr.directory)
  mngr.reload()
  # The steps each node holds alone (Options.local_steps_in='nodes'), v0's and v1's alike.
  found = local_steps.resume_on_nodes(
      mngr, abstract_state, latest_complete_step(mngr),
      all_ok=lambda ok, step: all_processes_ok(mngr, ok, step),
      timeout_s=agreement_lib.current().timeout_s, **nodes)
  if found is not None:
    return from_nodes(found)
  # The local-only steps, listed once before any agreement round (local_steps.drop_newer).
  _, listed = local_steps.newer_steps(mngr, None)
  found = _from_local_step(mngr, abstract_state, latest_complete_step(mngr), listed, v1, args)
  if found is not None:
    return found
  damaged: list[tuple[int, Any, BaseException | None]] = []
  vanished = 0
  while True:
    step = latest_complete_step(mngr, exclude={d[0] for d in damaged})
    if step is None:
      if damaged:
        raise errors.RestoreError(
            f'orbax_pathways.preemption.resume: no complete step in {mngr.directory} restores: '
            + '; '.join(f'step {s} ({p}): ' + (f'{type(e).__name__}: {str(e)[:300]}' if e else
                                               'failed on another process')
                        for s, p, e in damaged)) from damaged[0][2]
      local_steps.drop_newer(mngr, None, listed)
      return None, init_fn()
    path = _oms.manager_step_path(mngr, step)
    state, error = _try_restore(mngr, step, abstract_state, v1, args)
    if all_processes_ok(mngr, error is None, step):
      _report_damaged(mngr, damaged, step)
      local_steps.drop_newer(mngr, step, listed)
      return step, state
    if error is not None and not _still_complete(mngr, step):
      vanished += 1  # deleted meanwhile by a process saving here: look again
      if vanished <= 100:
        mngr.reload()
        continue
    if not fallback or isinstance(error, errors.TopologyError):
      if error is not None:
        raise error
      raise errors.RestoreError(f'orbax_pathways.preemption.resume: step {step} ({path}) failed '
                                'to restore on another process of this job.')
    prev = damaged[-1][2] if damaged else None
    if (error is not None and prev is not None
        and not isinstance(error, errors.ChecksumMismatchError)
        and type(error) is type(prev)):
      raise damaged[0][2] or error  # the same failure twice: the request, not the data
    logging.warning('orbax_pathways.preemption.resume: restoring step %d (%s) failed (%s); '
                    'trying the next older step.', step, path,
                    type(error).__name__ if error else 'on another process')
    damaged.append((step, path, error))
    if abstract_state is not None:
      # The node steps between the next older storage step and this one (this step's own node
      # copy included: a storage step on the local interval is saved into the nodes too),
      # whole on the nodes where storage lost this step. Those newer than it were tried (and
      # dropped) above. Every process is here: the step failed on all of them alike.
      below = latest_complete_step(mngr, exclude={d[0] for d in damaged})
      found = local_steps.resume_on_nodes(
          mngr, abstract_state, below,
          all_ok=lambda ok, s: all_processes_ok(mngr, ok, s),
          timeout_s=agreement_lib.current().timeout_s, **nodes)
      if found is not None:
        _report_damaged(mngr, damaged, found[0])
        local_steps.drop_newer(mngr, found[0], listed)
        return from_nodes(found)
