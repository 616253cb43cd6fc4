"""One host's share of a save or a restore: runs on the host that holds the bytes.

Called by the in-process transport on each process (``write_share``: the pieces, then this writer's
``_pathways`` record), and inside the colocated-Python functions on each Pathways worker
(``write_pieces``: the pieces only; the checksums go back to the controller, which writes the
item's index). Host bytes in, storage out (or back): builds Orbax's tensorstore specs for this
host's pieces and writes them with checksums; on restore, reads and verifies the regions this
host's devices need.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Callable, Sequence

import numpy as np

from orbax_pathways import errors
from orbax_pathways.sharding import layout
from orbax_pathways.format import records as records_lib
from orbax_pathways.transports import values
from orbax_pathways._compat import orbax as compat
from orbax_pathways.plan import batches
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import save as save_plan
from orbax_pathways.storage import meta_io
from orbax_pathways.storage import reader as reader_lib
from orbax_pathways.storage import writer as writer_lib
from orbax_pathways.tier import gc as tier_gc
from orbax_pathways.tier import config as tier_config
from orbax_pathways.tier import store as tier_store

Box = boxes_lib.Box
log = logging.getLogger('orbax_pathways')


def new_save_id() -> str:
  """A fresh id for one writer's save of one item: its record and the index carry it, and so
  does the node-local tier copy of the same bytes (``tier/``)."""
  return uuid.uuid4().hex[:16]


def plan(sharding: Any, leaf: values.SaveLeaf, host_of: Any,
         settings: values.PlanSettings) -> save_plan.ArrayWritePlan:
  """The save plan of one leaf over ``sharding``'s devices (pure and cached: every host that
  calls it with the same arguments gets the same plan)."""
  return layout.plan_writes(
      sharding, tuple(leaf.shape), np.dtype(leaf.dtype).itemsize, host_of,
      max_chunk_bytes=leaf.max_chunk_bytes, replica_parallel=settings.replica_parallel,
      coalesce_bytes=settings.coalesce_bytes, min_split_bytes=settings.min_split_bytes,
      max_replicas=settings.max_replicas, split_axes=leaf.split_axes)


def context_for(item: values.Item, context: Any = None) -> Any:
  """Orbax's tensorstore context for the item, unless our options add resources (retries):
  then a context with Orbax's defaults plus those (the only kind a worker host can build)."""
  if context is not None and not item.context_extra:
    return context
  return compat.ts_context(item.use_ocdbt, dict(item.context_extra) or None)


def array_writes(item: values.Item, leaves: Sequence[values.SaveLeaf],
                 plans: Sequence[save_plan.ArrayWritePlan],
                 pieces: Sequence[Sequence[writer_lib.Piece]], *, creates: Sequence[bool],
                 process_id: int | str | None) -> list[writer_lib.ArrayWrite]:
  """Tensorstore writes of this host's pieces, with Orbax's exact specs and our chunk grid."""
  out = []
  for leaf, plan, ps, create in zip(leaves, plans, pieces, creates):
    layout = values.LeafLayout.of(leaf, plan)
    tspec = compat.build_write_spec(
        item, leaf.name, global_shape=leaf.shape, write_shape=layout.write_shape,
        chunk_shape=layout.chunk_shape, dtype=leaf.dtype, stored_dtype=leaf.stored_dtype,
        process_id=process_id, ext_metadata=leaf.ext_metadata, use_compression=leaf.compress)
    out.append(writer_lib.ArrayWrite(
        name=leaf.name, path=item.path_of(leaf.name), tspec=tspec, create=create,
        global_shape=leaf.shape, chunk_shape=layout.chunk_shape,
        stored_dtype=np.dtype(leaf.stored_dtype), pieces=tuple(ps)))
  return out


def writer_record(writer: str, transport: str, leaves: Sequence[values.SaveLeaf],
                  plans: Sequence[save_plan.ArrayWritePlan],
                  chunks: dict[str, list[records_lib.ChunkRecord]], *, with_sharding: bool,
                  outcome: values.WriterOutcome, save_id: str = '') -> records_lib.WriterRecord:
  """The ``_pathways/<writer>.msgpack`` content for what this writer wrote."""
  arrays = tuple(
      records_lib.ArrayRecord(
          name=leaf.name, dtype=np.dtype(leaf.stored_dtype).name, shape=leaf.shape,
          chunk_shape=plan.chunk_shape, chunks=tuple(chunks.get(leaf.name, ())),
          sharding=leaf.sharding if with_sharding else None)
      for leaf, plan in zip(leaves, plans))
  return records_lib.writer_record(writer, transport, arrays,
                                   written_bytes=outcome.bytes_written,
                                   chunks=outcome.chunks_written, save_id=save_id)


