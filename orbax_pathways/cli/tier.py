"""``orbax-pathways tier [LOCAL_DIR]``: which steps a node's tier holds, each verified against
the committed step's records on storage.

Runs on the node whose tier it lists (``main.cmd_tier``). Each entry (one writer's chunks of one
item of one step, ``tier/layout.py``) is ``ok`` when storage's index records its save id for its
writer and every chunk's crc32c and size equal the committed ones; ``stale`` when storage
records another save (or none) of that step; ``damaged`` when a chunk differs or is missing;
``incomplete`` when its manifest is missing (a save or copy cut short). A restore uses only
``ok`` entries (the others fall back to storage); storage's checksums are the reference, never
the tier's own.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from orbax_pathways import checksum
from orbax_pathways import metadata
from orbax_pathways.storage import meta_io
from orbax_pathways.tier import chain
from orbax_pathways.tier import layout
from orbax_pathways.tier import store


def default_dir() -> str | None:
  """``ORBAX_PATHWAYS_LOCAL_DIR`` if set (None if 'off'), else the /dev/shm default."""
  cfg = store.resolve(os.environ.get(store.ENV) or None)
  return cfg.local_dir if cfg is not None else None


def _check(e: store.Entry, root: str | None) -> tuple[str, list[str]]:
  if e.manifest is None:
    return 'incomplete', [e.error]
  item_dir = layout.item_dir_of(root or e.manifest.root, e.step_name, e.item)
  try:
    committed = meta_io.read_item(item_dir)
  except Exception as ex:  # pylint: disable=broad-except  # a damaged index: say so, go on
    return 'stale', [f'cannot read the committed records at {item_dir}: {ex}']
  if committed is None:
    return 'stale', [f'no committed step with orbax-pathways records at {item_dir}']
  recorded = {w.writer: w.save_id for w in committed.writers}.get(e.writer)
  if recorded != e.save_id:
    return 'stale', [f'save {e.save_id}; storage records {recorded or "no save id"} for '
                     f'writer {e.writer} at {item_dir}']
  arrays = committed.arrays()
  problems = []
  for a in e.manifest.arrays:
    rec = arrays.get(a.name)
    if rec is None or tuple(rec.chunk_shape) != a.chunk_shape or tuple(rec.shape) != a.shape:
      problems.append(f'array {a.name!r}: not in the committed step with this layout')
      continue
    index = metadata.chunk_index([rec])
    dtype = chain.layout_dtype(a.dtype)
    for origin, name, n in zip(a.origins, a.files, a.nbytes):
      want = index.get(tuple(origin))
      path = os.path.join(e.path, name)
      try:
        data = np.fromfile(path, dtype=np.uint8)
      except OSError as ex:
        problems.append(f'array {a.name!r} chunk {list(origin)}: {ex}')
        continue
      crc = checksum.of_array(data.view(dtype)) if data.nbytes % dtype.itemsize == 0 else None
      if want is None or crc != want.crc32c or data.nbytes != want.nbytes:
        problems.append(
            f'array {a.name!r} chunk {list(origin)} damaged ({path}: crc32c '
            f'{crc if crc is None else hex(crc)}, {data.nbytes} bytes; committed '
            f'{hex(want.crc32c) if want else None}, {want.nbytes if want else None} bytes)')
  return ('damaged' if problems else 'ok'), problems


def report(local_dir: str) -> dict[str, Any]:
  """Every entry of the tier at ``local_dir``, with its status (see the module docstring)."""
  out = []
  roots: dict[str, str | None] = {}
  for e in store.entries(local_dir):
    if e.root_key not in roots:
      roots[e.root_key] = store.root_of(local_dir, e.root_key)
    root = roots[e.root_key] or (e.manifest.root if e.manifest else None)
    status, problems = _check(e, root)
    out.append({
        'root': root, 'step': e.step, 'step_name': e.step_name, 'item': e.item,
        'writer': e.writer, 'save_id': e.save_id, 'committed_marker': e.committed,
        'chunks': e.manifest.chunks if e.manifest else 0,
        'bytes': e.manifest.nbytes if e.manifest else 0, 'status': status,
        'problems': problems, 'path': e.path})
  out.sort(key=lambda x: (str(x['root']), x['step'] if x['step'] is not None else -1,
                          x['item'], x['writer']))
  return {'local_dir': local_dir, 'entries': out,
          'ok': all(x['status'] == 'ok' for x in out)}


def text(obj: dict[str, Any]) -> str:
  lines = [f'node-local tier {obj["local_dir"]}']
  if not obj['entries']:
    lines.append('  (empty)')
  for x in obj['entries']:
    mark = '' if x['committed_marker'] else ' (not marked committed)'
    lines.append(f'  {x["root"]}  step {x["step_name"]}  {x["item"]}  {x["writer"]}  '
                 f'{x["chunks"]} chunks {x["bytes"] / 2**20:.1f} MiB  {x["status"]}{mark}')
    lines += [f'    {p}' for p in x['problems'][:5]]
    if len(x['problems']) > 5:
      lines.append(f'    (+{len(x["problems"]) - 5} more)')
  return '\n'.join(lines)

