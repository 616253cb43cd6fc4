"""Reads the regions a host needs and verifies chunk checksums. No devices, no jax.

Runs on the reading host: the controller process (in-process transport) or a Pathways worker
(colocated transport). It returns host buffers per needed box; the caller puts them on devices.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import mmap
import time
from typing import Any, Mapping

import numpy as np
import tensorstore as ts

from orbax_pathways.format import checksum
from orbax_pathways import errors
from orbax_pathways.format import records as records_lib
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import restore as restore_plan
from orbax_pathways.storage import cast as cast_lib
from orbax_pathways.storage import hedge
from orbax_pathways.storage import pages

Box = boxes_lib.Box


@dataclasses.dataclass(frozen=True)
class ArrayRead:
  name: str
  path: str
  tspec: dict
  plan: restore_plan.ArrayReadPlan
  chunk_shape: tuple[int, ...] | None
  chunks: Mapping[tuple[int, ...], records_lib.ChunkRecord]  # empty: nothing to verify
  target_dtype: np.dtype | None
  # True when the array was written with checksums: a chunk without a record is then an error
  # (a writer's record went missing), not a chunk to skip.
  require_checksums: bool = False
  stored_dtype: str | None = None  # the committed record's dtype (None: ask tensorstore)


@dataclasses.dataclass
class ReadStats:
  bytes_read: int = 0  # from every source
  chunks_verified: int = 0
  storage_bytes: int = 0  # of ``bytes_read``, from storage (the rest: the source chain's)
  storage_s: float = 0.0  # seconds of storage reads, summed over concurrent reads


# Buffers of at least this many bytes are anonymous mappings of their own (``aligned_empty``).
MAPPED_BYTES = 4 << 20


async def _read_tier_only(read: ArrayRead, chain: Any, *, verify: bool,
                          stats: ReadStats) -> dict[Box, np.ndarray]:
  """``read_array`` for a local-only step (``docs/multi_tier.md``): every chunk from the source
  chain (this node's tier, the other processes', verified against the committed record as
  always), none from storage, which holds no bytes of it. A chunk no source could give raises
  ``LocalStepIncompleteError`` naming the array and the first such chunk: nothing of the step
  is returned."""
  del verify  # the chain checks every chunk it gives against the committed crc32c and size
  if 0 in read.plan.global_shape:  # no chunk to check or fetch: every box is empty
    dtype = read.target_dtype if read.target_dtype is not None else read.stored_dtype
    return {box: np.empty(box.shape, np.dtype(dtype))
            for region in read.plan.regions for box in region.device_boxes}
  if read.stored_dtype is None or not read.chunks:
    raise errors.LocalStepIncompleteError(
        f'array {read.name!r} of the local-only step at {read.path} has no committed record '
        '(its writer\'s record or the index lacks it): its chunks cannot be checked, so the '
        'step is not restored from the node-local tiers.')
  dtype = np.dtype(read.stored_dtype)

  async def one(region: restore_plan.Region) -> list[tuple[Box, np.ndarray]]:
    data = aligned_empty(region.box.shape, dtype)
    missing = await chain.fill(read, region.box, data)
    if missing:
      raise errors.LocalStepIncompleteError(
          f'chunk {list(missing[0].start)} of array {read.name!r} of the local-only step at '
          f'{read.path} is held by no live process\'s node-local tier ({len(missing)} chunk '
          'region(s) of this region lack one), and storage holds no bytes of a local-only '
          'step. Resume passes this step over for an older one.')
    stats.bytes_read += data.nbytes
    if read.target_dtype is not None and data.dtype != read.target_dtype:
      data = cast_lib.convert(data, read.target_dtype, what=f'array {read.name!r}',
                              fix=cast_lib.RESTORE_FIX)
    return [(box, data if box == region.box else data[box.relative_to(region.box)])
            for box in region.device_boxes]

  parts = await asyncio.gather(*(one(r) for r in read.plan.regions), return_exceptions=True)
  for part in parts:
    if isinstance(part, BaseException):
      raise part
  return {box: buf for part in parts if not isinstance(part, BaseException) for box, buf in part}


def aligned_empty(shape, dtype, alignment: int = 64) -> np.ndarray:
  """An uninitialized C-order array whose data starts on an ``alignment``-byte boundary.

  On the CPU backend ``jax.device_put`` of a 64-byte-aligned array aliases it instead of copying,
  so regions read into such buffers reach the devices without another pass over the bytes.

  A buffer of ``MAPPED_BYTES`` or more is a page mapping of its own (``storage/pages``), not
  numpy's allocation, which asks the kernel for transparent huge pages on every large array
  (``MADV_HUGEPAGE``). On the VMs this project is measured on, the first touch of fresh huge
  pages is what made the first restore of a process slow: 1.1 GiB restored in a fresh process
  spent 4-5 s in the kernel (``benchmarks/RESULTS.md``, "Restore buffers: the restore rows,
  2026-12-06"); on 2026-12-02 (a 2-core VM, ``benchmarks/tier_read.py --size-gb 1.1`` and a
  /tmp instrumentation script) one such tier-served restore took 513 huge-page faults and
  5.2-5.6 s of CPU, nearly all kernel, against 1.2 s with ordinary pages. Ordinary pages fault
  4 KiB at a time; the mappings' pool makes a later restore in the same process reuse pages
  already faulted in, as numpy's heap did.
  """
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if nbytes >= MAPPED_BYTES and alignment <= mmap.PAGESIZE:
    return pages.anonymous(shape, dtype)  # a tier chunk may be mapped into it (``pages``)
  raw = np.empty(nbytes + alignment, np.uint8)
  offset = (-raw.ctypes.data) % alignment
  return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def verify_region(read: ArrayRead, region: Box, data: np.ndarray) -> int:
  """Checks every recorded chunk lying wholly inside ``region``; returns how many it checked."""
  if read.chunk_shape is None or (not read.chunks and not read.require_checksums):
    return 0
  checked = 0
  for cell in boxes_lib.chunk_grid(region, read.chunk_shape):
    chunk = boxes_lib.clip(cell, read.plan.global_shape)
    if not region.contains(chunk):
      continue
    record = read.chunks.get(chunk.start)
    if record is None:
      if read.require_checksums:
        raise errors.MissingChecksumError(
            f'Array {read.name!r}, chunk at {list(chunk.start)} (shape {list(chunk.shape)}) of '
            f'{read.path} has no recorded checksum, although the array was written with '
            'checksums: a writer\'s _pathways record is missing, so these bytes cannot be '
            'verified. Restore an earlier step, run `orbax-pathways verify` on this one, or '
            'restore with verification off (Options(verify_checksums=False)) at your own risk.')
      continue
    found = checksum.of_array(data[chunk.relative_to(region)])
    if found != record.crc32c:
      raise errors.ChecksumMismatchError(
          f'Checksum mismatch in array {read.name!r}, chunk at {list(chunk.start)} '
          f'(shape {list(chunk.shape)}) of {read.path}: recorded crc32c {record.crc32c:#010x}, '
          f'read {found:#010x}. The stored bytes are damaged. Restore an earlier step, or '
          'run `orbax-pathways verify` on this step to list every damaged chunk.'
      )
    checked += 1
  return checked


def open_error(name: str, path: str, e: BaseException) -> errors.RestoreError:
  """The error for an array tensorstore could not open: ``ArrayNotFoundError`` (also a
  ``FileNotFoundError``, as stock Orbax raises) when it is not there, else ``RestoreError``.
  Tensorstore reports a missing array only through its status text ('NOT_FOUND')."""
  if 'NOT_FOUND' in str(e):
    return errors.ArrayNotFoundError(
        f'Array {name!r} not found at {path}: {e}. The step is incomplete or damaged, or the '
        'target names an array this checkpoint does not have: check with `orbax-pathways show`.')
  return errors.RestoreError(
      f'Cannot open array {name!r} at {path}: {type(e).__name__}: {e}. Check that the step is '
      'complete (`orbax-pathways ls`) and the path is reachable.')


async def read_array(read: ArrayRead, *, context: ts.Context, verify: bool,
                     stats: ReadStats, chain: Any = None) -> dict[Box, np.ndarray]:
  """Host buffers for every needed box of one array (each region read once). With a source
  ``chain`` (``fleet/chain.py``), the chunks it holds and that match their recorded checksums
  come from it, the rest from storage. Every storage request runs under ``hedge.run``: past
  its deadline a second, identical request through a fresh context; the first answer wins."""
  if getattr(chain, 'tier_only', False):  # a local-only step: no array on storage to open
    return await _read_tier_only(read, chain, verify=verify, stats=stats)
  spec = ts.Spec(read.tspec)

  async def open_attempt(n: int) -> ts.TensorStore:  # later attempts: a fresh context
    return await ts.open(spec, open=True, context=hedge.fresh_context(context, n) if n else context)

  try:
    t = await hedge.run(open_attempt, nbytes=0, what=f'array {read.name!r} at {read.path}',
                        kind='read')
  except Exception as e:
    raise open_error(read.name, read.path, e) from e
  loop = asyncio.get_running_loop()
  hedges: dict[int, ts.TensorStore] = {0: t}

  async def handle(n: int) -> ts.TensorStore:
    if n not in hedges:  # one handle per attempt number, shared by this array's regions
      hedges[n] = await ts.open(spec, open=True, context=hedge.fresh_context(context, n))
    return hedges[n]

  async def read_region(box: Box, n: int) -> np.ndarray:
    src = await handle(n)
    # Each attempt decodes into its own buffer: a cancelled one never touches the winner's.
    data = aligned_empty(box.shape, t.dtype.numpy_dtype)
    # Decode straight into our buffer (tensorstore's own read() result is not 64-byte aligned).
    await ts.array(data, copy=False, write=True).write(src[box.to_slices()])
    return data

  async def one(region: restore_plan.Region) -> list[tuple[Box, np.ndarray]]:
    data: np.ndarray | None = None
    if chain is None:
      storage = [region.box]
    else:
      data = aligned_empty(region.box.shape, t.dtype.numpy_dtype)
      storage = await chain.fill(read, region.box, data)
    for box in storage:
      t0 = time.perf_counter()
      try:
        part = await hedge.run(
            functools.partial(read_region, box), nbytes=box.size * t.dtype.numpy_dtype.itemsize,
            kind='read', what=f'array {read.name!r} region {list(box.start)}..'
                              f'{list(box.stop)} of {read.path}')
      except Exception as e:
        raise errors.RestoreError(
            f'Reading array {read.name!r} region {list(box.start)}..'
            f'{list(box.stop)} from {read.path} failed: {type(e).__name__}: {e}. '
            'The step may be damaged or incomplete: run `orbax-pathways verify` on it.'
        ) from e
      stats.storage_s += time.perf_counter() - t0
      stats.storage_bytes += part.nbytes
      if box == region.box:
        data = part
      else:
        assert data is not None
        data[box.relative_to(region.box)] = part
      if verify:
        checked = await loop.run_in_executor(None, verify_region, read, box, part)
        stats.chunks_verified += checked  # Not `+= await`: that reads the counter before awaiting.
    assert data is not None
    stats.bytes_read += data.nbytes
    if read.target_dtype is not None and data.dtype != read.target_dtype:
      # After verification; converted as stock's cast read spec converts (storage/cast.py).
      data = cast_lib.convert(data, read.target_dtype, what=f'array {read.name!r}',
                              fix=cast_lib.RESTORE_FIX)
    out = []
    for box in region.device_boxes:
      out.append((box, data if box == region.box else data[box.relative_to(region.box)]))
    return out

  # Let every read finish before raising, so no tensorstore callback outlives the event loop.
  parts = await asyncio.gather(*(one(r) for r in read.plan.regions), return_exceptions=True)
  for part in parts:
    if isinstance(part, BaseException):
      raise part
  return {box: buf for part in parts if not isinstance(part, BaseException) for box, buf in part}