async def write_pieces(writer: str, item: values.Item, leaves: Sequence[values.SaveLeaf],
                       plans: Sequence[save_plan.ArrayWritePlan],
                       pieces: Sequence[Sequence[writer_lib.Piece]], *, creates: Sequence[bool],
                       process_id: int | str | None, max_inflight_bytes: int, context: Any = None,
                       on_progress: Callable[[], None] | None = None,
                       ) -> tuple[values.WriterOutcome, dict[str, list[records_lib.ChunkRecord]]]:
  """Writes this host's pieces; returns what it wrote and the checksum of every chunk.
  ``on_progress`` (a colocated call's progress, ``transports/colocated_calls.py``) is called
  after each memory-budget batch of arrays landed: the same batches ``writer.write_arrays``
  forms, written one after another as it writes them."""
  writes = array_writes(item, leaves, plans, pieces, creates=creates, process_id=process_id)
  ctx = context_for(item, context)
  if on_progress is None:
    chunks = await writer_lib.write_arrays(writes, context=ctx,
                                           max_inflight_bytes=max_inflight_bytes)
  else:
    chunks = {}
    for batch in batches.in_order([w.nbytes for w in writes], max_inflight_bytes):
      chunks.update(await writer_lib.write_arrays([writes[i] for i in batch], context=ctx,
                                                  max_inflight_bytes=max_inflight_bytes))
      on_progress()
  outcome = values.WriterOutcome(writer, sum(w.nbytes for w in writes),
                                 sum(len(c) for c in chunks.values()))
  return outcome, chunks


async def write_share(writer: str, transport: str, item: values.Item,
                      leaves: Sequence[values.SaveLeaf], plans: Sequence[save_plan.ArrayWritePlan],
                      pieces: Sequence[Sequence[writer_lib.Piece]], *, creates: Sequence[bool],
                      process_id: int | str | None, with_sharding: bool, max_inflight_bytes: int,
                      context: Any = None, tier: tier_config.TierConfig | None = None,
                      save_id: str = '',
                      # Options.tier_scope='held': the tier gets these (``pieces`` and whole
                      # chunks of replicas other hosts write) instead of ``pieces``.
                      tier_pieces: Sequence[Sequence[writer_lib.Piece]] | None = None,
                      ) -> values.WriterOutcome:
  """Writes this host's pieces and then its record (the record last: it lists what landed).
  The primary host merges every host's record into the item's index at commit
  (``storage/index.py``). With a ``tier``, then queues a copy of the same host buffers into this
  node's tier under ``save_id`` on the tier's background thread (``tier_store.submit``): the
  copy is not on the commit path and never fails the save. Copies still queued from the
  previous save are waited for first, so at most one save's buffers wait for the tier."""
  if tier is not None:
    await asyncio.to_thread(tier_store.flush)
  outcome, chunks = await write_pieces(writer, item, leaves, plans, pieces, creates=creates,
                                       process_id=process_id,
                                       max_inflight_bytes=max_inflight_bytes, context=context)
  record = writer_record(writer, transport, leaves, plans, chunks, with_sharding=with_sharding,
                         outcome=outcome, save_id=save_id)
  await asyncio.to_thread(meta_io.write_record, item.directory, record)
  if tier is not None and save_id:
    tier_store.submit(write_tier, tier, item, writer, save_id, leaves, plans,
                      pieces if tier_pieces is None else tier_pieces, chunks)
  return outcome


async def write_tier_only(writer: str, transport: str, item: values.Item,
                          leaves: Sequence[values.SaveLeaf],
                          plans: Sequence[save_plan.ArrayWritePlan],
                          pieces: Sequence[Sequence[writer_lib.Piece]], *,
                          creates: Sequence[bool], process_id: int | str | None,
                          with_sharding: bool, tier: tier_config.TierConfig | None, save_id: str,
                          context: Any = None,
                          tier_pieces: Sequence[Sequence[writer_lib.Piece]] | None = None,
                          copy: Callable[[str], None] | None = None,
                          ) -> values.WriterOutcome:
  """This host's share of a local-only step under the in-process transport: ``tier_only_pieces``,
  then the writer's record to storage, as for any save (the restore checks the tier's bytes
  against it), at the same time as the tier entry and the markers. ``copy``: called with the
  entry's directory once it landed (a partner copy: ``fleet/partner_copy.py``)."""

  def record(outcome: values.WriterOutcome,
             chunks: dict[str, list[records_lib.ChunkRecord]]) -> None:
    meta_io.write_record(item.directory, writer_record(
        writer, transport, leaves, plans, chunks, with_sharding=with_sharding,
        outcome=outcome, save_id=save_id))

  outcome, _ = await tier_only_pieces(
      writer, item, leaves, plans, pieces, creates=creates, process_id=process_id, tier=tier,
      save_id=save_id, context=context, tier_pieces=tier_pieces, copy=copy, record=record)
  return outcome


