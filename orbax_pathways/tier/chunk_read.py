"""One chunk's raw bytes put into its place in a region buffer, and their crc32c as they lie there.

Who calls what, on which host: the restore's source chain (``fleet/chain.SourceChain``, on the
reading host, in the restore's executor threads, one region at a time) makes a ``Place`` for each
chunk a source serves. ``fleet/chain.LocalSource.read_into`` fills it from this node's tier file
(``fill_from_file``: a chunk that is one page-aligned run of a mapped region buffer is the tier
file's own pages, mapped there privately by ``storage/pages``; any other, the kernel copies the
file's bytes straight into the region buffer: no intermediate array, no conversion); a source
that returns an array (a peer, the relay) goes in bit for bit (``fill_from_array``). The chain then compares ``crc32c``, computed over the bytes as
they lie in the region buffer, with the committed record.

Where a chunk lies in a C-ordered region buffer is pure arithmetic (``runs``): equally long
contiguous byte runs, one when the chunk spans the region's trailing dimensions (or is the whole
region), else one per row of its leading dimensions (a column block). Runs of at least
``MIN_RUN_BYTES`` are read in place with ``readv`` (at most ``IOV_MAX`` runs per call) and
checksummed run by run; a chunk of shorter runs is read into one contiguous staging buffer,
checksummed there and copied in with numpy (thousands of tiny reads cost more than one copy).

No jax; numpy and file descriptors only.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
from typing import Sequence

import crc32c as _crc32c
import numpy as np

from orbax_pathways.format import checksum
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.storage import pages

Box = boxes_lib.Box
MIN_RUN_BYTES = 4096
try:
  IOV_MAX = max(1, min(1024, os.sysconf('SC_IOV_MAX')))
except (AttributeError, ValueError, OSError):
  IOV_MAX = 16  # POSIX's minimum


def _layout(region_shape: Sequence[int], shape: Sequence[int],
            itemsize: int) -> tuple[list[int], int]:
  """(byte strides of a C-ordered buffer of ``region_shape``, the outermost dimension a run of a
  box of ``shape`` covers: every dimension after it is whole)."""
  ndim = len(region_shape)
  strides = [itemsize] * ndim
  for d in range(ndim - 2, -1, -1):
    strides[d] = strides[d + 1] * int(region_shape[d + 1])
  m = ndim - 1
  while m > 0 and shape[m] == region_shape[m]:
    m -= 1
  return strides, m


def runs(region_shape: Sequence[int], start: Sequence[int], shape: Sequence[int],
         itemsize: int) -> tuple[int, int, int]:
  """Where a box (``start``, ``shape``, relative to the region) lies in a C-ordered buffer of
  ``region_shape``: (byte offset of its first run, bytes per run, number of runs). Pure."""
  if not len(region_shape):
    return 0, itemsize, 1
  if any(s == 0 for s in shape):
    return 0, 0, 0
  strides, m = _layout(region_shape, shape, itemsize)
  first = sum(int(a) * s for a, s in zip(start, strides))
  return first, int(shape[m]) * strides[m], math.prod(int(s) for s in shape[:m])


def run_offsets(region_shape: Sequence[int], start: Sequence[int], shape: Sequence[int],
                itemsize: int) -> list[int]:
  """The byte offset of every run of ``runs``, in C order of the box. Pure."""
  first, _, count = runs(region_shape, start, shape, itemsize)
  if count <= 1:
    return [first] if count else []
  strides, m = _layout(region_shape, shape, itemsize)
  index = np.indices(tuple(int(s) for s in shape[:m]), dtype=np.int64).reshape(m, -1)
  return (first + np.asarray(strides[:m], np.int64) @ index).tolist()


def _readv_exact(fd: int, bufs: list[memoryview], nbytes: int, path: str) -> None:
  """Fills ``bufs`` in order with the next ``nbytes`` bytes of ``fd``; ``OSError`` if the file
  ends first."""
  done, i = 0, 0
  while i < len(bufs):
    got = os.readv(fd, bufs[i:i + IOV_MAX])
    if got == 0:
      raise OSError(errno.EIO, f'{path} ended after {done} of {nbytes} bytes')
    done += got
    while got and i < len(bufs):
      if got >= len(bufs[i]):
        got -= len(bufs[i])
        i += 1
      else:
        bufs[i] = bufs[i][got:]
        got = 0


class Place:
  """One chunk's place in a region buffer: ``region`` (C-contiguous, the stored dtype) holds
  ``region_box``; ``chunk`` lies wholly inside it. ``view`` is the chunk's (possibly strided)
  view; after a fill, ``crc32c`` is the checksum of the chunk's bytes as they lie there."""

  def __init__(self, region: np.ndarray, region_box: Box, chunk: Box):
    self.region = region
    self.region_box = region_box
    self.chunk = chunk
    # ``...`` keeps a 0-d region a view (``region[()]`` would be a scalar copy).
    self.view = region[chunk.relative_to(region_box)] if region.ndim else region[...]
    self.dtype = region.dtype
    self.nbytes = chunk.size * region.dtype.itemsize
    self.crc32c: int | None = None
    self._rel_start = tuple(a - o for a, o in zip(chunk.start, region_box.start))
    self._first, self._run, self._count = runs(region.shape, self._rel_start, chunk.shape,
                                               region.dtype.itemsize)

  def _in_place(self) -> list[memoryview] | None:
    """The chunk's runs as writable byte views of the region buffer, or None when they are too
    short to read in place (or the region buffer is not C-contiguous)."""
    if self._count == 0 or not self.region.flags.c_contiguous:
      return None
    if self._count > 1 and self._run < MIN_RUN_BYTES:
      return None
    flat = self.region.reshape(-1).view(np.uint8).data
    run = self._run
    if self._count == 1:
      return [flat[self._first:self._first + run]]
    offsets = run_offsets(self.region.shape, self._rel_start, self.chunk.shape,
                          self.region.dtype.itemsize)
    return [flat[o:o + run] for o in offsets]

  def fill_from_file(self, fd: int, path: str) -> None:
    """Reads the chunk's ``nbytes`` raw bytes from ``fd`` (at its current offset: 0 for a file
    just opened) into the region buffer, as bits; sets ``crc32c``. ``OSError`` if the file ends
    first."""
    if self.nbytes == 0:
      self.crc32c = 0
      return
    if self._count == 1:
      # A chunk that is one page-aligned run of a mapped region buffer: the tier file's own
      # pages, mapped privately in place (``storage/pages``), checked as they lie there.
      mapped = pages.map_file(self.region, self._first, self.nbytes, fd)
      if mapped is not None:
        self.crc32c = _crc32c.crc32c(mapped)
        return
    bufs = self._in_place()
    if bufs is not None:
      _readv_exact(fd, list(bufs), self.nbytes, path)
      self.checksum_in_place()
      return
    staging = np.empty(self.nbytes, np.uint8)
    _readv_exact(fd, [staging.data], self.nbytes, path)
    self.crc32c = _crc32c.crc32c(staging.data)
    np.copyto(self.view, staging.view(self.dtype).reshape(self.view.shape), casting='no')

  def fill_from_array(self, data: np.ndarray) -> None:
    """Copies ``data`` (the chunk in the region's dtype and the chunk's shape) in bit for bit;
    sets ``crc32c``. ``ValueError`` when its dtype or shape differ: nothing is converted."""
    if data.dtype != self.dtype or tuple(data.shape) != tuple(self.view.shape):
      raise ValueError(f'{data.dtype} {list(data.shape)} where the committed step stores '
                       f'{self.dtype} {list(self.view.shape)}')
    np.copyto(self.view, data, casting='no')
    self.checksum_in_place()

  def checksum_in_place(self) -> None:
    """Sets ``crc32c`` from the chunk's bytes as they lie in the region buffer now (after a
    fill, or where its band was mapped: ``map_band``)."""
    # One run, or runs long enough to hash one by one; else ``checksum`` hashes the view slab by
    # slab (thousands of short runs would each be a Python call holding the GIL).
    bufs = self._in_place() if self._count == 1 or self._run >= checksum.BLOCK_BYTES else None
    if bufs is None:
      self.crc32c = checksum.of_array(self.view)
      return
    crc = 0
    for b in bufs:
      crc = _crc32c.crc32c(b, crc)
    self.crc32c = crc

  def fill_from_band(self, fd: int, band_start: Sequence[int], band_shape: Sequence[int]) -> None:
    """Copies the chunk's bytes out of a band file (``fd``: C order of a box of ``band_shape``
    at ``band_start``, the region's dtype; the caller opened it with exactly that size) into its
    place, as bits; sets ``crc32c``. The file is mapped read-only for the copy (no staging
    buffer), and unmapped before this returns."""
    if self.nbytes == 0:
      self.crc32c = 0
      return
    nbytes = math.prod(int(x) for x in band_shape) * self.dtype.itemsize
    rel = tuple(slice(a - b, a - b + n) for a, b, n in zip(self.chunk.start, band_start,
                                                          self.chunk.shape))
    with mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
      band = np.frombuffer(m, self.dtype, math.prod(int(x) for x in band_shape)).reshape(
          tuple(int(x) for x in band_shape))
      try:
        np.copyto(self.view, band[rel], casting='no')
      finally:
        del band  # the mapping closes only once no array looks at it
    self.checksum_in_place()


def band_run(region: np.ndarray, region_box: Box, band_start: Sequence[int],
             band_shape: Sequence[int]) -> int | None:
  """The byte offset in ``region`` (C-contiguous, holding ``region_box``) where a band of
  ``band_shape`` at ``band_start`` lies as one contiguous run, or None (it is not inside the
  region, or not one run of it). Pure."""
  if region_box.ndim == 0 or not region.flags.c_contiguous:
    return None
  if any(b < r0 or b + n > r1 for b, n, r0, r1 in zip(band_start, band_shape, region_box.start,
                                                      region_box.stop)):
    return None
  rel = tuple(b - r0 for b, r0 in zip(band_start, region_box.start))
  first, _, count = runs(region.shape, rel, band_shape, region.dtype.itemsize)
  return first if count == 1 else None
