"""What ``preemption.resume(mngr, init_fn, args=...)`` restores of a step saved as several items
(a data iterator beside the state): the one tree a node step's restore centres on (its chunks
mapped, onto the current layout), and the other items, restored beside it from the same step by
their own handlers. Pure over the arguments (no I/O); called by ``multitier/resume.py`` on every
process that resumes.

``args`` is what the manager's own restore takes: for a v0 ``CheckpointManager`` an
``ocp.args.Composite`` of restore arguments (as for ``mngr.restore(step, args=...)``), the tree
a ``StandardRestore`` or ``PyTreeRestore``; for Orbax v1's ``training.Checkpointer`` a dict of
name -> abstract checkpointable (as for ``load_checkpointables``), the tree one of
``jax.ShapeDtypeStruct``, array and scalar leaves.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

_TREE_ARGS = (ocp.args.StandardRestore, ocp.args.PyTreeRestore)
_ABSTRACT_LEAVES = (jax.ShapeDtypeStruct, jax.Array, np.ndarray, np.generic, int, float)


class Split(NamedTuple):
  tree: str  # the tree item's name
  abstract_state: Any  # its abstract state
  others: dict  # name -> the other items' restore arguments (v0) or abstract checkpointables (v1)


def _is_abstract_tree(x: Any) -> bool:
  leaves = jax.tree.leaves(x)
  return bool(leaves) and all(isinstance(leaf, _ABSTRACT_LEAVES) for leaf in leaves)


def split(args: Any, v1: bool) -> Split:
  """``args`` as its one tree and the other items (module docstring); ``ValueError`` naming
  what was given where it is not of that form."""
  what = 'a dict of name -> abstract checkpointable' if v1 else 'an ocp.args.Composite'
  if (v1 and not isinstance(args, dict)) or (not v1 and not isinstance(args, ocp.args.Composite)):
    raise ValueError(f'orbax_pathways.preemption.resume: args= must be {what} (the restore '
                     f'arguments of every item of the step), not {type(args).__name__}.')
  items = dict(args.items())
  trees = [name for name, a in items.items()
           if (_is_abstract_tree(a) if v1 else isinstance(a, _TREE_ARGS))]
  if len(trees) != 1:
    kind = ('a tree of jax.ShapeDtypeStruct, array or scalar leaves' if v1
            else 'ocp.args.StandardRestore or ocp.args.PyTreeRestore')
    raise ValueError(f'orbax_pathways.preemption.resume: args= must hold exactly one tree item '
                     f'({kind}), beside the other items (a data iterator); found '
                     f'{len(trees)} among {sorted(items)}: {sorted(trees)}.')
  (tree,) = trees
  abstract = items[tree] if v1 else items[tree].item
  if abstract is None:
    raise ValueError(f'orbax_pathways.preemption.resume: the tree item {tree!r} of args= has no '
                     'abstract state (a step of the nodes is restored onto the layout it names).')
  return Split(tree, abstract, {k: v for k, v in items.items() if k != tree})


def joined(s: Split, tree: Any, others: dict, v1: bool) -> Any:
  """What the manager's own restore of ``args`` returns, from the restored tree and items."""
  items = {s.tree: tree, **others}
  return items if v1 else ocp.args.Composite(**items)
