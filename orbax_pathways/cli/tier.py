"""``orbax-pathways tier [TIER_DIR]``: which steps a node's tier holds, each verified against
the committed step's records on storage.

Runs on the node whose tier it lists (``main.cmd_tier``), as the user who owns it: a tier
directory that is not this user's, or that others can write into, is refused (exit 2) before
anything in it is read. Each entry (one writer's chunks of one item of one step,
``tier/manifest.py``) is ``ok`` when storage's index records its save id for its writer, each of
its arrays has the committed dtype, shape and chunk shape, and every chunk is a regular file of
the committed size whose crc32c is the committed one; ``stale`` when storage records another
save (or none) of that step; ``damaged`` when a chunk or an array's layout differs, a chunk is
missing or not a regular file (a symlink, a FIFO: refused without reading it); ``incomplete``
when its manifest is missing (a save or copy cut short). A restore uses only ``ok`` entries
(the others fall back to storage); storage's records are the reference, never the tier's own.

``orbax-pathways tier --gc`` runs the node-level clean-up by hand (``tier/gc.py``, the rule a
save applies to other checkpoint directories' entries, here to every directory's): entries
whose step is gone from storage or stale (one listing per checkpoint directory, gs:// too, and
one index read per step), entries idle past the max age, incomplete ones, then the oldest while
over the size cap; never one touched in the last 5 minutes. ``--dry-run`` lists and removes
nothing.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

from orbax_pathways.format import checksum
from orbax_pathways.format import grid as grid_lib
from orbax_pathways.format import records as records_lib
from orbax_pathways import options
from orbax_pathways.storage import meta_io
from orbax_pathways.cli import paths
from orbax_pathways.fleet import chain
from orbax_pathways.tier import chunk_read
from orbax_pathways.tier import fsafe
from orbax_pathways.tier import gc as gc_lib
from orbax_pathways.tier import manifest as manifest_lib
from orbax_pathways.tier import config as tier_config
from orbax_pathways.tier import store
from orbax_pathways.tier import spares


def default_dir() -> str | None:
  """``ORBAX_PATHWAYS_TIER_DIR`` if set (None if 'off'), else the /dev/shm default."""
  cfg = tier_config.resolve(options.env_raw(tier_config.ENV) or None)
  return cfg.tier_dir if cfg is not None else None


def check_dir(tier_dir: str) -> None:
  """Refuses (``CliError``, exit 2) a tier directory this user must not read: missing, not a
  real directory of this uid, or writable by other users (``fsafe.root_problem``)."""
  if not fsafe.exists(tier_dir):
    raise paths.CliError(f'{tier_dir}: no such tier directory')
  why = fsafe.root_problem(tier_dir)
  if why:
    raise paths.CliError(f'{why}. Nothing in it was read.')


def _read_exact(path: str, nbytes: int) -> np.ndarray:
  """The bytes of the chunk file at ``path``, which must be a regular file of exactly
  ``nbytes`` (``fsafe.open_regular``: a symlink, FIFO or device is refused, never read)."""
  parts, got = [], 0
  with fsafe.open_regular(path, nbytes) as f:
    while got < nbytes:
      part = f.read(nbytes - got)
      if not part:
        raise OSError(f'{path}: ended after {got} of {nbytes} bytes')
      parts.append(part)
      got += len(part)
  return np.frombuffer(b''.join(parts), np.uint8)


def _read_from_band(path: str, band: tuple[tuple[int, ...], tuple[int, ...]],
                    a: manifest_lib.TierArray, origin: Sequence[int]) -> np.ndarray:
  """The bytes of the chunk at ``origin`` out of the band file at ``path``, which must be a
  regular file of exactly the band's size (``tier/manifest.py``: bands)."""
  dtype = chain.layout_dtype(a.dtype)
  box = manifest_lib.chunk_box(a, origin)
  out = np.empty(box.shape, dtype)
  with fsafe.open_regular(path, math.prod(band[1]) * dtype.itemsize) as f:
    chunk_read.Place(out, box, box).fill_from_band(f.fileno(), *band)
  return out


def _layout_problems(a: manifest_lib.TierArray, rec: records_lib.ArrayRecord) -> list[str]:
  """How an entry's array differs from the committed record's dtype, shape and chunk shape."""
  out = []
  try:
    ours: Any = chain.layout_dtype(a.dtype)
  except Exception:  # pylint: disable=broad-except  # a damaged manifest names anything
    ours = a.dtype
  try:
    theirs: Any = chain.layout_dtype(rec.dtype)
  except Exception:  # pylint: disable=broad-except
    theirs = rec.dtype
  if str(ours) != str(theirs):
    out.append(f'dtype {a.dtype}, committed {rec.dtype}')
  if tuple(rec.shape) != tuple(a.shape):
    out.append(f'shape {list(a.shape)}, committed {list(rec.shape)}')
  if tuple(rec.chunk_shape) != tuple(a.chunk_shape):
    out.append(f'chunk shape {list(a.chunk_shape)}, committed {list(rec.chunk_shape)}')
  return out


