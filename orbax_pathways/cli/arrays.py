"""Tensorstore access for the CLI: open saved arrays with Orbax's own spec rules, chunk grids,
value comparison. Called by ``inspect.read_step(open_arrays=True)``, ``verify`` and ``diff``.
Nothing here imports jax."""

from __future__ import annotations

import itertools
import math
import os
from typing import Any, Iterator, Sequence

import numpy as np

from orbax_pathways import metadata as pw_metadata
from orbax_pathways.cli.inspect import Item, Leaf, _read_json, classify_remote_error, is_remote


# ----------------------------------------------------------------------------------------------
# Tensorstore: Orbax's own spec rules (tensorstore_utils.ArrayReadSpec / build_kvstore_tspec).


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


def _base_kvstore(path: str) -> dict[str, Any]:
  if path.startswith('gs://'):
    bucket, _, rest = path[len('gs://'):].partition('/')
    return {
        'driver': os.environ.get('TENSORSTORE_GCS_BACKEND', 'gcs'),
        'bucket': bucket,
        'path': rest,
    }
  return {'driver': 'file', 'path': path}


def kvstore_spec(item: Item, key: str) -> dict[str, Any]:
  """Where the zarr array ``key`` of ``item`` lives."""
  base = os.fspath(item.path).rstrip('/')
  if item.use_ocdbt:
    return {
        'driver': 'ocdbt',
        'base': _base_kvstore(base + '/'),
        'path': key,
        'cache_pool': 'cache_pool#ocdbt',
    }
  return _base_kvstore(f'{base}/{key}')


def array_spec(item: Item, leaf: Leaf) -> dict[str, Any]:
  return {
      'driver': 'zarr3' if item.use_zarr3 else 'zarr',
      'kvstore': kvstore_spec(item, leaf.key),
      'recheck_cached_data': False,
      'recheck_cached_metadata': False,
      # Orbax always stores chunks equal to the fill value, so a missing chunk is an error.
      'fill_missing_data_reads': not item.store_fill,
  }


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
      err = classify_remote_error(item.path, e) if is_remote(item.path) else None
      if err is not None and 'credentials' in str(err):
        raise err from e
      leaf.error = first_line(e)
      _fill_from_record(leaf)
      continue
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


def chunk_origins(shape: Sequence[int], chunk: Sequence[int]) -> Iterator[tuple[int, ...]]:
  """Origins of the regular chunk grid over ``shape`` (one empty origin for a scalar)."""
  return itertools.product(*[range(0, s, max(c, 1)) for s, c in zip(shape, chunk)])


def chunk_box(origin: Sequence[int], chunk: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
  """The chunk region clipped to the array bounds."""
  return tuple(slice(o, min(o + c, s)) for o, c, s in zip(origin, chunk, shape))


def chunk_key(item: Item, leaf: Leaf, origin: Sequence[int]) -> str:
  """Storage key of the chunk at ``origin`` (Orbax's zarr v2 '.' separator / zarr3 default)."""
  chunk = leaf.chunk_shape or ()
  idx = [str(o // c) if c else '0' for o, c in zip(origin, chunk)]
  if item.use_zarr3:
    return '/'.join(['c', *idx])
  return '.'.join(idx) if idx else '0'


def chunk_location(item: Item, leaf: Leaf, origin: Sequence[int]) -> str:
  """Human path of a chunk: a file for plain zarr, an OCDBT key inside the item otherwise."""
  key = f'{leaf.key}/{chunk_key(item, leaf, origin)}'
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
    va, vb = _read_string(ia, la), _read_string(ib, lb)
    return 0.0 if va == vb else math.inf
  if not (la.is_array and lb.is_array) or la.shape is None or la.shape != lb.shape:
    return None
  ta, tb = open_array(ia, la).result(), open_array(ib, lb).result()
  chunk = la.chunk_shape or la.shape
  worst = 0.0
  for origin in chunk_origins(la.shape, chunk):
    box = chunk_box(origin, chunk, la.shape)
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


def _read_string(item: Item, leaf: Leaf) -> Any:
  try:
    return _read_json(item.path / STRINGS_FILE)[leaf.key]
  except (OSError, KeyError) as e:
    raise ValueError(f'{item.path / STRINGS_FILE}: {first_line(e)}') from e
