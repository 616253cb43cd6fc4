"""``orbax-pathways diff``: what changed between two steps, and what was compared to say so.

Runs on the machine running the CLI (``main.cmd_diff``). Always compared: the leaves of each
item's tree (added / removed), and per common leaf its value type, dtype, shape and sharding.
Values: with ``--values`` both arrays are read chunk by chunk (max |a - b|); without, arrays that
both steps recorded in ``_pathways`` on the same chunk grid are compared by their recorded crc32c,
without reading any data. Arrays both steps recorded whose checksums cannot decide (another chunk
grid, e.g. saved on another mesh or with another ``max_chunk_bytes``; or records missing chunks)
are read and compared by value like ``--values`` (``compared.values_read`` lists them). Leaves
compared neither way (no checksums on one side) are listed as not compared. A jax.Array of a
local-only step (``DIR/.orbax-pathways-local/N``) has no bytes on storage: it is compared by its
recorded checksums, with ``--values`` too, or listed as not compared, saying so.
"""

from __future__ import annotations

from typing import Any

from orbax_pathways.format import names as fmt
from orbax_pathways.cli import arrays
from orbax_pathways.cli.model import TIER_ONLY, Item, Leaf, Step
from orbax_pathways.cli.paths import CliError

STRUCTURE = ('value_type', 'dtype', 'shape', 'sharding')
READ, CRC32C = 'read', 'crc32c'  # how values were compared


def diff_steps(a: Step, b: Step, *, values: bool) -> dict[str, Any]:
  """The JSON document ``diff --json`` prints (``render.diff_text`` prints it as text)."""
  for step in (a, b):
    for item in step.items:
      if item.tree_error:
        raise CliError(f'cannot compare {step.path}: {item.tree_error}')
  la, lb = _leaf_map(a), _leaf_map(b)
  added = [_brief(k, lb[k][1]) for k in sorted(set(lb) - set(la))]
  removed = [_brief(k, la[k][1]) for k in sorted(set(la) - set(lb))]
  changed, unchanged, by_crc, not_compared, read, why = [], 0, 0, [], [], {}
  for k in sorted(set(la) & set(lb)):
    entry, basis = _compare(k, la[k], lb[k], values=values)
    by_crc += basis == CRC32C
    if basis == READ and not values:
      read.append(f'{k[0]}/{k[1]}')
    if basis is None and _has_value(la[k][1]) and 'shape' not in (entry or {}).get('changes', {}):
      not_compared.append(f'{k[0]}/{k[1]}')
      why[f'{k[0]}/{k[1]}'] = (
          TIER_ONLY + '; ' + why_not_by_checksums(la[k][1], lb[k][1])
          if _tier_only(la[k], lb[k])
          else 'unreadable' if values else why_not_by_checksums(la[k][1], lb[k][1]))
    if entry:
      changed.append(entry)
    else:
      unchanged += 1
  return {
      'a': str(a.path), 'b': str(b.path), 'values_compared': values,
      'identical': not (added or removed or changed),
      'added': added, 'removed': removed, 'changed': changed, 'unchanged': unchanged,
      'compared': {'structure': list(STRUCTURE), 'values': READ if values else CRC32C,
                   'values_by_crc32c': by_crc, 'values_read': read,
                   'values_not_compared': not_compared, 'values_not_compared_why': why},
  }


def _leaf_map(step: Step) -> dict[tuple[str, str], tuple[Item, Leaf]]:
  return {(i.name, l.key): (i, l) for i in step.items for l in i.leaves}


def _tier_only(*sides: tuple[Item, Leaf]) -> bool:
  """Whether either side is a jax.Array of a local-only step: no bytes on storage to read, only
  its recorded checksums."""
  return any(item.in_tiers_only(leaf) for item, leaf in sides)


def _has_value(leaf: Leaf) -> bool:
  return leaf.is_array or leaf.value_type == 'string'


def _brief(k, l: Leaf) -> dict[str, Any]:
  return {'item': k[0], 'key': k[1], 'value_type': l.value_type, 'dtype': l.dtype,
          'shape': None if l.shape is None else list(l.shape)}


def _compare(k, a, b, *, values: bool) -> tuple[dict[str, Any] | None, str | None]:
  """(the changed entry or None, how values were compared: READ, CRC32C or None)."""
  (ia, la), (ib, lb) = a, b
  changes: dict[str, Any] = {}
  for field in STRUCTURE[:3]:
    va, vb = getattr(la, field), getattr(lb, field)
    if va != vb:
      changes[field] = [list(va) if isinstance(va, tuple) else va,
                        list(vb) if isinstance(vb, tuple) else vb]
  if (la.sharding.key() if la.sharding else None) != (lb.sharding.key() if lb.sharding else None):
    changes['sharding'] = [la.sharding.describe() if la.sharding else None,
                           lb.sharding.describe() if lb.sharding else None]
  max_abs, basis, chunks = None, None, None
  tier_only = _tier_only(a, b)  # nothing to read: the checksums decide, or nothing does
  crc = compare_checksums(la, lb) if tier_only or not values else None
  if crc is not None:
    basis = CRC32C
    differing, compared = crc
    if differing:
      changes['values'] = 'differ'
      chunks = [differing, compared]
  elif tier_only:
    pass
  elif 'shape' not in changes and (values or (la.record is not None and lb.record is not None)):
    # --values, or both sides recorded but their checksums cannot decide (another chunk grid,
    # or chunks without a record): read both.
    basis = READ
    try:
      max_abs = arrays.max_abs_diff(ia, la, ib, lb)
    except Exception as e:  # pylint: disable=broad-except  # tensorstore read errors.
      changes['values'] = f'unreadable: {arrays.first_line(e)}'
    else:
      if max_abs is None:
        basis = None
      elif max_abs != 0.0:
        changes['values'] = 'differ'

  if not changes:
    return None, basis
  return {'item': k[0], 'key': k[1], 'changes': changes, 'max_abs_diff': max_abs,
          'values_basis': basis if 'values' in changes else None,
          'chunks_differing': chunks}, basis


def why_not_by_checksums(la: Leaf, lb: Leaf) -> str:
  """Why ``compare_checksums`` could not decide for two arrays (a short phrase)."""
  ra, rb = la.record, lb.record
  if ra is None and rb is None:
    return 'no orbax-pathways checksums on either side'
  if ra is None or rb is None:
    return f'no orbax-pathways checksums in {"a" if ra is None else "b"}'
  if tuple(ra.chunk_shape) != tuple(rb.chunk_shape):
    return 'chunk grids differ, so their checksums cannot be compared'
  if ra.dtype != rb.dtype:
    return 'stored dtypes differ'
  return 'checksums recorded for only some chunks'


def compare_checksums(la: Leaf, lb: Leaf) -> tuple[int, int] | None:
  """(chunks whose recorded crc32c differ, chunks compared) for two arrays recorded on the same
  grid; None when the records cannot decide (absent, another grid, or incomplete and equal)."""
  ra, rb = la.record, lb.record
  if ra is None or rb is None:
    return None
  if (ra.dtype, tuple(ra.shape), tuple(ra.chunk_shape)) != (
      rb.dtype, tuple(rb.shape), tuple(rb.chunk_shape)):
    return None
  ca, cb = la.chunks, lb.chunks
  common = set(ca) & set(cb)
  differing = sum(1 for o in common if ca[o].crc32c != cb[o].crc32c)
  if differing:
    return differing, len(common)
  grid = set(fmt.chunk_origins(ra.shape, ra.chunk_shape))
  if grid <= common:
    return 0, len(grid)
  return None