def _check(e: store.Entry, root: str | None) -> tuple[str, list[str]]:
  if e.manifest is None:
    return ('incomplete' if e.error.startswith('incomplete') else 'damaged'), [e.error]
  item_dir = manifest_lib.item_dir_of(root or e.manifest.root, e.step_name, e.item)
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
    if rec is None:
      problems.append(f'array {a.name!r}: not in the committed step')
      continue
    differs = _layout_problems(a, rec)
    if differs:  # same bytes read as another dtype or layout are other values: never used
      problems.append(f'array {a.name!r}: {"; ".join(differs)}')
      continue
    index = grid_lib.chunk_index([rec])
    bands = manifest_lib.band_boxes(a)
    for origin, name, n in zip(a.origins, a.files, a.nbytes):
      want = index.get(tuple(origin))
      path = os.path.join(e.path, name)
      if want is None:
        problems.append(f'array {a.name!r} chunk {list(origin)}: no such chunk in the '
                        f'committed step ({path})')
        continue
      if n != want.nbytes:
        problems.append(f'array {a.name!r} chunk {list(origin)}: the manifest records {n} '
                        f'bytes, the committed step {want.nbytes} ({path})')
        continue
      try:
        if name in bands:
          data = _read_from_band(path, bands[name], a, origin)
        else:
          data = _read_exact(path, want.nbytes)
      except (OSError, ValueError) as ex:  # fsafe.UnsafeError too: what was found instead
        problems.append(f'array {a.name!r} chunk {list(origin)}: {ex}')
        continue
      crc = checksum.of_array(data)
      if crc != want.crc32c:
        problems.append(
            f'array {a.name!r} chunk {list(origin)} damaged ({path}: crc32c {crc:#010x}, '
            f'{data.nbytes} bytes; committed {want.crc32c:#010x}, {want.nbytes} bytes)')
  return ('damaged' if problems else 'ok'), problems


def report(tier_dir: str) -> dict[str, Any]:
  """Every entry of the tier at ``tier_dir``, with its status (see the module docstring)."""
  check_dir(tier_dir)
  out = []
  roots: dict[str, str | None] = {}
  for e in store.entries(tier_dir):
    if e.root_key not in roots:
      roots[e.root_key] = store.root_of(tier_dir, e.root_key)
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
  files, nbytes = spares.pooled(tier_dir)
  return {'tier_dir': tier_dir, 'entries': out,
          'ok': all(x['status'] == 'ok' for x in out),
          'spares': {'files': files, 'bytes': nbytes}}


def text(obj: dict[str, Any]) -> str:
  lines = [f'node-local tier {obj["tier_dir"]}']
  if not obj['entries']:
    lines.append('  (empty)')
  for x in obj['entries']:
    mark = '' if x['committed_marker'] else ' (not marked committed)'
    lines.append(f'  {x["root"]}  step {x["step_name"]}  {x["item"]}  {x["writer"]}  '
                 f'{x["chunks"]} chunks {x["bytes"] / 2**20:.1f} MiB  {x["status"]}{mark}')
    lines += [f'    {p}' for p in x['problems'][:5]]
    if len(x['problems']) > 5:
      lines.append(f'    (+{len(x["problems"]) - 5} more)')
  held = obj.get('spares') or {}
  if held.get('files'):
    lines.append(f'  spares: {held["files"]} files {held["bytes"] / 2**20:.1f} MiB (a replaced '
                 "step's files, kept for the next save to write over)")
  return '\n'.join(lines)



def _env(name: str) -> Any:
  try:
    return options.env_value(name)
  except ValueError as e:
    raise paths.CliError(str(e)) from None


