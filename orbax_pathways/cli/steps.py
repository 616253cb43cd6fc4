"""Reads a checkpoint directory into ``cli.model`` dataclasses: steps, states, items, leaves.

Called by every command on the machine running the CLI. What is read, per step directory (names
from ``orbax_pathways.format.names``, which documents the layout):
  ``_CHECKPOINT_METADATA``     JSON: item handlers, commit timestamp.
  ``commit_success.txt``       commit marker (Orbax >= 0.12.2, and the gs:// commit-file mode).
  ``<item>/_METADATA``         JSON tree: per leaf ``value_type`` / ``write_shape``; ``use_ocdbt``,
                               ``use_zarr3``, ``store_array_data_equal_to_fill_value``.
  ``<item>/_sharding``         JSON: urlsafe-b64(param name) -> JSON string of the saved sharding.
  ``<item>/_pathways/*``       our metadata (``orbax_pathways.storage.meta_io.read_item``).
  zarr metadata               dtype / shape / chunks, through ``cli.arrays`` when asked.

Nothing here imports jax.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any, Iterator

from etils import epath

from orbax_pathways.format import names as fmt
from orbax_pathways.format import records as records_lib
from orbax_pathways.cli import arrays
from orbax_pathways.cli import paths
from orbax_pathways.cli.model import CORRUPT, COMPLETE, PARTIAL, Item, Leaf, Sharding, Step
from orbax_pathways.cli.paths import CliError, DamagedFile
from orbax_pathways.storage import meta_io

parse_step_name = fmt.parse_step_name

# What a damaged Orbax file costs, for the message that names it.
_CONSEQUENCE = {
    fmt.CHECKPOINT_METADATA_FILE: 'CheckpointManager cannot read this step\'s item handlers '
                                  'and commit time',
    fmt.ITEM_METADATA_FILE: 'Orbax cannot restore this item without its tree metadata',
    fmt.SHARDING_FILE: 'restore needs explicit target shardings (the saved ones are in this file)',
}


def damaged(e: DamagedFile) -> str:
  """One line: the file, what is wrong with it, what that breaks, what to do."""
  what = _CONSEQUENCE.get(e.path.name, 'Orbax cannot read it')
  return (f'{e}: {what}. Restore another step (`orbax-pathways ls` lists them), or put the file '
          'back from a copy of this checkpoint.')


# ----------------------------------------------------------------------------------------------
# Finding steps.


def looks_like_step(path: epath.Path) -> bool:
  """Has a step's own files (step metadata, commit marker, or a bare PyTreeCheckpointer tree)."""
  return any(paths.exists(path / name) for name in (
      fmt.CHECKPOINT_METADATA_FILE, fmt.COMMIT_SUCCESS_FILE, fmt.ITEM_METADATA_FILE))


def _step_children(root: epath.Path) -> list[tuple[tuple[int, bool], epath.Path]]:
  out = []
  for p in paths.listdir(root):
    parsed = parse_step_name(p.name)
    if parsed is not None and p.is_dir():
      out.append((parsed, p))
  return out


def is_step_dir(path: epath.Path) -> bool:
  """A step directory, committed or not: it has a step's files, or it has a step name and no
  step directories inside (a save interrupted before ``_CHECKPOINT_METADATA`` was written)."""
  if looks_like_step(path):
    return True
  return (parse_step_name(path.name) is not None and paths.is_dir(path)
          and not _step_children(path))


def list_step_dirs(root: epath.Path) -> list[epath.Path]:
  """Step directories of a checkpoint root, sorted by (step, tmp last). Raises CliError."""
  if not paths.exists(root):
    raise CliError(f'{root} does not exist: pass the directory given to ocp.CheckpointManager.')
  if not paths.is_dir(root):
    raise CliError(f'{root} is a file, not a checkpoint directory.')
  steps = _step_children(root)
  if not steps:
    if looks_like_step(root):
      raise CliError(
          f'{root} is a single checkpoint step, not a directory of steps; '
          f'run `orbax-pathways show {root}` instead.'
      )
    raise CliError(
        f'{root} is not an Orbax checkpoint directory: found no step directories '
        f'(named <N>, <prefix>_<N> or <N>{fmt.TMP_SUFFIX}).'
    )
  return [p for _, p in sorted(steps, key=lambda t: (t[0][0], t[0][1], t[1].name))]


def _local_only_dirs(root: epath.Path) -> list[tuple[int, epath.Path]]:
  """(step, directory) of every step directory, committed or not, of ``root``'s local-only
  steps (``<root>/.orbax-pathways-local``, docs/multi_tier.md), sorted; [] when none."""
  local = root / fmt.LOCAL_STEPS_DIR
  if not (paths.exists(local) and paths.is_dir(local)):
    return []
  return sorted((n, d) for (n, _), d in _step_children(local))


def local_only_steps(root: epath.Path) -> list[int]:
  """The step numbers of ``root``'s local-only steps (``_local_only_dirs``)."""
  return sorted({n for n, _ in _local_only_dirs(root)})


