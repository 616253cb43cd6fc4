"""A node step's own chunk files as the first source of its restore: each chunk file mapped into
the restored array's buffer (or read into it) in place of tensorstore's read and copy.

Who calls what, on which host: the in-process transport's ``read`` (every process restoring a
node step from its node, ``multitier/node_steps.py``) puts ``StepFiles`` first in the restore's
source chain (``fleet/chain.py``) for an item stored without OCDBT; the chain asks ``held`` once
per array and ``read_into`` per chunk, in the restore's executor threads.

A node step is an Orbax checkpoint on this node written without OCDBT (zarr: one file per chunk
under ``<item>/<param>/``), uncompressed for floating-point arrays (``Options.compression``)
and chunked in row bands (``frontends/orbax_v0.ProxyArrayHandler.split_axes``): each chunk file
holds the chunk's raw bytes, in C order, and each chunk is one run of its shard. Such a file is
already in memory where the node's tier is tmpfs, so the chain maps it into the region buffer
(``tier/chunk_read.Place.fill_from_file``, ``storage/pages``): no copy and no fresh pages.
Every chunk is checked as it lies there against the crc32c the step's records hold, as any
source's; a chunk this source cannot give (an array stored compressed or in another layout, a
file missing or of another size than the record) is left to tensorstore's read of the same
files, which the reader verifies as before. So a damaged chunk fails the restore exactly as it
did without this source.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Container

import numpy as np

from orbax_pathways.fleet import chain as chain_lib
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.tier import chunk_read
from orbax_pathways.tier import fsafe

Box = boxes_lib.Box
_ZARRAY = '.zarray'
_MAX_ZARRAY_BYTES = 1 << 16  # zarr v2 metadata of one array: a few hundred bytes


class StepFiles:
  """The chunk files of the arrays of one item directory on this node, zarr v2 without a
  compressor or filters, in C order (``held``: every chunk of such an array, as the file a
  zarr reader would open)."""

  name = 'node'  # what stats count its bytes under, as a node step's tensorstore reads

  def __init__(self) -> None:
    self._lock = threading.Lock()
    # path -> (its directory, chunk key separator, dtype), or None: not raw chunk files
    self._arrays: dict[str, tuple[str, str, np.dtype] | None] = {}

  def _array(self, read: Any) -> tuple[str, str, np.dtype] | None:
    """(the array's directory, its chunk key separator, its stored dtype) where its chunks are
    raw files."""
    spec = read.tspec
    kvstore = spec.get('kvstore') or {}
    if spec.get('driver') != 'zarr' or kvstore.get('driver') != 'file':
      return None
    path = str(kvstore.get('path', '')).rstrip('/')
    with self._lock:
      if path not in self._arrays:
        self._arrays[path] = _raw_layout(path, read)
      return self._arrays[path]

  def held(self, read: Any) -> Container[tuple[int, ...]]:
    found = self._array(read)
    if found is None or read.chunk_shape is None:
      return ()
    return _Origins(tuple(read.plan.global_shape), tuple(read.chunk_shape))

  def read_into(self, read: Any, chunk: Box, place: chunk_read.Place) -> None:
    """The chunk's file into its place in the region buffer (mapped where it is one
    page-aligned run there); ``SourceError`` where the file is missing, not a regular file, or
    not the size the step's record gives the chunk."""
    found = self._array(read)
    if found is None:
      raise chain_lib.SourceError(f'{read.name!r} is not stored as raw chunk files')
    directory, separator, dtype = found
    if dtype != place.dtype:
      raise chain_lib.SourceError(f'{directory}: array {read.name!r} is {dtype} in its zarr '
                                  f'metadata, {place.dtype} in the step\'s records')
    key = separator.join(str(s // c) for s, c in zip(chunk.start, read.chunk_shape)) or '0'
    path = os.path.join(directory, key)
    record = read.chunks.get(chunk.start)
    size = record.nbytes if record is not None else place.nbytes
    with chain_lib.source_errors(path), fsafe.open_regular(path, size) as f:
      place.fill_from_file(f.fileno(), path)

  def read_chunk(self, read: Any, chunk: Box, dtype: np.dtype) -> np.ndarray:
    """The chunk's bytes as a new array (the ``Source`` protocol; the chain uses
    ``read_into``)."""
    out = np.empty(chunk.shape, dtype)
    self.read_into(read, chunk, chunk_read.Place(out, chunk, chunk))
    return out


class _Origins:
  """Every chunk origin of an array of ``shape`` in chunks of ``chunk_shape`` (a container:
  only membership is asked)."""

  def __init__(self, shape: tuple[int, ...], chunk_shape: tuple[int, ...]):
    self._shape, self._chunk = shape, chunk_shape

  def __contains__(self, origin: object) -> bool:
    if not isinstance(origin, tuple) or len(origin) != len(self._shape):
      return False
    return all(isinstance(o, int) and 0 <= o < max(s, 1) and o % c == 0
               for o, s, c in zip(origin, self._shape, self._chunk))


def _raw_layout(directory: str, read: Any) -> tuple[str, str, np.dtype] | None:
  """(``directory``, its chunk key separator, its dtype) where the zarr v2 array there stores
  each chunk as its raw bytes: no compressor, no filters, C order, little-endian (where the
  dtype has an order), the step's chunk shape and shape; else None."""
  try:
    with fsafe.open_regular(os.path.join(directory, _ZARRAY)) as f:
      meta = json.loads(f.read(_MAX_ZARRAY_BYTES))
  except (OSError, ValueError):
    return None
  if not isinstance(meta, dict) or meta.get('zarr_format') != 2:
    return None
  if meta.get('compressor') is not None or meta.get('filters') or meta.get('order') != 'C':
    return None
  if (list(meta.get('chunks') or ()) != list(read.chunk_shape or ())
      or list(meta.get('shape') or ()) != list(read.plan.global_shape)):
    return None
  try:
    dtype = chain_lib.layout_dtype(str(meta.get('dtype')).lstrip('<|'))
  except TypeError:
    return None
  if str(meta.get('dtype')).startswith('>'):
    return None
  separator = meta.get('dimension_separator', '.')
  return (directory, separator, dtype) if separator in ('.', '/') else None