def gc(tier_dir: str, max_age_s: float | None, max_bytes: int | None,
       dry_run: bool = False) -> dict[str, Any]:
  """Runs (``dry_run``: plans) the clean-up of the tier at ``tier_dir``; None limits come
  from ``ORBAX_PATHWAYS_TIER_MAX_AGE_S`` / ``..._MAX_BYTES``, else their defaults."""
  if max_age_s is None:
    max_age_s = _env('ORBAX_PATHWAYS_TIER_MAX_AGE_S')
  if max_bytes is None:
    max_bytes = _env('ORBAX_PATHWAYS_TIER_MAX_BYTES')
  if max_age_s is None or math.isnan(max_age_s) or max_age_s < 0:
    raise paths.CliError(f'--max-age-s {max_age_s}: use a number of seconds >= 0 (inf: none)')
  if max_bytes is not None and max_bytes < 0:
    raise paths.CliError(f'--max-bytes {max_bytes}: use a number of bytes >= 0')
  check_dir(tier_dir)
  r = gc_lib.collect(tier_dir, max_age_s=max_age_s, max_bytes=max_bytes, dry_run=dry_run,
                     judge=judge_storage)
  roots: dict[str, str | None] = {}
  removed = []
  for d in sorted(r.dropped, key=lambda d: (d.seen.mtime, d.seen.path)):
    if d.seen.node_step:  # a stopped job's node step: no tier entry of it
      removed.append({'node_step': d.seen.root_key, 'step': d.seen.step,
                      'complete': d.seen.complete, 'bytes': d.seen.nbytes,
                      'idle_s': round(r.now - d.seen.mtime, 3), 'reason': d.reason,
                      'path': d.seen.path})
      continue
    e = r.entries[d.seen.path]
    if e.root_key not in roots:
      roots[e.root_key] = store.root_of(tier_dir, e.root_key)
    removed.append({
        'root': roots[e.root_key] or (e.manifest.root if e.manifest else None), 'step': e.step,
        'step_name': e.step_name, 'item': e.item, 'writer': e.writer, 'save_id': e.save_id,
        'complete': d.seen.complete, 'bytes': d.seen.nbytes,
        'idle_s': round(r.now - d.seen.mtime, 3), 'reason': d.reason, 'path': e.path})
  return {'tier_dir': tier_dir, 'dry_run': dry_run,
          'max_age_s': r.max_age_s if math.isfinite(r.max_age_s) else None,
          'max_bytes': r.max_bytes, 'entries': len(r.seen), 'bytes_before': r.bytes_before,
          'bytes_after': r.bytes_after, 'removed': removed}


def _listing(root: str) -> set[str] | None:
  """The names in checkpoint directory ``root`` (local or remote: one listing; empty: it is
  gone), None when it cannot be listed (no credentials, storage down: not known)."""
  try:
    path = paths.to_path(root)
    if not paths.exists(path):
      return set()
    return {p.name for p in paths.listdir(path)}
  except Exception:  # pylint: disable=broad-except  # not known: its entries stay
    return None


def judge_storage(found: Sequence[store.Entry], tier_dir: str) -> dict[str, str]:
  """``gc.GONE`` / ``gc.STALE`` by storage, for ``--gc``: each entry's checkpoint directory is
  listed once (gs:// too): an entry whose step is in it under no name, committed or
  temporary, is ``GONE``; for one whose step is there under its final name, the committed
  index (read once per item): ``STALE`` when it records another save id (or none) for the
  entry's writer. A step being written, an unreadable listing or index: not judged (the entry
  stays, and goes by age)."""
  out: dict[str, str] = {}
  roots: dict[str, str | None] = {}
  listed: dict[str, set[str] | None] = {}
  indexes: dict[str, dict[str, str] | None] = {}
  for e in found:
    root = gc_lib.entry_root(tier_dir, e, roots)
    if root is None:
      continue
    if root not in listed:
      listed[root] = _listing(root)
    names = listed[root]
    if names is None:
      continue
    if e.step_name not in gc_lib.step_names(names):
      out[e.path] = gc_lib.GONE
      continue
    if e.step_name not in names or e.manifest is None:
      continue  # in flight (only its temporary name is listed), or incomplete: not judged
    item_dir = manifest_lib.item_dir_of(root, e.step_name, e.item)
    if item_dir not in indexes:
      try:
        committed = meta_io.read_item(item_dir)
        indexes[item_dir] = ({w.writer: w.save_id for w in committed.writers}
                             if committed is not None else None)
      except Exception:  # pylint: disable=broad-except  # damaged or unreadable: not judged
        indexes[item_dir] = None
    ids = indexes[item_dir]
    if ids is not None and ids.get(e.writer) != e.save_id:
      out[e.path] = gc_lib.STALE
  return out


def _mib(n: int | None) -> str:
  if n is None:
    return 'none'
  return f'{n / 2**30:.1f} GiB' if n >= 2**30 else f'{n / 2**20:.1f} MiB'


def _entries(n: int) -> str:
  return f'{n} entr{"y" if n == 1 else "ies"}'


def gc_text(obj: dict[str, Any]) -> str:
  age = obj['max_age_s']
  lines = [f'node-local tier {obj["tier_dir"]}: {_entries(obj["entries"])}, '
           f'{_mib(obj["bytes_before"])}; max age '
           f'{"none" if age is None else f"{age / 3600:g} h"}, cap {_mib(obj["max_bytes"])}']
  verb = 'would remove' if obj['dry_run'] else 'removed'
  for x in obj['removed']:
    what = (f'node step {x["path"]}' if 'node_step' in x else
            f'{x["root"]}  step {x["step_name"]}  {x["item"]}  {x["writer"]}')
    lines.append(f'  {verb}  {what}  {_mib(x["bytes"])}  idle {x["idle_s"] / 3600:.1f} h  '
                 f'({gc_lib.REASONS[x["reason"]]})')
  n = len(obj['removed'])
  lines.append(f'  {verb} {_entries(n)} '
               f'({_mib(obj["bytes_before"] - obj["bytes_after"])}); '
               f'{_mib(obj["bytes_after"])} {"would be " if obj["dry_run"] else ""}left')
  return '\n'.join(lines)
