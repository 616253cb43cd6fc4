"""A save's arguments detached from the training loop, so the save can run in the background
(``multitier/local_steps.py``): what the loop may change or donate after ``save()`` returns is
copied now, everything else is kept as it is.

Pure over the arguments' structure (no I/O, no device): ``detach`` returns the arguments to save
later and the ``jax.Array`` leaves whose shards ``transports/snapshots.take`` must copy to host
before ``save()`` returns; or ``None`` when some item is of a kind this module cannot copy
without running its handler (a data iterator, whose handler reads the iterator's position when
it saves; a custom handler's arguments): such a save runs in the loop's thread, as Orbax's own,
or (``loop_items=True``, for node steps) those items alone do.

What is detached: ``args.Composite`` of the items below; ``StandardSave`` / ``PyTreeSave`` /
``ArraySave`` trees of ``jax.Array`` (kept: their host copies are taken), numpy arrays (copied),
numpy and Python scalars, strings, bytes and ``None`` (immutable); ``JsonSave`` (a deep copy);
``custom_metadata`` (a deep copy); Orbax v1's compatibility ``Args`` (what its
``training.Checkpointer`` passes, one per checkpointable) whose checkpointable is a tree of the
leaves above (a data iterator or another v1 ``Checkpointable`` object is not).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from orbax_pathways._compat import orbax_v1_training as _v1

_TREES = (ocp.args.StandardSave, ocp.args.PyTreeSave, ocp.args.ArraySave)
_IMMUTABLE = (np.generic, int, float, complex, bool, str, bytes, type(None))


class Detached(NamedTuple):
  args: tuple  # the save's positional arguments after the step, detached
  kwargs: dict  # its keyword arguments, detached
  arrays: list  # the jax.Array leaves whose shards must be copied to host now
  # ``detach(..., loop_items=True)``: the items of ``args=`` (a Composite) that cannot be
  # copied, by name, as given (left out of ``kwargs['args']``): their handlers save them in the
  # loop's thread (``multitier/node_steps.stage``).
  loop_items: dict = {}


class _Unsupported(Exception):
  pass


def _leaf(x: Any, arrays: list) -> Any:
  if isinstance(x, jax.Array):
    arrays.append(x)
    return x
  if isinstance(x, np.ndarray):
    return x.copy()
  if isinstance(x, _IMMUTABLE):
    return x
  raise _Unsupported(type(x).__name__)


def _item(a: Any, arrays: list) -> Any:
  if isinstance(a, ocp.args.Composite):
    return type(a)(**{k: _item(v, arrays) for k, v in a.items()})
  if isinstance(a, _TREES):
    tree = jax.tree.map(lambda x: _leaf(x, arrays), a.item)
    out = dataclasses.replace(a, item=tree)
    if getattr(a, 'custom_metadata', None) is not None:
      out = dataclasses.replace(out, custom_metadata=copy.deepcopy(a.custom_metadata))
    return out
  if isinstance(a, ocp.args.JsonSave):
    return dataclasses.replace(a, item=copy.deepcopy(a.item))
  if isinstance(a, _v1.v1_args_type()):  # Orbax v1's training.Checkpointer: one per checkpointable
    return type(a)(jax.tree.map(lambda x: _leaf(x, arrays), a.checkpointable))
  raise _Unsupported(type(a).__name__)


def _copyable(a: Any) -> bool:
  """Whether ``_item`` copies ``a`` (checked, nothing copied)."""
  leaf_ok = lambda x: isinstance(x, (jax.Array, np.ndarray) + _IMMUTABLE)
  if isinstance(a, ocp.args.Composite):
    return all(_copyable(v) for v in a.values())
  if isinstance(a, _TREES):
    return all(leaf_ok(x) for x in jax.tree.leaves(a.item))
  if isinstance(a, _v1.v1_args_type()):
    return all(leaf_ok(x) for x in jax.tree.leaves(a.checkpointable))
  return isinstance(a, ocp.args.JsonSave)


def split(a: Any, keeps: Callable[[Any], bool] = _copyable) -> tuple[Any, dict]:
  """``args=`` without its top-level ``Composite`` items ``keeps`` refuses (default: those
  ``_item`` cannot copy), and those items by name; ``a`` itself where it refuses none."""
  if not isinstance(a, ocp.args.Composite):
    return a, {}
  loop = {name: v for name, v in a.items() if not keeps(v)}
  if not loop:
    return a, {}
  return type(a)(**{name: v for name, v in a.items() if name not in loop}), loop


def detach(args: tuple, kwargs: dict, loop_items: bool = False) -> Detached | None:
  """``CheckpointManager.save(step, *args, **kwargs)``'s arguments, detached (None: some item
  cannot be; run the save in the loop's thread). ``loop_items``: a ``Composite`` item that
  cannot be is set aside in ``Detached.loop_items`` instead (its handler saves it in the loop's
  thread), unless no item of ``args=`` could be detached."""
  unknown = set(kwargs) - {'args', 'custom_metadata'}
  if unknown or len(args) > 1 or (args and 'args' in kwargs):
    return None  # the legacy ``items=`` / ``save_kwargs=`` forms
  loop: dict = {}
  if loop_items and not args and kwargs.get('args') is not None:
    given, loop = split(kwargs['args'])
    if loop and not len(given):
      return None
    kwargs = dict(kwargs, args=given)
  arrays: list = []
  try:
    out_args = tuple(_item(a, arrays) for a in args)
    out_kwargs = {k: (_item(v, arrays) if k == 'args' else copy.deepcopy(v))
                  for k, v in kwargs.items()}
  except _Unsupported:
    return None
  if not out_args and out_kwargs.get('args') is None:
    return None
  return Detached(out_args, out_kwargs, arrays, loop)