def resolve_step(path: str | os.PathLike[str], step: int | None = None) -> epath.Path:
  """``DIR/STEP`` or ``DIR`` + ``--step N`` -> the step directory. Raises CliError."""
  p = paths.to_path(path)
  if step is None:
    if not paths.exists(p):
      parent = p.parent
      parsed = parse_step_name(p.name)
      if parsed and paths.exists(parent):
        present = _step_numbers(parent)
        raise CliError(
            f'step directory {p} does not exist; steps in {parent}: {present or "none"}.'
            + _local_hint(parent, parsed[0]))
      raise CliError(f'{p} does not exist: pass a checkpoint step directory (DIR/STEP).')
    if is_step_dir(p):
      return p
    present = _step_numbers(p)  # Raises when p is not a checkpoint root either.
    raise CliError(
        f'{p} is a checkpoint directory with steps {present}; '
        f'pass one step: {p}/<STEP> or --step N.'
    )
  candidates = [
      d for d in list_step_dirs(p) if (parse_step_name(d.name) or (None,))[0] == step
  ]
  if not candidates:
    raise CliError(f'step {step} not found in {p}; steps present: {_step_numbers(p)}.'
                   + _local_hint(p, step))
  final = [d for d in candidates if not fmt.is_tmp(d.name)]
  return (final or candidates)[0]


def resolve_root_or_step(path: str | os.PathLike[str]) -> list[epath.Path]:
  """``DIR`` -> its step directories; ``DIR/STEP`` (committed or not) -> [that step]."""
  p = paths.to_path(path)
  if paths.exists(p) and is_step_dir(p):
    return [p]
  return list_step_dirs(p)


def _local_hint(root: epath.Path, step: int) -> str:
  """' Step N is a local-only step: <its path>.' when it is one of ``root``'s, else ''."""
  found = [d for n, d in _local_only_dirs(root) if n == step]
  if not found:
    return ''
  return f' Step {step} is a local-only step (array bytes in node-local tiers): {found[0]}.'


def _step_numbers(root: epath.Path) -> str:
  nums = []
  for d in list_step_dirs(root):
    parsed = parse_step_name(d.name)
    assert parsed is not None, 'list_step_dirs returns only directories named as steps'
    n, tmp = parsed
    nums.append(f'{n}{" (partial)" if tmp else ""}')
  return ', '.join(nums)


# ----------------------------------------------------------------------------------------------
# Reading one step.


def read_step(path: epath.PathLike, *, open_arrays: bool = False) -> Step:
  """Reads one step: state, commit time, items and their leaves (zarr metadata if open_arrays)."""
  path = paths.to_path(path)
  parsed = parse_step_name(path.name)
  step = Step(path=path, name=path.name, step=parsed[0] if parsed else None, state=PARTIAL)
  with paths.remote_errors(path):
    ckpt_meta = _read_checkpoint_metadata(path, step)
    handlers = (ckpt_meta or {}).get('item_handlers') or {}
    step.items = _read_items(path, handlers if isinstance(handlers, dict) else {})
  for item in step.items:
    step.problems.extend(item.problems)
  step.state = _state(step, ckpt_meta, paths.exists(path / fmt.COMMIT_SUCCESS_FILE))
  if open_arrays:
    for item in step.items:
      arrays.open_leaves(item)
  return step


def _read_checkpoint_metadata(path: epath.Path, step: Step) -> dict[str, Any] | None:
  p = path / fmt.CHECKPOINT_METADATA_FILE
  if not p.exists():
    if not step.tmp:
      step.problems.append(f'{p} is missing')
    return None
  try:
    meta = paths.read_json(p)
    if not isinstance(meta, dict):
      raise DamagedFile(p, f'expected a JSON object, found {type(meta).__name__}')
  except DamagedFile as e:
    step.problems.append(damaged(e))
    return None
  ts = meta.get('commit_timestamp_nsecs')
  step.commit_ns = int(ts) if isinstance(ts, (int, float)) and ts else None
  return meta


def _state(step: Step, ckpt_meta: dict[str, Any] | None, committed_file: bool) -> str:
  if step.tmp:
    return PARTIAL
  marked = committed_file or step.commit_ns is not None
  unreadable = bool(step.problems)
  if marked:
    return CORRUPT if unreadable else COMPLETE
  # Final name, no marker: unfinished (commit-file mode) unless its metadata is itself damaged.
  if ckpt_meta is None and paths.exists(step.path / fmt.CHECKPOINT_METADATA_FILE):
    return CORRUPT
  step.problems.append('no commit marker (commit_success.txt or commit timestamp)')
  return PARTIAL


def _read_items(step_dir: epath.Path, handlers: dict[str, Any]) -> list[Item]:
  if (step_dir / fmt.ITEM_METADATA_FILE).exists():  # A bare PyTreeCheckpointer: step = item.
    return [read_item(step_dir, '.', None)]
  items = []
  for p in paths.listdir(step_dir):
    if not p.is_dir():
      continue
    name = fmt.final_name(p.name)
    if name in handlers or (p / fmt.ITEM_METADATA_FILE).exists() or fmt.is_tmp(p.name):
      items.append(read_item(p, name, handlers.get(name)))
  return items


