"""Orbax's warning that a save had no OCDBT trees to merge, left out for node steps.

SUPPORTED: orbax-checkpoint ``supported.ORBAX`` (the text of 0.12.4-0.12.8). Orbax's PyTree
handler merges the per-process OCDBT trees at every save's finalize, whether or not the save
used OCDBT, and warns "Skipping merge of OCDBT checkpoints: No per-process OCDBT checkpoint
subdirs found in <directory>" where there are none (``ocdbt_utils.merge_ocdbt_per_process_files``).
Node steps are saved without OCDBT (``multitier/node_steps.py``), so each local-only save would
log that warning on every process. ``install()`` adds a filter to the ``absl`` logger (where
Orbax logs) that drops this one warning where its directory is a node step's; about any other
directory it is logged as stock logs it. Matched by its text: a release that rewords the warning
logs it again for node steps, and nothing else changes. Called when the node steps' manager is
built (``node_steps.manager``); ``uninstall()`` (the package's) removes the filter.
"""

from __future__ import annotations

import logging
import threading

from orbax_pathways.format import names as format_names

_TEXT = 'Skipping merge of OCDBT checkpoints'
_lock = threading.Lock()


class _NodeStepMergeNote(logging.Filter):
  """Drops Orbax's no-trees-to-merge warning about a node step's directory."""

  def filter(self, record: logging.LogRecord) -> bool:
    if _TEXT not in str(record.msg):
      return True
    return not any(format_names.is_node_step(a) for a in (record.args or ())
                   if isinstance(a, str) or hasattr(a, '__fspath__'))


class _State:
  """The filter while installed (None: not installed)."""
  installed: _NodeStepMergeNote | None = None


_state = _State()


def install() -> None:
  """Adds the filter to the ``absl`` logger, once."""
  with _lock:
    if _state.installed is None:
      _state.installed = _NodeStepMergeNote()
      logging.getLogger('absl').addFilter(_state.installed)


def uninstall() -> None:
  """Removes it again (idempotent)."""
  with _lock:
    if _state.installed is not None:
      logging.getLogger('absl').removeFilter(_state.installed)
      _state.installed = None
