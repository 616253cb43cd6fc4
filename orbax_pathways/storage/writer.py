"""Writes one host's pieces of arrays with tensorstore and checksums their chunks.

Runs on the host that owns the bytes: the controller process itself in multi-controller JAX
(in-process transport), or inside a colocated-Python function on a Pathways worker (colocated
transport). It sees only numpy buffers, boxes and tensorstore specs: no devices, no jax.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import re
from typing import Sequence

import numpy as np
import tensorstore as ts

from orbax_pathways.format import checksum
from orbax_pathways import errors
from orbax_pathways.format import names as format_lib
from orbax_pathways.format import records as records_lib
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.storage import cast as cast_lib
from orbax_pathways.storage import hedge

Box = boxes_lib.Box

# Arrays up to this many bytes are checksummed in the event loop's thread.
INLINE_CHECKSUM_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class Piece:
  """Host bytes for ``box`` of the array (already on this host).

  ``data`` is a numpy array, or a host-resident ``jax.Array`` (a pinned-host snapshot) that
  ``host_pieces`` turns into numpy right before it is written.
  """

  box: Box
  data: np.ndarray


def gather(box: Box, parts: Sequence[tuple[Box, np.ndarray]]) -> np.ndarray:
  """The host buffer for ``box`` from host copies of the shards it is cut from.

  ``parts`` is one shard containing ``box`` (returned as a view), or whole shards tiling ``box``
  (a coalesced small array: copied into one buffer).
  """
  if len(parts) == 1:
    shard_box, data = parts[0]
    return data if shard_box == box else data[box.relative_to(shard_box)]
  out = np.empty(box.shape, parts[0][1].dtype)
  for shard_box, data in parts:
    out[shard_box.relative_to(box)] = data
  return out


@dataclasses.dataclass(frozen=True)
class ArrayWrite:
  """Everything a host needs to write its share of one array."""

  name: str
  path: str  # for error messages: the array's location on storage
  tspec: dict
  create: bool  # True on the one host that writes the zarr metadata
  global_shape: tuple[int, ...]
  chunk_shape: tuple[int, ...]
  stored_dtype: np.dtype
  pieces: tuple[Piece, ...]

  @property
  def nbytes(self) -> int:
    return sum(p.data.nbytes for p in self.pieces)


def chunk_records(write: ArrayWrite) -> list[records_lib.ChunkRecord]:
  """crc32c of every chunk of every piece, in the stored dtype (a cast converted as
  tensorstore's ``cast`` driver converts it on its way to storage: ``storage/cast.py``)."""
  out = []
  for piece in write.pieces:
    data = cast_lib.convert(piece.data, write.stored_dtype, what=f'array {write.name!r}')
    for chunk in boxes_lib.chunk_grid(piece.box, write.chunk_shape):
      chunk = boxes_lib.clip(chunk, write.global_shape)
      region = chunk.intersect(piece.box)
      if region is None or region.size == 0:
        continue
      sub = data[region.relative_to(piece.box)]
      out.append(records_lib.ChunkRecord(region.start, checksum.of_array(sub), sub.nbytes))
  return out


_PROCESS_DB = re.compile(r'(ocdbt\.process_[A-Za-z0-9]+)(/?)$')


def retry_spec(tspec: dict, attempt: int) -> dict:
  """The spec a later ``attempt`` of a write uses: on OCDBT, a database of its own next to
  this process's (``ocdbt.process_<id>`` -> ``ocdbt.process_<id>retry<n>``), which Orbax's
  finalize merges with every other ``ocdbt.process_*`` (a process's pieces then lie in two
  databases, each written by one driver: two drivers committing into one database would race
  for its manifest). Without OCDBT the same objects are written again (idempotent). Documented
  in docs/format.md."""
  out = copy.deepcopy(tspec)
  inner = out['base'] if out.get('driver') == 'cast' else out
  kv = inner.get('kvstore')
  if not isinstance(kv, dict) or kv.get('driver') != 'ocdbt':
    return out
  # The database's data files ('base') and its manifest ('manifest', where Orbax names it
  # separately) both move: a retry database is complete on its own, and the original's manifest
  # keeps one writer.
  for key in ('base', 'manifest'):
    where = kv.get(key)
    if isinstance(where, dict) and isinstance(where.get('path'), str):
      where['path'] = _PROCESS_DB.sub(rf'\1retry{attempt}\2', where['path'])
    elif isinstance(where, str):
      kv[key] = _PROCESS_DB.sub(rf'\1retry{attempt}\2', where)
  return out


async def write_array(write: ArrayWrite, *, context: ts.Context,
                      metadata: dict[str, bytes] | None = None) -> list[records_lib.ChunkRecord]:
  """Creates the array's metadata (if ``write.create``), writes every piece, returns checksums.

  Pieces are handed to tensorstore without a copy (``can_reference_source_data_indefinitely``):
  the caller keeps the snapshot alive and unchanged until the returned coroutine finishes.

  On OCDBT the creating host writes the metadata as values (``metadata``: the files creating
  the array writes, from ``metadata_files``; rendered here when not given), with a zero-size
  array's chunk marker (``_marker``), at the same time as the pieces, and opens the array
  without a storage request (``assume_metadata``): the database commits them together, where
  creating the array first is a commit of its own before any piece can be written (on gs:// a
  fresh database's first commit, four round trips one after another). Without OCDBT the
  creating host creates the array (no marker needed).
  """
  handles: dict[int, ts.TensorStore] = {}
  if metadata is None and _metadata_as_values(write):
    metadata = (await metadata_files([write.tspec]))[0]
  creates = write.create and metadata is None  # without OCDBT

  async def handle(n: int) -> ts.TensorStore:
    """The handle of attempt ``n`` (0: the caller's context; later: one fresh context per
    attempt number, shared by this array's pieces, and ``retry_spec``). Opening is idempotent
    (``open=True``)."""
    if n not in handles:
      ctx = hedge.fresh_context(context, n) if n else context
      spec = ts.Spec(retry_spec(write.tspec, n) if n else write.tspec)
      if creates:  # The handle that created the metadata writes too: one open, not two.
        handles[n] = await ts.open(spec, create=True, open=True, context=ctx)
      else:
        handles[n] = await ts.open(spec, open=True, assume_metadata=True, context=ctx)
    return handles[n]

  async def write_metadata(n: int) -> None:
    """Attempt ``n`` of writing ``metadata`` (and a zero-size array's marker) into the database
    of that attempt (``retry_spec``), through the same context as its pieces."""
    ctx = hedge.fresh_context(context, n) if n else context
    spec = retry_spec(write.tspec, n) if n else write.tspec
    assert metadata is not None  # OCDBT: _metadata_as_values
    kv, files = _database_values(write, spec, metadata, marker=0 in write.global_shape)
    store = await ts.KvStore.open(kv, context=ctx)
    await asyncio.gather(*(store.write(k, v) for k, v in files.items()))

  async def write_piece(p: Piece, n: int) -> None:
    dst = await handle(n)
    await dst[p.box.to_slices()].write(p.data, can_reference_source_data_indefinitely=True)

  first = 0  # the attempt whose open answered: the pieces start from its handle

  def piece(p: Piece):
    # Past its deadline a piece is written again through a fresh context: object writes are
    # idempotent (same keys, same bytes), the first that completes wins (storage/hedge.py).
    return hedge.run(lambda n: write_piece(p, first + n), nbytes=p.data.nbytes, kind='write',
                     what=f'array {write.name!r} piece {list(p.box.start)}..{list(p.box.stop)} '
                          f'to {write.path}')

  try:
    t = await hedge.run(handle, nbytes=0, what=f'array {write.name!r} at {write.path}',
                        kind='write')
    first = next(n for n, h in handles.items() if h is t)
    if write.nbytes <= INLINE_CHECKSUM_BYTES:  # A thread hop costs more than hashing a few KiB.
      crc_task = asyncio.get_running_loop().create_future()
      crc_task.set_result(chunk_records(write))
    else:
      crc_task = asyncio.get_running_loop().run_in_executor(None, chunk_records, write)
    del t
    parts = [piece(p) for p in write.pieces if p.data.size]
    if write.create and metadata is not None:
      parts.append(hedge.run(lambda n: write_metadata(first + n), nbytes=0, kind='write',
                             what=f'metadata of array {write.name!r} at {write.path}'))
    results = await asyncio.gather(*parts, return_exceptions=True)  # all settle before we raise
    records = await crc_task
    for r in results:
      if isinstance(r, BaseException):
        raise r
    return records
  except Exception as e:
    raise errors.keeping_type(
        errors.SaveError, e,
        f'Writing array {write.name!r} to {write.path} failed: {type(e).__name__}: {e}. '
        'Earlier checkpoints are untouched; this step will not be committed. Check the storage '
        'path, credentials and free space, then save again.'
    ) from e


def _metadata_as_values(write: ArrayWrite) -> bool:
  """Whether ``write_array`` writes ``write``'s metadata as values beside its pieces (the
  creating host of an array on OCDBT) instead of creating the array first."""
  return write.create and _marker(write) is not None


def _marker(write: ArrayWrite) -> tuple[dict, str] | None:
  """The kvstore spec and key of ``write``'s empty chunk marker; None without OCDBT (no marker
  needed). A zero-size array has no chunks, but Orbax's post-merge OCDBT validation requires
  every param to own at least one chunk key: one empty value under the first chunk key, which
  no reader fetches (the array's domain is empty). An array of a local-only step, whose bytes
  are in the node-local tiers only, gets the same marker (``write_metadata_and_markers``): a
  reader of storage fails on it loudly instead of reading zeros. Documented in docs/format.md."""
  spec = write.tspec['base'] if write.tspec.get('driver') == 'cast' else write.tspec
  kv = dict(spec['kvstore'])
  if kv.get('driver') != 'ocdbt':
    return None
  rank = len(write.global_shape)
  key = format_lib.chunk_key((0,) * rank, (1,) * rank, zarr3=spec['driver'] == 'zarr3')
  # The array's keys sit below its path inside the database; a bare array saved as the whole
  # tree has the empty name, and its keys sit at the database's root ('.zarray', not '/.zarray').
  prefix = kv.get('path', '').rstrip('/')
  kv['path'] = prefix + '/' if prefix else ''
  return kv, key


def _database_values(write: ArrayWrite, spec: dict, metadata: dict[str, bytes], *,
                     marker: bool) -> tuple[dict, dict[str, bytes]]:
  """Where and what the creating host writes as plain values for ``write`` on OCDBT, under the
  attempt's ``spec`` (``retry_spec``): the kvstore spec of the database, and the array's
  ``metadata`` files (``metadata_files``) plus, when ``marker``, its empty chunk marker
  (``_marker``). Shared by ``write_array`` and ``write_metadata_and_markers``."""
  where = _marker(dataclasses.replace(write, tspec=spec))
  assert where is not None, f'array {write.name!r} at {write.path} is not on OCDBT'
  files = dict(metadata)
  if marker:
    files[where[1]] = b''
  return where[0], files


async def metadata_files(tspecs: Sequence[dict]) -> list[dict[str, bytes]]:
  """Per spec, the files tensorstore writes when it creates that array (zarr's ``.zarray``, or
  zarr3's ``zarr.json``), keyed relative to the array's directory: made by creating the arrays
  on an in-memory kvstore of a context of their own (no storage request), byte for byte what
  creating them on storage writes. A ``cast`` spec's array is its base's."""
  if not tspecs:
    return []
  ctx = ts.Context()  # its own in-memory kvstore
  mem = []
  for i, spec in enumerate(tspecs):
    spec = copy.deepcopy(spec)
    inner = spec['base'] if spec.get('driver') == 'cast' else spec
    inner['kvstore'] = {'driver': 'memory', 'path': f'{i}/'}
    mem.append(spec)
  await asyncio.gather(*(ts.open(ts.Spec(s), create=True, context=ctx) for s in mem))
  store = await ts.KvStore.open({'driver': 'memory'}, context=ctx)
  out: list[dict[str, bytes]] = [{} for _ in tspecs]
  keys = [k.decode() for k in await store.list()]
  values = await asyncio.gather(*(store.read(k) for k in keys))
  for key, value in zip(keys, values):
    index, _, rel = key.partition('/')
    out[int(index)][rel] = bytes(value.value)
  return out


async def write_metadata_and_markers(writes: Sequence[ArrayWrite], *,
                                     context: ts.Context) -> None:
  """The zarr metadata and the empty chunk marker of every array in ``writes`` (arrays whose
  bytes go elsewhere: a local-only step's, ``transports/share.tier_only_pieces``), all in one
  tensorstore transaction: on OCDBT one commit of the database for all of them, a few round
  trips whatever the number of arrays, where an open and a marker per array were a commit each.
  The metadata goes in as the files tensorstore itself makes for the arrays
  (``metadata_files``), written as plain values beside the markers: creating the arrays inside
  the transaction instead costs a second commit of the fresh database (on gs://, seven round
  trips one after another where this takes three). Called on the host that creates the
  arrays' metadata. Hedged as a whole (``storage/hedge``): a later attempt writes everything
  again through a fresh context into its own database (``retry_spec``), which Orbax's finalize
  merges like any other. Without OCDBT (no database to commit) each array is created as
  tensorstore does, in the transaction, with no marker."""
  if not writes:
    return
  names = ', '.join(repr(w.name) for w in writes[:3]) + (', ...' if len(writes) > 3 else '')
  # Rendered for the arrays on OCDBT only: without a database each is created as usual.
  ocdbt = [i for i, w in enumerate(writes) if _marker(w) is not None]
  rendered = await metadata_files([writes[i].tspec for i in ocdbt])
  files: list[dict[str, bytes]] = [{} for _ in writes]
  for i, made in zip(ocdbt, rendered):
    files[i] = made

  async def attempt(n: int) -> None:
    ctx = hedge.fresh_context(context, n) if n else context
    txn = ts.Transaction()
    specs = [retry_spec(w.tspec, n) if n else w.tspec for w in writes]

    async def one(w: ArrayWrite, spec: dict, made: dict[str, bytes]) -> None:
      # Every array at once: opening a kvstore can read the database, a round trip each that
      # must not add up one after another.
      if _marker(w) is None:
        await ts.open(ts.Spec(spec), create=True, open=True, context=ctx, transaction=txn)
        return
      kv, values = _database_values(w, spec, made, marker=True)
      store = (await ts.KvStore.open(kv, context=ctx)).with_transaction(txn)
      for key, value in values.items():
        await store.write(key, value)

    results = await asyncio.gather(*(one(w, spec, made)
                                     for w, spec, made in zip(writes, specs, files)),
                                   return_exceptions=True)  # all settle before we raise
    for r in results:
      if isinstance(r, BaseException):
        raise r
    await txn.commit_async()

  try:
    await hedge.run(attempt, nbytes=0, kind='write',
                    what=f'metadata of {len(writes)} array(s) ({names}) at {writes[0].path}')
  except Exception as e:
    raise errors.keeping_type(
        errors.SaveError, e,
        f'Writing the metadata of {len(writes)} array(s) ({names}) to {writes[0].path} failed: '
        f'{type(e).__name__}: {e}. Earlier checkpoints are untouched; this step will not be '
        'committed. Check the storage path, credentials and free space, then save again.'
    ) from e


def host_pieces(write: ArrayWrite) -> ArrayWrite:
  """``write`` with every piece as numpy (copies a pinned-host snapshot; numpy stays as is).

  Runs in the background write, one memory-budget batch at a time, so at most
  ``max_inflight_bytes`` of these copies exist on top of the snapshot.
  """
  pieces = tuple(p if isinstance(p.data, np.ndarray) else Piece(p.box, np.asarray(p.data))
                 for p in write.pieces)
  return dataclasses.replace(write, pieces=pieces)


async def write_arrays(writes: Sequence[ArrayWrite], *, context: ts.Context,
                       max_inflight_bytes: int) -> dict[str, list[records_lib.ChunkRecord]]:
  """Writes arrays with at most ``max_inflight_bytes`` of pieces handed to tensorstore at once
  (one array larger than the budget goes alone). Returns checksums per array name."""
  results: dict[str, list[records_lib.ChunkRecord]] = {}
  batch: list[ArrayWrite] = []
  batch_bytes = 0

  async def flush():
    nonlocal batch, batch_bytes
    if any(not isinstance(p.data, np.ndarray) for w in batch for p in w.pieces):
      batch = await asyncio.to_thread(lambda: [host_pieces(w) for w in batch])  # noqa: B023
    made = iter(await metadata_files([w.tspec for w in batch if _metadata_as_values(w)]))
    done = await asyncio.gather(*(
        write_array(w, context=context,
                    metadata=next(made) if _metadata_as_values(w) else None) for w in batch))
    for w, records in zip(batch, done):
      results[w.name] = records
    batch, batch_bytes = [], 0

  for w in writes:
    if batch and batch_bytes + w.nbytes > max_inflight_bytes:
      await flush()
    batch.append(w)
    batch_bytes += w.nbytes
  if batch:
    await flush()
  return results
