"""The touches of Orbax's finalize: run a hook on each item directory before commit, and join
our files of an Orbax v1 partial save's parts before Orbax moves the rest.

SUPPORTED: orbax-checkpoint ``supported.ORBAX`` (written against 0.12.8), like
``_compat/orbax_manager.py``.

Patch, installed by ``install(hook)`` and restored exactly (the very same function object) by
``uninstall()``; both idempotent:

- ``BasePyTreeCheckpointHandler._finalize_async(self, directory)``: Orbax's OCDBT merge (and
  array-metadata validation) of one item. It runs on the primary host only (Orbax's commit
  callback; v1's ``PyTreeHandler._finalize`` checks the primary itself), after every process's
  commit futures finished (the ``async_write_complete`` barrier) and before the item's temporary
  path is finalized and the step committed. Every save of a PyTree item reaches it: v0's
  ``PyTreeCheckpointHandler`` / ``StandardCheckpointHandler`` (through ``finalize``, synchronous
  or async checkpointers) and v1's ``save_pytree`` / ``training.Checkpointer``.

The wrapper runs Orbax's original and ``hook(directory)`` (in a worker thread) concurrently; if
either fails, the finalize fails and the step is not committed. With no hook set it is the
original. ``orbax_pathways`` sets ``storage.index.merge_item`` as the hook (it writes the item's
merged ``_pathways`` index).

- ``experimental.v1._src.partial.saving._merge_all(partial_path)``: ``ocp.v1.partial.finalize``
  on the primary host moves every pending partial save (``<path>.partial_save/*.pending_*``,
  one per ``partial.save`` call, oldest first) into ``<path>.partial_save`` and then runs the
  PyTree finalize above on each item. It refuses to overwrite a file, and every part holds the
  same writer's ``_pathways/p<i>.msgpack``. The wrapper first calls
  ``pending_hook(item_directory, part_item_directory)`` for each item of each pending part that
  has ``_pathways/`` (``storage.index.merge_pending``: joins the part's records into the
  item's), then removes the part's ``_pathways/`` and runs Orbax's original. Both steps are
  idempotent, so a finalize that failed can be run again.
- Three more functions of Orbax's partial saving, so that a finalize that failed half-way (on
  an older orbax-pathways, or on storage) can be retried; stock Orbax fails every retry or
  commits an unmerged item. Only inside the ``_merge_all`` above: ``_read_first_metadata``
  (``use_zarr3`` for the OCDBT merge, from the first part's ``_METADATA``) falls back to the
  ``_METADATA`` already merged into ``<path>.partial_save``; ``_is_pytree_dir`` also takes a
  part whose ``_METADATA`` was merged already for a PyTree item; and after Orbax's merge, an
  item Orbax did not finalize (no part of it left) is finalized as Orbax would have.
"""

from __future__ import annotations

from orbax_pathways._compat import seam
from orbax_pathways._compat import src
from orbax_pathways._compat import supported

import asyncio
import contextvars
import functools
import threading
from typing import Any, Callable

_base = src.orbax('handlers.base_pytree_checkpoint_handler')
_async_path = src.orbax('path.async_path')
_snapshot = src.orbax('path.snapshot.snapshot')
try:  # v1 partial saves are newer than the oldest supported orbax-checkpoint
  _partial = src.orbax_v1('partial.saving')
except ImportError:  # pragma: no cover
  _partial = None

from orbax_pathways.format import names as format_lib

SUPPORTED = supported.ORBAX

_lock = threading.Lock()


class _State:
  """This module's process-wide state (one object: no `global` statement)."""

  hook: Callable[[Any], Any] | None = None
  pending_hook: Callable[[Any, Any], Any] | None = None


_state = _State()
_finalizing: contextvars.ContextVar[Any] = contextvars.ContextVar('orbax_pathways_partial',
                                                                  default=None)


def _owner():
  return _base.BasePyTreeCheckpointHandler


def _wrap(original):
  @functools.wraps(original)
  async def _finalize_async(self, directory):
    hook = _state.hook
    if hook is None:
      return await original(self, directory)
    done = await asyncio.gather(original(self, directory), asyncio.to_thread(hook, directory),
                                return_exceptions=True)
    for d in done:  # both settle first: no thread or tensorstore future outlives the finalize
      if isinstance(d, BaseException):
        raise d
    return done[0]
  return _finalize_async


async def _join_pending(hook: Callable[[Any, Any], Any], partial_path: Any) -> None:
  """``hook(partial_path / item, part / item)`` for each item of each pending part (in Orbax's
  merge order) that has our directory; then that directory is removed from the part."""
  for part in sorted(await _snapshot.list_pending_dirs(partial_path)):
    for item in sorted(await _async_path.iterdir(part)):
      ours = item / format_lib.PATHWAYS_DIR
      if await _async_path.is_dir(item) and await _async_path.exists(ours):
        await asyncio.to_thread(hook, partial_path / item.name, item)
        await _async_path.rmtree(ours)


