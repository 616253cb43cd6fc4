"""The one touch of Orbax's PyTree finalize: run a hook on each item directory before commit.

SUPPORTED: orbax-checkpoint ``>=0.12.4,<0.13`` (written against 0.12.8), like
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
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any, Callable

from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as _base

SUPPORTED = '>=0.12.4,<0.13'

_lock = threading.Lock()
_original: Callable[..., Any] | None = None
_replacement: Callable[..., Any] | None = None
_hook: Callable[[Any], Any] | None = None


def _owner():
  return _base.BasePyTreeCheckpointHandler


def _wrap(original):
  @functools.wraps(original)
  async def _finalize_async(self, directory):
    hook = _hook
    if hook is None:
      return await original(self, directory)
    done = await asyncio.gather(original(self, directory), asyncio.to_thread(hook, directory),
                                return_exceptions=True)
    for d in done:  # both settle first: no thread or tensorstore future outlives the finalize
      if isinstance(d, BaseException):
        raise d
    return done[0]
  return _finalize_async


def install(hook: Callable[[Any], Any]) -> None:
  """Sets ``hook(item_directory)`` and installs the wrapper (once)."""
  global _original, _replacement, _hook
  with _lock:
    _hook = hook
    if _original is not None:
      return
    owner = _owner()
    if '_finalize_async' not in owner.__dict__:
      raise RuntimeError(
          'orbax_pathways: BasePyTreeCheckpointHandler._finalize_async not found in this '
          f'orbax-checkpoint (supported {SUPPORTED}); the _pathways index cannot be written at '
          'commit. Install a supported orbax-checkpoint version.')
    _original = owner.__dict__['_finalize_async']
    _replacement = _wrap(_original)
    owner._finalize_async = _replacement  # pylint: disable=protected-access


def uninstall() -> None:
  """Puts Orbax's own ``_finalize_async`` back and clears the hook (idempotent)."""
  global _original, _replacement, _hook
  with _lock:
    if _original is not None:
      _owner()._finalize_async = _original  # pylint: disable=protected-access
    _original, _replacement, _hook = None, None, None


def installed() -> bool:
  return _original is not None


def original() -> Callable[..., Any] | None:
  """Orbax's own function while the patch is installed (tests check it is put back as is)."""
  return _original
