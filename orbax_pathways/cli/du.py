"""``orbax-pathways du``: bytes on disk per step, and per top-level key of each item.

Runs on the machine running the CLI (``main.cmd_du``). A key's bytes are the raw bytes of the
chunks our writers recorded (basis ``chunks``), else dtype size x shape (basis ``logical``):
stored (compressed) sizes per array are not known without listing OCDBT.
"""

from __future__ import annotations

from typing import Any

from orbax_pathways.cli import paths
from orbax_pathways.cli.model import Item, Step


def step_usage(step: Step) -> dict[str, Any]:
  return {'step': step.step, 'name': step.name, 'state': step.state,
          'bytes': paths.dir_size(step.path),
          'items': [{'item': i.name, 'keys': key_usage(i)} for i in step.items]}


def key_usage(item: Item) -> list[dict[str, Any]]:
  keys: dict[str, dict[str, Any]] = {}
  for l in item.arrays:
    top = l.keypath[0] if l.keypath else l.key
    chunk = l.chunk_nbytes
    basis = 'chunks' if chunk is not None else 'logical'
    e = keys.setdefault(top, {'key': top, 'bytes': 0, 'basis': basis})
    e['bytes'] += chunk if chunk is not None else (l.nbytes or 0)
    if e['basis'] != basis:
      e['basis'] = 'mixed'
  return list(keys.values())