async def tier_only_pieces(writer: str, item: values.Item, leaves: Sequence[values.SaveLeaf],
                           plans: Sequence[save_plan.ArrayWritePlan],
                           pieces: Sequence[Sequence[writer_lib.Piece]], *,
                           creates: Sequence[bool], process_id: int | str | None,
                           tier: tier_config.TierConfig | None, save_id: str, context: Any = None,
                           tier_pieces: Sequence[Sequence[writer_lib.Piece]] | None = None,
                           copy: Callable[[str], None] | None = None,
                           record: Callable[[values.WriterOutcome,
                                             dict[str, list[records_lib.ChunkRecord]]],
                                            None] | None = None,
                           ) -> tuple[values.WriterOutcome, dict[str, list[records_lib.ChunkRecord]]]:
  """This host's share of a local-only step (``docs/multi_tier.md``), on the host that holds the
  bytes (a multi-controller process, a Pathways worker): the chunks' checksums from the host
  buffers, the bytes into this node's tier, **not** to storage; returns what it wrote and the
  checksums, as ``write_pieces`` does. The tier copy is written here, in the save's background
  part, so the step commits only once it landed; one that cannot be written fails this save
  (``SaveError`` naming the directory), so the step is never committed. Nothing is queued:
  ``tier_store.flush`` first. The host that creates an array's metadata (``creates``) still
  writes it, and one empty chunk marker: Orbax's metadata reads (a restore without a target)
  open the array, its OCDBT validation wants a chunk key per array, and a stock reader of the
  step fails on the marker instead of reading zeros.

  Three things run at once, each on its own, once the checksums are known: the metadata and
  markers (storage round trips: on gs:// one commit of a fresh OCDBT database, three one after
  another), this node's tier entry then its partner copy (``copy``: local disk, then the peer
  channel), and ``record(outcome, chunks)`` (the writer's record to storage, where the caller
  writes one). All settle before the first failure is raised; the save's commit waits for all
  of them, so none is needed before another."""
  if tier is None or not save_id:
    raise errors.SaveError(
        f'{item.directory} is a local-only step (Options.local_save_interval_steps), whose '
        'array bytes go to the node-local tier only, and the tier is off on this host. Set '
        'Options.tier_dir (ORBAX_PATHWAYS_TIER_DIR) to a node-local directory, or '
        'local_save_interval_steps=0.')
  await asyncio.to_thread(tier_store.flush)
  writes = array_writes(item, leaves, plans, pieces, creates=creates, process_id=process_id)
  chunks = {w.name: writer_lib.chunk_records(w) for w in writes}
  outcome = values.WriterOutcome(writer, sum(w.nbytes for w in writes),
                                 sum(len(c) for c in chunks.values()))
  crcs = {name: {c.origin: c.crc32c for c in cs} for name, cs in chunks.items()}

  async def to_tier() -> None:
    path = await asyncio.to_thread(
        tier_store.write_entry, tier, item.directory, writer, save_id, leaves, plans,
        pieces if tier_pieces is None else tier_pieces, crcs)
    if path is None:
      raise errors.SaveError(
          f'the local-only step {item.directory}: host {writer} could not write its share '
          f'({outcome.bytes_written} bytes) into the node-local tier {tier.tier_dir} (the '
          'warning above says why). The step is not committed; the previous local-only or '
          'storage step stays the newest to resume from.')
    if copy is not None:
      await asyncio.to_thread(copy, path)

  parts = [writer_lib.write_metadata_and_markers([w for w in writes if w.create],
                                                 context=context_for(item, context)),
           to_tier()]
  if record is not None:
    parts.append(asyncio.to_thread(record, outcome, chunks))
  done = await asyncio.gather(*parts, return_exceptions=True)  # all settle before we raise
  for d in done:
    if isinstance(d, BaseException):
      raise d
  return outcome, chunks