class _Finalizing:
  """What one ``_merge_all`` under our wrapper knows: the partial path, the items Orbax took
  for PyTree items (and so finalizes itself)."""

  def __init__(self, partial_path):
    self.partial_path = partial_path
    self.pytree_items: set[str] = set()


def _wrap_merge_all(original):
  @functools.wraps(original)
  async def _merge_all(partial_path):
    hook = _state.pending_hook
    if hook is None:
      return await original(partial_path)
    await _join_pending(hook, partial_path)
    state = _Finalizing(partial_path)
    token = _finalizing.set(state)
    try:
      await original(partial_path)
    finally:
      _finalizing.reset(token)
    await _finalize_left_over(state)
  return _merge_all


async def _finalize_left_over(state: _Finalizing) -> None:
  """A finalize that failed in the PyTree finalize (the OCDBT merge, our index) after every part
  was moved leaves no part: Orbax's retry would then commit the items unmerged. Finalize every
  PyTree item Orbax did not (running it again after a success merges the same files again)."""
  first = None
  for item in sorted(await _async_path.iterdir(state.partial_path)):
    if item.name in state.pytree_items or not await _async_path.is_dir(item):
      continue
    if not await _async_path.exists(item / _partial.PYTREE_METADATA_FILE):
      continue
    if first is None:
      first = await seam.originals(PARTIAL)['_read_first_metadata']([state.partial_path])
    handler = _base.BasePyTreeCheckpointHandler(use_zarr3=bool(first and first.use_zarr3))
    await asyncio.to_thread(handler.finalize, item)


def _wrap_read_first_metadata(original):
  @functools.wraps(original)
  async def _read_first_metadata(pending_dirs):
    found = await original(pending_dirs)
    state = _finalizing.get()
    if found is None and state is not None:  # the parts' _METADATA was merged before
      found = await original([state.partial_path])
    return found
  return _read_first_metadata


def _wrap_is_pytree_dir(original):
  @functools.wraps(original)
  async def _is_pytree_dir(item):
    state = _finalizing.get()
    yes = await original(item)
    if not yes and state is not None and await _async_path.is_dir(item):
      # A part whose _METADATA an earlier, failed finalize merged already is still a PyTree
      # item: moving it as a plain directory collides on array_metadatas/process_<i>.
      yes = await _async_path.exists(state.partial_path / item.name / _partial.PYTREE_METADATA_FILE)
    if yes and state is not None:
      state.pytree_items.add(item.name)
    return yes
  return _is_pytree_dir


_PARTIAL_WRAPPERS = {'_merge_all': _wrap_merge_all,
                     '_read_first_metadata': _wrap_read_first_metadata,
                     '_is_pytree_dir': _wrap_is_pytree_dir}


FEATURE = seam.Feature(
    'the _pathways index written at commit (the package\'s restores read it)',
    'Orbax\'s PyTree handler has no hook between its writes and the step\'s commit',
    lambda: [seam.Target(_owner, '_finalize_async', _wrap)])


def _partial_module():
  if _partial is None:
    raise ImportError('orbax.checkpoint.experimental.v1 partial saving')
  return _partial


PARTIAL = seam.Feature(
    'Orbax v1 partial saves joined with their _pathways index',
    'Orbax v1\'s partial saving merges its parts in module functions, with no hook',
    lambda: [seam.Target(_partial_module, name, wrap) for name, wrap in _PARTIAL_WRAPPERS.items()])


def install(hook: Callable[[Any], Any],
            pending_hook: Callable[[Any, Any], Any] | None = None) -> bool:
  """Sets ``hook(item_directory)`` and ``pending_hook(item_directory, part_item_directory)``
  and installs the wrappers (once). False when Orbax's ``_finalize_async`` is missing (no
  index at commit: a restore then merges the writers' records itself); v1 partial saves are
  joined where Orbax has them."""
  with _lock:
    _state.hook = hook
    _state.pending_hook = pending_hook
    if _partial is not None:
      seam.install(PARTIAL)
    return seam.install(FEATURE)


def uninstall() -> None:
  """Puts Orbax's own ``_finalize_async`` and partial-save functions back and clears the hooks
  (idempotent)."""
  with _lock:
    seam.uninstall(FEATURE)
    seam.uninstall(PARTIAL)
    _state.hook, _state.pending_hook = None, None


def installed() -> bool:
  return seam.installed(FEATURE)


def original() -> Callable[..., Any] | None:
  """Orbax's own function while the patch is installed (tests check it is put back as is)."""
  return seam.originals(FEATURE).get('_finalize_async')


def partial_originals() -> dict[str, Callable[..., Any]]:
  """Orbax's own partial-save functions (``_merge_all``, ``_read_first_metadata``) while the
  patch is installed; empty otherwise."""
  return seam.originals(PARTIAL)
