"""The in-process transport: this process moves the bytes of the shards its own devices hold.

Used in single-process and multi-controller JAX (see ``transports/base.py`` for the call
order). On each process: ``snapshot`` plans and copies the pieces this process writes to host
memory inside ``save()``; ``write`` writes them (and this process's ``_pathways/p<i>`` record) in
Orbax's background commit thread; ``read`` reads what this process's devices need and puts it
on them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from typing import Any, Awaitable, Callable, Sequence

import jax
import numpy as np

from orbax_pathways import errors
from orbax_pathways import options as options_lib
from orbax_pathways.format import names as format_names
from orbax_pathways._util import said
from orbax_pathways.sharding import layout
from orbax_pathways._compat import jax_distributed
from orbax_pathways.transports import values
from orbax_pathways.plan import batches
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import save as save_plan
from orbax_pathways.plan import sources as plan_sources
from orbax_pathways.storage import writer as writer_lib
from orbax_pathways.transports import base
from orbax_pathways.fleet import chain as tier_chain
from orbax_pathways.fleet import step_files
from orbax_pathways.peer import exchange as tier_exchange
from orbax_pathways.fleet import partner_copy
from orbax_pathways.fleet import relay as tier_relay
from orbax_pathways.peer import wire as tier_wire
from orbax_pathways.transports import share
from orbax_pathways.transports import snapshots

NAME = options_lib.TransportName.IN_PROCESS.value
Box = boxes_lib.Box
# Arrays up to this size that this process holds entirely, on several devices, are read as one
# region and put with one call (``jax.device_put`` slices them per device itself).
WHOLE_PUT_BYTES = 1 << 20


def trace(name: str):
  return jax.profiler.TraceAnnotation(f'orbax_pathways.{name}')


def host_key(process_index: int) -> str:
  return f'p{process_index}'


def host_of(device) -> str:
  return host_key(device.process_index)


def this_host() -> str:
  return host_key(jax.process_index())


def pinned_available(arrays: Sequence[jax.Array]) -> bool:
  """Whether every device of ``arrays`` is an accelerator with a ``pinned_host`` memory."""
  devices: set[Any] = {d for a in arrays for d in a.sharding.device_set}  # jax.Device: untyped
  try:
    return bool(devices) and all(
        d.platform != 'cpu' and any(m.kind == 'pinned_host' for m in d.addressable_memories())
        for d in devices)
  except Exception:  # pylint: disable=broad-except  # a backend without memories API
    return False


def _device_data(arr: jax.Array) -> dict[Any, Any]:
  """Device -> what it holds of ``arr``: the host copy taken before a background save
  (``snapshots.take``), else the device shard itself."""
  taken = snapshots.device_data(arr)
  return taken if taken is not None else {s.device: s.data for s in arr.addressable_shards}


def _start_copy(data: Any) -> None:
  """Starts the device-to-host copy of a shard (nothing to do for a host copy)."""
  if not isinstance(data, np.ndarray):
    data.copy_to_host_async()


def use_pinned(arrays: Sequence[jax.Array], mode: str) -> bool:
  """``Options.snapshot`` resolved for these arrays ('auto': pinned where available); never
  for arrays already copied to host (``snapshots.take``)."""
  if any(snapshots.device_data(a) is not None for a in arrays):
    return False
  if mode == 'auto':
    return pinned_available(arrays)
  return mode == 'pinned'


def snapshot(arrays: Sequence[jax.Array], plans: Sequence[save_plan.ArrayWritePlan],
             host: str, *, pinned: bool = False) -> list[tuple[writer_lib.Piece, ...]]:
  """Device-to-host copy of every piece ``host`` writes, all copies in flight at once.

  Replica-split pieces are sliced on the device first, so only the piece crosses to the host;
  the shards of a coalesced small array are copied and then gathered into one host buffer.
  With ``pinned``, single-shard pieces are copied in one batched ``jax.device_put`` into pinned
  host memory (DMA speed; whether XLA's host allocator reuses the pinned pages across saves is
  what ``bench.py --mode gpu`` shows as first vs later save() blocking) and stay ``jax.Array``s
  there: the writer turns them into numpy in the background (``writer.host_pieces``), off the
  training thread.
  """
  pending = []
  for arr, plan in zip(arrays, plans):
    shards = {d.id: data for d, data in _device_data(arr).items()}
    mine = []
    for w in plan.for_host(host):
      parts = []
      for src in w.sources:
        data = shards[src.device_id]
        if len(w.sources) == 1 and w.box != src.shard_box:
          data, box = data[w.box.relative_to(src.shard_box)], w.box
        else:
          box = src.shard_box
        parts.append((box, data))
      mine.append((w, parts))
    pending.append(mine)
  if pinned:
    single = [parts[0][1] for mine in pending for _, parts in mine if len(parts) == 1]
    moved = iter(jax.block_until_ready(jax.device_put(single, [
        jax.sharding.SingleDeviceSharding(next(iter(d.devices())), memory_kind='pinned_host')
        for d in single])) if single else [])
    pending = [[(w, [(parts[0][0], next(moved))] if len(parts) == 1 else parts)
                for w, parts in mine] for mine in pending]
  for mine in pending:
    for _, parts in mine:
      if pinned and len(parts) == 1:
        continue
      for _, data in parts:
        _start_copy(data)
  out = []
  for mine in pending:
    pieces = []
    for w, parts in mine:
      if pinned and len(parts) == 1:
        pieces.append(writer_lib.Piece(w.box, parts[0][1]))
      else:
        pieces.append(writer_lib.Piece(
            w.box, writer_lib.gather(w.box, [(b, np.asarray(d)) for b, d in parts])))
    out.append(tuple(pieces))
  return out


def held_pieces(arrays: Sequence[jax.Array], plans: Sequence[save_plan.ArrayWritePlan],
                host: str) -> list[tuple[writer_lib.Piece, ...]]:
  """For ``Options.tier_scope='held'`` (inside ``save()``, every process): one piece per whole
  chunk that this host's devices hold together and another host writes (each chunk once),
  copied to the host, for the node-local tier only. The shards concerned are copied whole (all
  copies in flight at once); a chunk inside one shard is a view of its copy, one spanning
  several of this host's shards (a small array written whole) is assembled from them."""
  pending = []
  for arr, plan in zip(arrays, plans):
    wanted: list[tuple[Box, list[tuple[Box, Any]]]] = []
    if tuple(arr.shape) == tuple(plan.global_shape):
      taken = {c.start for c in share.host_chunks(plan, host)}
      data = _device_data(arr)
      by_box: dict[Box, Any] = {}
      for device, box in layout.device_boxes(arr.sharding, arr.shape,
                                             addressable_only=True).items():
        by_box.setdefault(box, data[device])  # boxes of one sharding are equal or disjoint
      for box in by_box:
        for cell in boxes_lib.chunk_grid(box, plan.chunk_shape):
          c = boxes_lib.clip(cell, plan.global_shape)
          if c.start in taken or c.size == 0:
            continue
          overlaps = [(b, d, b.intersect(c)) for b, d in by_box.items()]
          parts = [(b, d) for b, d, x in overlaps if x is not None and x.size]
          if sum(x.size for _, _, x in overlaps if x is not None) != c.size:
            continue  # partly on another host: its writer's copy is the only one
          taken.add(c.start)
          wanted.append((c, parts))
    pending.append(wanted)
  copies: dict[int, np.ndarray] = {}
  for wanted in pending:
    for _, parts in wanted:
      for _, d in parts:
        if id(d) not in copies:
          _start_copy(d)
          copies[id(d)] = d
  out = []
  for wanted in pending:
    pieces = []
    for c, parts in wanted:
      if len(parts) == 1:
        b, d = parts[0]
        pieces.append(writer_lib.Piece(c, np.asarray(d)[c.relative_to(b)]))
        continue
      buf = np.empty(c.shape, np.asarray(parts[0][1]).dtype)
      for b, d in parts:
        x = b.intersect(c)
        assert x is not None
        buf[x.relative_to(c)] = np.asarray(d)[x.relative_to(b)]
      pieces.append(writer_lib.Piece(c, buf))
    out.append(tuple(pieces))
  return out


