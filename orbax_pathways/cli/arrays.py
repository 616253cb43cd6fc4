"""Tensorstore access for the CLI: open saved arrays with Orbax's own spec rules
(``orbax_pathways.format.names``), read chunks, compare values.

Called by ``steps.read_step(open_arrays=True)``, ``verify`` and ``diff`` on the machine running
the CLI. Nothing here imports jax; tensorstore is imported on first use.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from orbax_pathways.format import names as fmt
from orbax_pathways.cli import paths
from orbax_pathways.cli.model import Item, Leaf

_CONTEXT = None


def ts_context():
  """One context for the process: OCDBT B-tree node cache (as Orbax), bounded file I/O."""
  global _CONTEXT
  if _CONTEXT is None:
    import tensorstore as ts  # pylint: disable=g-import-not-at-top

    _CONTEXT = ts.Context({
        'file_io_concurrency': {'limit': 64},
        'cache_pool#ocdbt': {'total_bytes_limit': 100_000_000},
    })
  return _CONTEXT


def array_spec(item: Item, leaf: Leaf) -> dict[str, Any]:
  return fmt.array_read_spec(
      os.fspath(item.path), leaf.key, ocdbt=item.use_ocdbt, zarr3=item.use_zarr3,
      raise_missing_chunks=item.store_fill,
      gcs_driver=os.environ.get('TENSORSTORE_GCS_BACKEND', 'gcs'))


def open_array(item: Item, leaf: Leaf):
  """Returns a tensorstore Future of the opened array (read-only)."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top

  return ts.open(array_spec(item, leaf), read=True, context=ts_context())


def open_leaves(item: Item) -> None:
  """Fills dtype/shape/chunk_shape of every array leaf (opened concurrently)."""
  futures = [(leaf, open_array(item, leaf)) for leaf in item.arrays]
  for leaf, fut in futures:
    try:
      t = fut.result()
    except Exception as e:  # pylint: disable=broad-except  # tensorstore raises ValueError etc.
      err = paths.classify_remote_error(item.path, e) if paths.is_remote(item.path) else None
      if err is not None and 'credentials' in str(err):
        raise err from e
      leaf.error = first_line(e)
      _fill_from_record(leaf)
      continue
    fill_from_store(leaf, t)


def fill_from_store(leaf: Leaf, t: Any) -> None:
  leaf.dtype = t.dtype.name
  leaf.shape = tuple(int(n) for n in t.shape)
  leaf.chunk_shape = write_chunk_shape(t)


def _fill_from_record(leaf: Leaf) -> None:
  if leaf.record is not None:
    leaf.dtype = leaf.record.dtype
    leaf.shape = tuple(leaf.record.shape)
    leaf.chunk_shape = tuple(leaf.record.chunk_shape)


def write_chunk_shape(t: Any) -> tuple[int, ...]:
  shape = t.chunk_layout.write_chunk.shape
  if shape is None:
    return ()
  return tuple(int(n) for n in shape)


def first_line(e: BaseException) -> str:
  """The error's first line, without the resolved spec tensorstore appends."""
  text = str(e).strip().splitlines()
  line = (text[0] if text else '').split(' [tensorstore_spec=')[0]
  return f'{type(e).__name__}: {line}'[:500]


def chunk_location(item: Item, leaf: Leaf, origin) -> str:
  """Human path of a chunk: a file for plain zarr, an OCDBT key inside the item otherwise."""
  key = fmt.param_chunk_key(leaf.key, origin, leaf.chunk_shape or (), zarr3=item.use_zarr3)
  base = os.fspath(item.path).rstrip('/')
  if item.use_ocdbt:
    return f'{base} (ocdbt key {key})'
  return f'{base}/{key}'


def kvstore_location(item: Item, leaf: Leaf) -> str:
  """Human path of an array: its zarr directory, or its key prefix inside the item's OCDBT."""
  base = os.fspath(item.path).rstrip('/')
  if item.use_ocdbt:
    return f'{base} (ocdbt key {leaf.key}/)'
  return f'{base}/{leaf.key}'


def max_abs_diff(ia: Item, la: Leaf, ib: Item, lb: Leaf) -> float | None:
  """Max |a - b| over two leaves of equal shape, read chunk by chunk (inf: NaN vs number).

  Strings compare to 0.0 (equal) or inf. None when the leaves are not comparable. Raises
  ValueError when either cannot be read.
  """
  if 'string' in (la.value_type, lb.value_type):
    va, vb = read_string(ia, la), read_string(ib, lb)
    return 0.0 if va == vb else math.inf
  if not (la.is_array and lb.is_array) or la.shape is None or la.shape != lb.shape:
    return None
  ta, tb = open_array(ia, la).result(), open_array(ib, lb).result()
  chunk = la.chunk_shape or la.shape
  worst = 0.0
  for origin in fmt.chunk_origins(la.shape, chunk):
    box = fmt.chunk_region(origin, chunk, la.shape).to_slices()
    fa, fb = ta[box].read(), tb[box].read()
    a, b = _as_float(fa.result()), _as_float(fb.result())
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    d = np.where(same, 0.0, np.abs(a - b))
    d = np.where(np.isnan(d), np.inf, d)
    if d.size:
      worst = max(worst, float(d.max()))
  return worst


def _as_float(a: np.ndarray) -> np.ndarray:
  if np.issubdtype(a.dtype, np.complexfloating):
    return a.astype(np.complex128)
  return a.astype(np.float64)


def read_string(item: Item, leaf: Leaf) -> Any:
  """A string leaf's value from the item's ``_strings.json``; ValueError naming the file."""
  p = item.path / fmt.STRINGS_FILE
  try:
    return paths.read_json(p)[leaf.key]
  except (OSError, KeyError, TypeError) as e:
    raise ValueError(f'{p}: {first_line(e)}') from e