def read_item(path: epath.Path, name: str, handler: str | None) -> Item:
  """Reads ``_METADATA``, ``_sharding`` and our metadata of one item (no tensorstore)."""
  item = Item(name=name, path=path, kind='other', handler=handler)
  meta_path = path / fmt.ITEM_METADATA_FILE
  if meta_path.exists():
    item.kind = 'pytree'
    try:
      _parse_item_metadata(item, paths.read_json(meta_path))
    except DamagedFile as e:
      item.tree_error = damaged(e)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
      item.tree_error = damaged(DamagedFile(
          meta_path, f'unexpected structure: {type(e).__name__}: {e}'))
    if item.tree_error:
      item.leaves = []
      item.problems.append(item.tree_error)
      item.use_ocdbt = (path / fmt.OCDBT_MANIFEST_FILE).exists()
  elif _is_pytree_handler(handler) and not fmt.is_tmp(path.name):
    item.problems.append(f'{meta_path} is missing')
  try:
    item.pathways = meta_io.read_item(path)
  except records_lib.MetadataError as e:
    item.problems.append(str(e))
  _attach_shardings(item)
  return item


def _is_pytree_handler(handler: str | None) -> bool:
  return handler is not None and ('PyTree' in handler or 'Standard' in handler)


def _parse_item_metadata(item: Item, meta: dict[str, Any]) -> None:
  tree = meta['tree_metadata']
  item.use_ocdbt = bool(meta.get('use_ocdbt', False))
  item.use_zarr3 = bool(meta.get('use_zarr3', False))
  item.store_fill = bool(meta.get('store_array_data_equal_to_fill_value', False))
  for entry in tree.values():
    keypath = tuple(str(k['key']) for k in entry['key_metadata'])
    value = entry['value_metadata']
    ws = value.get('write_shape')
    item.leaves.append(
        Leaf(
            key='.'.join(keypath),
            keypath=keypath,
            value_type=str(value.get('value_type')),
            write_shape=tuple(ws) if ws is not None else None,
        )
    )
  if 'use_ocdbt' not in meta:  # Older Orbax: OCDBT iff the merged manifest exists.
    item.use_ocdbt = (item.path / fmt.OCDBT_MANIFEST_FILE).exists()


def _attach_shardings(item: Item) -> None:
  """Fills each leaf's sharding (ours first, else Orbax's ``_sharding``) and our record."""
  records = item.pathways.arrays() if item.pathways else {}
  orbax = _read_orbax_shardings(item)
  for leaf in item.leaves:
    leaf.record = records.get(leaf.key)
    if leaf.record is not None and leaf.record.sharding is not None:
      leaf.sharding = _from_record(leaf.record.sharding)
    elif leaf.key in orbax:
      leaf.sharding = orbax[leaf.key]
  if item.kind != 'pytree' or item.tree_error:
    return
  known = {l.key for l in item.leaves}
  for name in sorted(set(records) - known):
    item.problems.append(
        f'{item.path / fmt.PATHWAYS_DIR}: array {name!r} is not in {fmt.ITEM_METADATA_FILE}'
    )


def _from_record(r: records_lib.ShardingRecord) -> Sharding:
  return Sharding(
      source='pathways', kind=r.kind, mesh_shape=tuple(r.mesh_shape),
      axis_names=tuple(r.axis_names), spec=tuple(r.spec), device_ids=tuple(r.device_ids),
      num_slices=r.num_slices, slice_axes=tuple(r.slice_axes),
  )


def _read_orbax_shardings(item: Item) -> dict[str, Sharding]:
  p = item.path / fmt.SHARDING_FILE
  if not p.exists():
    return {}
  try:
    raw = paths.read_json(p)
    out = {}
    for k, v in raw.items():
      name = base64.urlsafe_b64decode(k.encode()).decode()
      out[name] = _parse_orbax_sharding(json.loads(v) if isinstance(v, str) else v)
    return out
  except DamagedFile as e:
    item.problems.append(damaged(e))
  except (ValueError, TypeError, AttributeError, KeyError) as e:
    item.problems.append(damaged(DamagedFile(p, f'{type(e).__name__}: {e}')))
  return {}


def _parse_orbax_sharding(d: dict[str, Any]) -> Sharding:
  kind = d.get('sharding_type')
  if kind == 'NamedSharding':
    ids = tuple(int(x['id']) for x in _flatten(d.get('device_mesh', {}).get('mesh', [])))
    spec = tuple(tuple(p) if isinstance(p, list) else p for p in d.get('partition_spec', []))
    return Sharding(
        source='orbax', kind='named', mesh_shape=tuple(d.get('shape', ())),
        axis_names=tuple(d.get('axis_names', ())), spec=spec, device_ids=ids,
    )
  if kind == 'SingleDeviceSharding':
    return Sharding(source='orbax', kind='single_device', device=d.get('device_str'))
  return Sharding(source='orbax', kind=str(kind or 'other'))


def _flatten(x: Any) -> Iterator[Any]:
  if isinstance(x, list):
    for y in x:
      yield from _flatten(y)
  else:
    yield x