def _whole_put(target: values.ReadTarget, boxes: dict[Any, Box]) -> bool:
  return (len(boxes) > 1 and target.sharding.is_fully_addressable
          and math.prod(target.shape) * np.dtype(target.dtype).itemsize <= WHOLE_PUT_BYTES)


def assemble(targets: Sequence[values.ReadTarget], boxes: Sequence[dict[Any, Box]],
             buffers: Sequence[dict[Box, np.ndarray]]) -> list[jax.Array]:
  """All arrays onto their devices with one batched ``jax.device_put``: small arrays whole,
  others shard by shard (aligned buffers, which the CPU backend aliases instead of copying)."""
  vals, dests, whole_of = [], [], []
  for t, bx, bufs in zip(targets, boxes, buffers):
    whole = bufs.get(Box.full(t.shape)) if _whole_put(t, bx) else None
    if whole is not None:
      vals.append(whole)
      dests.append(t.sharding)
    else:
      kind = t.sharding.memory_kind
      vals += [bufs[box] for box in bx.values()]
      dests += [jax.sharding.SingleDeviceSharding(d, memory_kind=kind) for d in bx]
    whole_of.append(whole is not None)
  placed = iter(jax.device_put(vals, dests) if vals else [])
  out = []
  for t, bx, put_whole in zip(targets, boxes, whole_of):
    if put_whole:
      out.append(next(placed))
      continue
    device_arrays = [next(placed) for _ in bx]
    # dtype= lets a process that holds none of the target's devices build its (empty) view.
    out.append(jax.make_array_from_single_device_arrays(t.shape, t.sharding, device_arrays,
                                                        dtype=t.dtype))
  return out


