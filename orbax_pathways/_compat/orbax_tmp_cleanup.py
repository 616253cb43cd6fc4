"""Orbax's clean-up of unfinished steps leaves the directory of local-only steps alone.

SUPPORTED: orbax-checkpoint ``supported.ORBAX`` (written against 0.12.8; 0.12.4 has the same
function).

``CheckpointManagerOptions(cleanup_tmp_directories=True)`` (and Orbax v1's
``training.Checkpointer(cleanup_tmp_directories=True)``) make the primary host remove, when the
manager is built, every entry of its directory that Orbax's ``temporary_paths.is_path_temporary``
calls unfinished. On gs:// that is every directory without ``commit_success.txt``, so it
includes ``<directory>/.orbax-pathways-local`` (``format.names.LOCAL_STEPS_DIR``: the hidden
manager's steps, ``multitier/local_steps.py``), which is no step at all. A job restarted with that
option on gs:// lost every local-only step before its resume could take one. (On a local disk
only names with ``.orbax-checkpoint-tmp`` count, so the directory was never taken.)

Patch, installed by ``install()`` and restored exactly (the very same function object) by
``uninstall()``; both idempotent:

- ``path.temporary_paths.all_temporary_paths(root_directory, ...)``: Orbax's own list, without
  an entry named ``LOCAL_STEPS_DIR`` directly under ``root_directory``. Its callers
  (``cleanup_temporary_paths``, the package's ``orbax_manager_state.temporary_step_paths``)
  look it up by name in the module, so they see the filtered list; the unfinished steps inside
  the hidden directory are the hidden manager's to clean
  (``orbax_manager_state.discard_unfinished_local_steps``).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from orbax_pathways._compat import seam
from orbax_pathways._compat import src
from orbax_pathways.format import names as format_names

_temporary_paths = src.orbax('path.temporary_paths')



def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
  @functools.wraps(original)
  async def all_temporary_paths(root_directory, *args, **kwargs):
    found = await original(root_directory, *args, **kwargs)
    return [p for p in found if _name(p) != format_names.LOCAL_STEPS_DIR]
  return all_temporary_paths


def _name(temporary_path: Any) -> str:
  """The final path's name of Orbax's ``TemporaryPath`` (what its clean-up removes)."""
  try:
    return temporary_path.get().name
  except Exception:  # pylint: disable=broad-except  (an unexpected entry: keep Orbax's say)
    return ''


FEATURE = seam.Feature(
    'Orbax\'s clean-up of unfinished steps sparing the local-only steps\' directory',
    'Orbax lists every temporary path under the root with no filter',
    lambda: [seam.Target(lambda: _temporary_paths, 'all_temporary_paths', _wrap)])


def install() -> None:
  seam.install(FEATURE)


def uninstall() -> None:
  seam.uninstall(FEATURE)


def installed() -> bool:
  return seam.installed(FEATURE)