def write_tier(tier: tier_config.TierConfig, item: values.Item, writer: str, save_id: str,
               leaves: Sequence[values.SaveLeaf], plans: Sequence[save_plan.ArrayWritePlan],
               pieces: Sequence[Sequence[writer_lib.Piece]],
               chunks: dict[str, list[records_lib.ChunkRecord]]) -> None:
  """This host's share into its node-local tier (background, after the storage write), then
  the node-level clean-up of other checkpoint directories' entries (``tier/gc.after_write``,
  once per save); a failure is logged, never raised: the tier must not cost a save."""
  try:
    crcs = {name: {c.origin: c.crc32c for c in cs} for name, cs in chunks.items()}
    path = tier_store.write_entry(tier, item.directory, writer, save_id, leaves, plans, pieces,
                                  crcs)
    if path is not None:  # once per save: other checkpoint directories' stale entries go
      tier_gc.after_write(tier, path)
  except Exception as e:  # pylint: disable=broad-except
    log.warning('orbax_pathways: node-local tier copy of %s skipped: %s: %s', item.directory,
                type(e).__name__, e)


def write_chunks(plan: save_plan.ArrayWritePlan, write: save_plan.ShardWrite) -> list[Box]:
  """The chunks of one write, in the order the writer checksums them (its chunk grid in order,
  clipped to the array: ``writer.chunk_records``)."""
  out = []
  for c in boxes_lib.chunk_grid(write.box, plan.chunk_shape):
    region = boxes_lib.clip(c, plan.global_shape).intersect(write.box)
    if region is not None and region.size:
      out.append(region)
  return out


def host_chunks(plan: save_plan.ArrayWritePlan, host: str) -> list[Box]:
  """The chunks ``host`` writes of one array, in checksum order (its writes in plan order)."""
  return [b for w in plan.for_host(host) for b in write_chunks(plan, w)]


def _on_storage(target: values.ReadTarget, box: Box) -> Box | None:
  """The part of target box ``box`` that exists on storage (all of it unless padding)."""
  stored = target.shape_on_storage
  if stored == tuple(target.shape):
    return box
  part = box.intersect(Box.full(stored))
  return part if part is not None and part.size else None


def array_read(target: values.ReadTarget, boxes: Sequence[Box]) -> reader_lib.ArrayRead:
  """What to read for the target boxes ``boxes``: their parts that exist on storage, in
  chunk-aligned regions of the stored array (so every chunk read is verified whole)."""
  needed = [b for b in (_on_storage(target, box) for box in boxes) if b is not None]
  return reader_lib.ArrayRead(
      name=target.name, path=target.path, tspec=dict(target.tspec),
      plan=values.read_plan(target, needed), chunk_shape=target.chunk_shape,
      chunks=target.chunks, target_dtype=np.dtype(target.dtype),
      require_checksums=target.require_checksums, stored_dtype=target.stored_dtype)


def place(target: values.ReadTarget, boxes: Sequence[Box],
          buffers: dict[Box, np.ndarray]) -> dict[Box, np.ndarray]:
  """Host buffers for the target boxes: the read ones as they are, or, when the target pads or
  truncates (``strict=False``), zeros with the stored part copied in."""
  if target.shape_on_storage == tuple(target.shape):
    return buffers
  out = {}
  for box in boxes:
    buf = np.zeros(box.shape, np.dtype(target.dtype))
    part = _on_storage(target, box)
    if part is not None:
      buf[part.relative_to(box)] = buffers[part]
    out[box] = buf
  return out


async def read_share(targets: Sequence[values.ReadTarget], boxes: Sequence[Sequence[Box]], *,
                     item: values.Item, verify: bool, context: Any = None,
                     chain: Any = None, on_progress: Callable[[], None] | None = None,
                     ) -> tuple[list[dict[Box, np.ndarray]], reader_lib.ReadStats]:
  """Reads and verifies what this host needs: for each target, host buffers of the target boxes
  in ``boxes`` (each needed chunk read once: from the source ``chain`` (``fleet/chain.py``) where
  it holds the chunk, else from storage). ``on_progress`` (a colocated call's progress,
  ``transports/colocated_calls.py``) is called as each target's reads complete."""
  stats = reader_lib.ReadStats()
  ctx = context_for(item, context)
  reads = [array_read(t, bx) for t, bx in zip(targets, boxes)]

  async def one(r: reader_lib.ArrayRead) -> dict[Box, np.ndarray]:
    out = await reader_lib.read_array(r, context=ctx, verify=verify, stats=stats, chain=chain)
    if on_progress is not None:
      on_progress()
    return out

  # All settle before we raise: no callback outlives the loop.
  buffers = await asyncio.gather(*(one(r) for r in reads), return_exceptions=True)
  for b in buffers:
    if isinstance(b, BaseException):
      raise b
  done = [b for b in buffers if not isinstance(b, BaseException)]  # all of them, by now
  return [place(t, bx, bufs) for t, bx, bufs in zip(targets, boxes, done)], stats