@functools.lru_cache(maxsize=256)
def _owners(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> plan_sources.Owners:
  """The distinct boxes of ``sharding`` with the processes holding each (every device: the
  same answer on every process; one entry for a replicated array, whatever the fleet)."""
  return plan_sources.owners(
      (box, d.process_index)
      for d, box in layout.device_boxes(sharding, shape, addressable_only=False).items())


def relay_targets(targets: Sequence[values.ReadTarget], context: Any
                  ) -> dict[str, tier_relay.Target]:
  """The restore's arrays as the relay reads them for a group of processes (``fleet/relay.py``):
  who needs which box is worked out only for arrays with a lost chunk, once per sharding."""
  return {t.name: tier_relay.Target(
      name=t.name, tspec=t.tspec, context=context, chunks=t.chunks,
      owners=functools.partial(_owners, t.sharding, tuple(t.shape)),
      shape=t.shape_on_storage,
      chunk_shape=tuple(t.chunk_shape) if t.chunk_shape is not None else None)
      for t in targets}


def peer_exchange(timeout_s: float) -> tier_exchange.Exchange | None:
  """The other processes of this multi-controller job, through jax's key-value store (None in
  a single process): a restore takes what this node's tier lacks from theirs. Reads the job's
  peer secret first (once per process: ``tier_exchange.job_secret``), which this process's server
  demands of every connection and its client proves; without it (the key-value store did not
  answer) the peer channel stays off for this restore, one warning per process, and storage
  serves what this node's tier lacks."""
  client = jax_distributed.distributed_client() if jax.process_count() > 1 else None
  if client is None:
    return None
  exchange = tier_exchange.Exchange(client, jax.process_index(), jax.process_count(), timeout_s)
  try:
    exchange.secret()
  except tier_wire.PeerError as e:
    said.once(logging.WARNING, ('tier-peer-secret', str(e)),
               'orbax_pathways: node-local tiers of other hosts not used: %s. Chunks this '
               "node's tier lacks are read from storage.", e)
    return None
  return exchange


def _partner_copier(cfg: base.SaveConfig) -> Callable[[str], None] | None:
  """What sends this process's entry of a local-only step to its partner
  (``Options.local_copies=2``: ``fleet/partner_copy.py``), or None (no partner, no tier). Makes
  this process's tier server take copies first: its own senders may already be on the way."""
  if cfg.partner is None or cfg.tier is None:
    return None
  client = jax_distributed.distributed_client()
  try:
    partner_copy.ready(cfg.tier, client, jax.process_index(), cfg.tier_peer_timeout_s)
  except (tier_wire.PeerError, OSError) as e:
    said.once(logging.WARNING, ('tier-partner', type(e).__name__),
               'orbax_pathways: this process\'s tier cannot take partner copies, nor send one '
               '(%s: %s); local-only steps keep one copy here.', type(e).__name__, e)
    return None
  partner, timeout_s = cfg.partner, cfg.tier_peer_timeout_s

  def copy(path: str) -> None:
    partner_copy.send_or_say(path, partner, client, timeout_s)

  return copy


class InProcessTransport(base.ConfiguredTransport):
  """This process writes and reads its own devices' shards (see the module docstring)."""

  name = NAME

  async def snapshot(self, arrays: Sequence[jax.Array], leaves: Sequence[values.SaveLeaf],
                     item: values.Item, ready: Callable[[], Awaitable[None]]) -> base.Snapshot:
    del ready  # nothing is written before write()
    cfg = self.save_config()
    host = this_host()
    with trace('plan'):
      plans = [share.plan(a.sharding, leaf, host_of, cfg.plan) for a, leaf in zip(arrays, leaves)]
    pinned = use_pinned(arrays, cfg.snapshot_mode)
    with trace('snapshot'):
      pieces = snapshot(arrays, plans, host, pinned=pinned)
      # A local-only step keeps what each host's devices hold ('held'): replicated state then
      # survives the loss of any host with no storage to fall back on.
      held = (held_pieces(arrays, plans, host)
              if cfg.every_held or (cfg.tier is not None and (
                  cfg.tier_scope == 'held' or format_names.is_local_only(item.directory)))
              else None)
      if held is not None and cfg.every_held:  # storage gets them too: this host's save is
        # complete for what it holds
        pieces, held = [tuple(p) + h for p, h in zip(pieces, held)], None
    d2h = sum(p.data.nbytes for ps in pieces for p in ps)
    d2h += sum(p.data.nbytes for ps in held or () for p in ps)
    return base.Snapshot(
        layouts=[values.LeafLayout.of(leaf, plan) for leaf, plan in zip(leaves, plans)],
        snapshot_mode='pinned' if pinned else 'host', d2h_bytes={host: d2h},
        # Process 0 of a multi-controller run moves only its own share; a single controller
        # (which is what Pathways with this transport would be) moves every byte.
        controller_tensor_bytes=d2h if jax.process_index() == 0 else 0,
        state=(item, tuple(leaves), plans, pieces, host, held))

  async def write(self, snap: base.Snapshot) -> list[values.WriterOutcome]:
    cfg = self.save_config()
    item, leaves, plans, pieces, host, held = snap.state
    if format_names.is_local_only(item.directory):
      with trace('write_tier'):
        outcome = await share.write_tier_only(
            host, format_names.IN_PROCESS_RECORD, item, leaves, plans, pieces,
            creates=[cfg.is_primary] * len(leaves),
            process_id=cfg.ocdbt_process_id, with_sharding=cfg.is_primary, tier=cfg.tier,
            save_id=share.new_save_id(), context=cfg.context,
            tier_pieces=None if held is None else [tuple(p) + h for p, h in zip(pieces, held)],
            copy=await asyncio.to_thread(_partner_copier, cfg))
      return [outcome]
    with trace('write'):
      outcome = await share.write_share(
          host, format_names.IN_PROCESS_RECORD, item, leaves, plans, pieces,
          creates=[cfg.is_primary] * len(leaves),
          process_id=cfg.ocdbt_process_id, with_sharding=cfg.is_primary,
          max_inflight_bytes=cfg.max_inflight_bytes, context=cfg.context, tier=cfg.tier,
          save_id=share.new_save_id(),
          tier_pieces=None if held is None else [tuple(p) + h for p, h in zip(pieces, held)])
    return [outcome]

  async def read(self, targets: Sequence[values.ReadTarget],
                 item: values.Item) -> tuple[list[jax.Array], list[values.ReadOutcome]]:
    cfg = self.read_config()
    host = this_host()
    needed, boxes = [], []
    for t in targets:
      bx = layout.device_boxes(t.sharding, t.shape, addressable_only=True)
      wanted = list(bx.values())
      if _whole_put(t, bx):
        wanted.append(Box.full(t.shape))  # read as one region; assemble() puts it in one call
      needed.append(wanted)
      boxes.append(bx)
    sizes = [sum(b.size for b in set(bx.values())) * np.dtype(t.dtype).itemsize
             for t, bx in zip(targets, boxes)]
    out: list[Any] = [None] * len(targets)
    bytes_read = chunks_verified = storage_bytes = 0
    storage_s = 0.0
    chain = None
    if cfg.tier is not None:
      peers = peer_exchange(cfg.tier_peer_timeout_s)
      chain = await asyncio.to_thread(
          tier_chain.for_restore, cfg.tier, item.directory, peers=peers,
          relay_targets=relay_targets(targets, share.context_for(item, cfg.context))
          if peers is not None else None)
    if chain is None and format_names.is_node_step(item.directory) and not item.use_ocdbt:
      # A node step on this node: its chunk files mapped into the arrays' buffers.
      chain = tier_chain.SourceChain([step_files.StepFiles()], item.directory)
    if chain is None and format_names.is_local_only(item.directory):
      raise errors.LocalStepIncompleteError(
          f'{item.directory} is a local-only step, whose array bytes are in the node-local '
          'tiers only, and the tier is off on this process (Options.tier_dir, '
          'ORBAX_PATHWAYS_TIER_DIR): it cannot be restored here.')
    # Orbax's restore byte limit (restore_concurrent_gb): at most that many bytes of host
    # buffers between storage and the devices at once (one array above it goes alone).
    try:
      for idx in batches.in_order(sizes, cfg.max_inflight_bytes):
        with trace('read'):
          buffers, rstats = await share.read_share(
              [targets[i] for i in idx], [needed[i] for i in idx], item=item, verify=cfg.verify,
              context=cfg.context, chain=chain)
        with trace('device_put'):
          for i, arr in zip(idx, assemble([targets[i] for i in idx], [boxes[i] for i in idx], buffers)):
            out[i] = arr
        bytes_read += rstats.bytes_read
        chunks_verified += rstats.chunks_verified
        storage_bytes += rstats.storage_bytes
        storage_s += rstats.storage_s
    finally:
      for src in chain.sources if chain is not None else ():
        close = getattr(src, 'close', None)  # the peer source: its connections to peers
        if close is not None:
          close()
    # A node step's directory is on this node (multitier/node_steps.py): what it read came from
    # the node, not from storage.
    where = 'node' if format_names.is_node_step(item.directory) else 'storage'
    by_source, seconds = {where: storage_bytes}, {where: storage_s}
    if chain is not None:
      chain.report()
      chunks_verified += chain.verified
      for source, n in chain.bytes.items():  # a relay chunk this process read counts as storage
        by_source[source] = by_source.get(source, 0) + n
      for source, s in chain.seconds.items():
        seconds[source] = seconds.get(source, 0.0) + s
    return out, [values.ReadOutcome(host, bytes_read, chunks_verified, sum(sizes),
                                    bytes_by_source=by_source, seconds_by_source=seconds)]
