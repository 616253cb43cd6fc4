"""The engine: the one save path and the one restore path behind every Orbax front door.

Front doors (``frontends/orbax_v0.py`` for Orbax's TypeHandler registry, ``frontends/orbax_v1.py``
for the v1 API) convert Orbax's objects into ``orbax_pathways.transports.values`` and call, on the
controller (the only process under Pathways, every process under multi-controller JAX):

Save:
1. ``pending = await engine.save(arrays, leaves, item, config=..., ready=...)`` inside Orbax's
   ``serialize``: picks the transport (once per call), plans and takes the snapshot (the only
   part ``save()`` blocks on), publishes the save's ``SaveStats``.
2. ``await pending.write()`` in Orbax's background commit thread: waits for the item directory,
   lets the transport write every host's share, records the outcome, logs one line.

Restore:
1. ``await engine.restore(leaves, item, config=..., records=...)``: resolves each leaf against
   storage (our records, or the zarr metadata of a stock checkpoint), checks shapes, and lets the
   transport read, verify and place the bytes; records ``RestoreStats`` and logs one line.

The engine owns transport choice and fallback, the stats and the log lines; it knows nothing of
Orbax's ``ParamInfo``/``SaveArgs``/``RestoreArgs`` and never imports a front door.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
import warnings
from typing import Any, Awaitable, Callable, Sequence

import jax
import numpy as np
import tensorstore as ts

from orbax_pathways._util import said
from orbax_pathways.format import checksum
from orbax_pathways import errors
from orbax_pathways.format import names as format_lib
from orbax_pathways.sharding import layout
from orbax_pathways.format import grid as grid_lib
from orbax_pathways.format import records as records_lib
from orbax_pathways import options as options_lib
from orbax_pathways.engine import runtime
from orbax_pathways import stats as stats_lib
from orbax_pathways.transports import values
from orbax_pathways._compat import orbax as compat
from orbax_pathways._compat import storage_clients
from orbax_pathways.storage import cast as cast_lib
from orbax_pathways.storage import meta_io
from orbax_pathways.storage import deadline as deadline_lib
from orbax_pathways.storage import hedge
from orbax_pathways.storage import reader as reader_lib
from orbax_pathways.storage import writer as writer_lib
from orbax_pathways.tier import assigned as tier_assigned
from orbax_pathways.tier import manifest as tier_layout
from orbax_pathways.fleet import partners as tier_partners
from orbax_pathways.tier import config as tier_config
from orbax_pathways.transports import base as transports
from orbax_pathways.transports import registry

log = logging.getLogger('orbax_pathways')


def _trace(name: str):
  return jax.profiler.TraceAnnotation(f'orbax_pathways.{name}')


def _step_dir(item_directory: str) -> str:
  """The final path of the step directory holding ``item_directory`` (Orbax's temporary
  suffix removed), for stats and log lines."""
  step_dir = item_directory.rstrip('/').rsplit('/', 1)[0]
  head, _, name = step_dir.rpartition('/')
  name = format_lib.final_name(name)
  return f'{head}/{name}' if head else name


@functools.lru_cache(maxsize=1024)
def sharding_record(sharding: jax.sharding.Sharding,
                    num_slices: int | None) -> records_lib.ShardingRecord:
  """What the primary writer records of an array's sharding (cached: O(devices) to build, and a
  training loop saves the same shardings every time)."""
  return layout.sharding_record(sharding, num_slices=num_slices)


@dataclasses.dataclass(frozen=True)
class RestoreLeaf:
  """One array to restore, as the front door resolved it: the global shape and dtype to return
  (None: as saved), the target sharding (with its memory kind; None: to this host's memory,
  ``read_to_host``), whether shapes must match
  (``strict``), and a ``jax.experimental.layout.Format`` when the target asks for a device layout
  of its own."""

  name: str
  shape: tuple[int, ...] | None
  dtype: Any
  sharding: jax.sharding.Sharding | None
  strict: bool = True
  format: Any = None

  @classmethod
  def of(cls, name: str, shape, dtype, sharding_or_format, *, strict: bool = True) -> 'RestoreLeaf':
    """Accepts a ``Sharding`` or a ``Format`` (whose sharding is then the target's)."""
    fmt = sharding_or_format if _is_format(sharding_or_format) else None
    sharding = fmt.sharding if fmt is not None else sharding_or_format
    return cls(name, tuple(shape) if shape is not None else None, dtype, sharding, strict, fmt)


def _is_format(x: Any) -> bool:
  return not isinstance(x, jax.sharding.Sharding) and hasattr(x, 'layout') and hasattr(x, 'sharding')


def check_global(arrays: Sequence[jax.Array], names: Sequence[str]) -> None:
  """In a multi-process run every saved array must be global (a shard on every process)."""
  if jax.process_count() <= 1:
    return
  for a, name in zip(arrays, names):
    if a.is_fully_addressable:
      raise errors.SaveError(
          f'Array {name!r} (shape {a.shape}, sharding {a.sharding}) lives on one process '
          'only, but this is a multi-process run: every process must hold a shard of a global '
          'array. Build it with jax.make_array_from_process_local_data or '
          'multihost_utils.host_local_array_to_global_array before saving.')


def record_array_sizes(arrays: Sequence[jax.Array]) -> None:
  """``/jax/orbax/write/{sharded,replicated}_array_gb`` per array, as stock records them."""
  for a in arrays:
    gb = math.prod(a.shape) * np.dtype(a.dtype).itemsize / 1024**3
    replicated = len(a.sharding.device_set) * math.prod(a.sharding.shard_shape(a.shape)) > math.prod(a.shape)
    jax.monitoring.record_scalar(
        '/jax/orbax/write/replicated_array_gb' if replicated else '/jax/orbax/write/sharded_array_gb',
        value=gb)


def missing_record_error(name: str, path: str, item_directory: str) -> errors.RestoreError:
  """The error for an array with no checksum record in an item orbax-pathways wrote: a
  ``MissingChecksumError``, or, when the item's index was damaged and rebuilt from the writer
  records beside it (``meta_io.read_item``), a ``DamagedIndexError`` (a ``MetadataError``) that
  names the index first: the records left do not replace it for this array."""
  fix = ('Run `orbax-pathways verify` on the step, or restore an earlier step; to read it '
         'unchecked at your own risk, restore with ORBAX_PATHWAYS_VERIFY=0 '
         '(Options(verify_checksums=False)).')
  cached = meta_io.cached_index(item_directory)
  if cached is not None and cached.damaged_index:
    return records_lib.DamagedIndexError(
        f'{cached.damaged_index} The writer records beside it do not cover array {name!r} at '
        f'{path} (a record was lost as well), so these bytes cannot be verified. {fix}')
  return errors.MissingChecksumError(
      f'Array {name!r} at {path} has no checksum record in {meta_io.index_path(item_directory)} '
      f'or the writer records beside it, although orbax-pathways wrote this item (its '
      f'{records_lib.DIRNAME}/ exists): the record was lost (a writer\'s record file deleted, or an '
      f'index missing the key), so these bytes cannot be verified. {fix}')


@dataclasses.dataclass(frozen=True)
class HostArray:
  """One host (numpy) leaf to write as Orbax writes it: ``tspec`` is Orbax's own write spec."""

  name: str
  value: np.ndarray
  tspec: dict


def host_chunk_records(value: np.ndarray,
                       chunk_shape: tuple[int, ...]) -> list[records_lib.ChunkRecord]:
  """crc32c of every chunk of ``value`` (already in the stored dtype) on the grid
  ``chunk_shape``, clipped to the array, in C order of the grid."""
  out = []
  for origin in format_lib.chunk_origins(value.shape, chunk_shape):
    region = format_lib.chunk_region(origin, chunk_shape, value.shape)
    sub = value[region.to_slices()]
    out.append(records_lib.ChunkRecord(tuple(origin), checksum.of_array(sub), sub.nbytes))
  return out


async def write_host_array(a: HostArray, *, context: Any) -> records_lib.ArrayRecord:
  """Writes one host leaf with Orbax's spec, then returns its record: the crc32c of each chunk
  of the grid tensorstore created, of the bytes as stored.

  A cast in Orbax's spec (its ``cast`` driver: v0 ``SaveArgs.dtype``, v1
  ``StorageOptions(dtype=...)`` or ``scoped_storage_options_creator``) is done here, with
  tensorstore's own conversion (``storage/cast.py``), and the converted values are written
  through the spec's base (the same zarr array, metadata and bytes as stock's cast write): the
  bytes checksummed are the bytes handed to storage."""
  value, tspec = np.asarray(a.value), dict(a.tspec)
  casts = cast_lib.cast_spec_dtypes(tspec)

  async def attempt(n: int) -> ts.TensorStore:
    # Past its deadline the leaf is written again through a fresh context (on OCDBT into a
    # retry database of its own, as array pieces are: storage/writer.retry_spec).
    ctx = hedge.fresh_context(context, n) if n else context
    spec = ts.Spec(writer_lib.retry_spec(tspec, n) if n else tspec)
    t = await ts.open(spec, create=True, open=True, context=ctx)
    await t.write(value, can_reference_source_data_indefinitely=True)
    return t

  try:
    if casts is not None:
      tspec = dict(tspec['base'])
      value = await asyncio.to_thread(cast_lib.convert, value, casts[1],
                                      what=f'host leaf {a.name!r}')
    t = await hedge.run(attempt, nbytes=int(value.nbytes), kind='write',
                        what=f'host leaf {a.name!r}')
    grid = t.chunk_layout.read_chunk.shape  # tensorstore types each dimension Optional
    chunk_shape = tuple(int(c) if c is not None else int(d)
                        for c, d in zip(grid or value.shape, value.shape))
    stored = t.dtype.numpy_dtype
  except Exception as e:
    raise errors.keeping_type(
        errors.SaveError, e,
        f'Writing array {a.name!r} failed: {type(e).__name__}: {e}. Earlier checkpoints are '
        'untouched; this step will not be committed. Check the storage path, credentials and '
        'free space, then save again.') from e
  chunks = await asyncio.to_thread(host_chunk_records, value, chunk_shape)
  return records_lib.ArrayRecord(name=a.name, dtype=stored.name, shape=tuple(value.shape),
                              chunk_shape=chunk_shape, chunks=tuple(chunks))


@dataclasses.dataclass
class PendingSave:
  """A save whose snapshot is taken; ``write()`` finishes it in the background."""

  transport: transports.Transport
  snapshot: transports.Snapshot
  stats: stats_lib.SaveStats
  item: values.Item
  ready: Callable[[], Awaitable[None]]
  bounds: deadline_lib.Bounds = deadline_lib.Bounds()  # the engine's (runs in Orbax's thread)

  @property
  def layouts(self) -> list[values.LeafLayout]:
    return self.snapshot.layouts

  @deadline_lib.with_bounds
  async def write(self, *, extra_requests: int = 0) -> None:
    """Every writer host's share, then the stats and the log line. ``extra_requests`` counts the
    metadata objects the front door writes alongside (Orbax's array metadata file)."""
    st = self.stats
    try:
      await self.ready()
      t0 = time.perf_counter()
      telemetry = compat.io_metrics_start('write')
      try:
        outcomes = await self.transport.write(self.snapshot)
      finally:
        # The host copies are written (or the write failed): let go of them now, not when
        # Orbax lets go of this save's futures after its commit, so that the next save's
        # snapshot (a local-only save may take it while this one commits:
        # multitier/local_steps.py) does not meet this one's copies in memory.
        self.snapshot.state = None
      st.write = stats_lib.WriteStats(
          written_bytes={o.writer: o.bytes_written for o in outcomes},
          chunks_written={o.writer: o.chunks_written for o in outcomes},
          write_s=time.perf_counter() - t0,
          storage_requests=len(outcomes) + extra_requests)
    finally:
      st.mark_written()
    total = st.total_written
    compat.io_metrics_end('write', telemetry, total, self.item.directory)
    log.info('orbax_pathways: saved %d arrays, %.1f MiB from %s (%s%s), save() blocked '
             '%.0f ms, write %.2f s (%.2f GB/s) to %s', st.arrays, total / 2**20,
             ', '.join(sorted(st.written_bytes)) or 'no host', st.transport,
             f', {st.snapshot} snapshot' if st.snapshot else '', st.blocking_s * 1e3,
             st.write_s, total / max(st.write_s, 1e-9) / 1e9, self.item.directory)


_TRANSPORT_NOTES = {
    ('pathways', 'colocated'): (logging.WARNING,
        'the worker hosts write and read the shards through colocated Python, and Pathways '
        'cannot transparently suspend-resume a workload that uses colocated Python: a preemption '
        'notice restarts the job from the latest committed step (preemption.resume) instead. '
        'ORBAX_PATHWAYS_TRANSPORT=in_process keeps suspend-resume, with every byte through the '
        'controller.'),
    ('pathways', 'persistence'): (logging.WARNING,
        'the Pathways workers write the shards through the persistence plugin; restores read '
        'through colocated Python, after which Pathways cannot transparently suspend-resume this '
        'workload.'),
    ('pathways', 'in_process'): (logging.INFO,
        'the controller moves every shard\'s bytes (as stock Orbax does), so Pathways can still '
        'suspend and resume this workload transparently; ORBAX_PATHWAYS_TRANSPORT=colocated '
        'writes from the worker hosts instead.'),
}
def announce_transport(transport: str) -> None:
  """Once per process and transport: which one moves the bytes, and what it costs (README
  "Transports and Pathways suspend-resume")."""
  rt = runtime.detect_runtime().value
  level, note = _TRANSPORT_NOTES.get(
      (rt, transport), (logging.INFO, 'each process writes and reads the shards its own devices '
                                      'hold.'))
  said.once(level, ('transport', rt, transport), 'orbax_pathways: transport %s (%s): %s',
             transport, rt, note)


class Engine:
  """Save and restore for one set of ``Options`` (a front door holds one)."""

  def __init__(self, options: options_lib.Options):
    self.options = options
    # The floor and cap of storage request deadlines, for the calls of this engine only
    # (storage/deadline.py: deadline_lib.with_bounds on each entry point).
    self.bounds = deadline_lib.Bounds(options.request_deadline_floor_s,
                                      options.request_deadline_cap_s)
    # ... and those Orbax makes through gcsfs and google-cloud-storage: a stall deadline.
    storage_clients.configure(hedge.stall_timeout_s(options.request_deadline_floor_s))
    # This process's partner for local-only copies (``_partner``), once worked out.
    self._partner_of: int | None = None
    self._partner_found = False

  def transport_name(self) -> str:
    return runtime.choose_transport(requested=self.options.transport).value

  def tier(self, directory: Any = None) -> tier_config.TierConfig | None:
    """This node's tier for a save or restore of the item ``directory`` (None: off), on the
    process that calls ``save``/``restore``. A directory an emergency manager assigned to the
    item's checkpoint directory (``tier/assigned.py``) comes first. ``Options.tier_dir=None`` takes
    ``ORBAX_PATHWAYS_TIER_DIR`` as the node has it set (where a node keeps its RAM disk is the
    node's setting, so it holds for ``Options(...)`` built in code too), then the /dev/shm
    default, kept only where it saves a storage read (``tier_config.default_applies``: remote
    storage, several processes, Pathways workers; said once in the log otherwise). An explicit
    directory is always used. Under the in-process transport this process is the host that owns
    the directory: one that is there must pass the private-root check (``tier_config.usable``:
    else one warning, tier off on this process, its peer server included); one that cannot be
    made is warned about and its copies skipped, while restores still read other hosts' tiers.
    Worker hosts check their own (``tier_store.write_entry`` / ``entries``)."""
    if directory is not None and format_lib.is_node_step(directory):
      return None  # a node step is in the node already (multitier/node_steps.py): no copy of it
    o = self.options
    tier_dir, keep = tier_config.named_dir(o.tier_dir), o.tier_keep
    root = tier_layout.split_item_dir(directory)[0] if directory is not None else None
    assigned = tier_assigned.lookup(root)  # an emergency manager's local_directory
    if assigned is not None:
      tier_dir, keep = assigned
    cfg = tier_config.resolve(tier_dir, keep, o.tier_max_age_s, o.tier_max_bytes)
    if cfg is None:
      return None
    local = self.transport_name() == options_lib.TransportName.IN_PROCESS
    if not cfg.explicit:
      remote = root is not None and tier_config.storage_is_remote(root)
      # A local-only step's bytes go nowhere else: the default always applies to it.
      if (not tier_config.default_applies(remote, jax.process_count(), not local)
          and not format_lib.is_local_only(directory)):
        said.once(logging.INFO, ('tier-default-off',),
                   'orbax_pathways: no node-local tier for %s: the checkpoint directory is on '
                   'this machine\'s disk and one process saves and restores it, so the page '
                   'cache already serves a restart (the /dev/shm default is kept for gs:// or '
                   'network storage, jobs of several processes and Pathways workers). Set '
                   'ORBAX_PATHWAYS_TIER_DIR (Options.tier_dir) to a tmpfs directory to keep '
                   'a copy in node memory anyway.', root)
        return None
    return tier_config.usable(cfg, missing_ok=True) if local else cfg

  def _partner(self, directory: Any) -> int | None:
    """The process that keeps this process's second copy of a local-only step
    (``Options.local_copies=2``, multi-controller JAX; ``fleet/partners.py``), else None. No
    other slice: said once, no copy."""
    if (self.options.local_copies < 2 or not format_lib.is_local_only(directory)
        or jax.process_count() < 2):
      return None
    # Worked out at the first local-only save, not at every one: it walks every device of the
    # job, and a process's devices and slices do not change while it runs.
    if self._partner_found:
      return self._partner_of
    slice_of = layout.slice_of_processes(jax.devices(), num_slices=self.options.num_slices)
    partner = tier_partners.partner_of(jax.process_index(), slice_of)
    self._partner_of, self._partner_found = partner, True
    if partner is None:
      said.once(logging.WARNING, ('no-partner',),
                 'orbax_pathways: Options.local_copies=2, but every process is in one slice: a '
                 'second copy there would be lost with the first, so local-only steps keep one '
                 'copy. Set ORBAX_PATHWAYS_NUM_SLICES (Options.num_slices) if the platform does '
                 'not tell the slices apart.')
    return partner

  # ---- save ------------------------------------------------------------------------------------

  @deadline_lib.with_bounds
  async def save(self, arrays: Sequence[jax.Array], leaves: Sequence[values.SaveLeaf],
                 item: values.Item, *, config: transports.SaveConfig,
                 ready: Callable[[], Awaitable[None]]) -> PendingSave:
    t0 = time.perf_counter()
    check_global(arrays, [leaf.name for leaf in leaves])
    config = dataclasses.replace(config, tier=self.tier(item.directory),
                                 tier_scope=self.options.tier_scope,
                                 peer_timeout_s=self.options.peer_timeout_s,
                                 partner=self._partner(item.directory),
                                 tier_peer_timeout_s=self.options.tier_peer_timeout_s)
    transport = registry.create(self.transport_name(), save=config)
    if format_lib.is_local_only(item.directory) and transport.name not in (options_lib.TransportName.IN_PROCESS, options_lib.TransportName.COLOCATED):
      raise errors.SaveError(
          f'{item.directory} is a local-only step (Options.local_save_interval_steps), whose '
          f'bytes go to the hosts\' node-local tiers; the {transport.name} transport writes '
          'none. Use the local or colocated transport, or local_save_interval_steps=0 '
          '(docs/multi_tier.md).')
    reasons = transport.unsupported(leaves, item)
    if reasons and transport.fallback is not None:
      warnings.warn(
          f'orbax_pathways: the Pathways {transport.name} transport cannot write this save ('
          + '; '.join(reasons) + f'); using the {transport.fallback.name} transport instead (same '
          'on-disk format). Use use_ocdbt=False, no dtype casts and supported dtypes to use '
          f'{transport.name}.', RuntimeWarning, stacklevel=4)
      transport = transport.fallback
    announce_transport(transport.name)
    snap = await transport.snapshot(arrays, leaves, item, ready)
    if jax.process_index() == 0:
      record_array_sizes(arrays)
    step_dir = _step_dir(item.directory)
    st = stats_lib.SaveStats(
        transport=transport.name, arrays=len(leaves), snapshot=snap.snapshot_mode,
        blocking_s=time.perf_counter() - t0, d2h_bytes=dict(snap.d2h_bytes),
        controller_tensor_bytes=snap.controller_tensor_bytes,
        step=format_lib.step_of(step_dir.rsplit('/', 1)[-1]), step_dir=step_dir)
    stats_lib.record_save(st)
    return PendingSave(transport, snap, st, item, ready, self.bounds)

  @deadline_lib.with_bounds
  async def save_host(self, writer: str, item: values.Item, arrays: Sequence[HostArray], *,
                      context: Any) -> records_lib.WriterRecord:
    """Writes host (numpy, scalar) leaves exactly as Orbax's ``NumpyHandler`` does, then their
    record ``_pathways/<writer>.msgpack`` (crc32c of every chunk), which the item's index merges
    like any writer's. Runs in Orbax's background commit, on the one process that writes them
    (process 0, as stock)."""
    t0 = time.perf_counter()
    records = await asyncio.gather(*(write_host_array(a, context=context) for a in arrays),
                                   return_exceptions=True)  # all settle, then raise
    for r in records:
      if isinstance(r, BaseException):
        raise r
    done = [r for r in records if not isinstance(r, BaseException)]
    written = sum(c.nbytes for r in done for c in r.chunks)  # in the stored dtypes
    record = records_lib.writer_record(writer, format_lib.IN_PROCESS_RECORD, done,
                                       written_bytes=written,
                                       chunks=sum(len(r.chunks) for r in done))
    await asyncio.to_thread(meta_io.write_record, item.directory, record)
    log.debug('orbax_pathways: wrote %d host arrays (%d bytes) with checksums in %.2f s to %s',
              len(arrays), written, time.perf_counter() - t0, item.directory)
    return record

  # ---- restore ---------------------------------------------------------------------------------

  @deadline_lib.with_bounds
  async def restore(self, leaves: Sequence[RestoreLeaf], item: values.Item, *,
                    config: transports.ReadConfig,
                    records: dict[str, records_lib.ArrayRecord],
                    written_by_us: bool = False,
                    context: Any = None) -> list[jax.Array]:
    """``records`` are this item's ``_pathways`` records by array name (empty for a stock
    checkpoint), read once by the front door; ``written_by_us`` says the item has our metadata
    (then an array without a record is an error while ``config.verify`` is on)."""
    t0 = time.perf_counter()
    with _trace('plan_read'):
      targets = [await self._target(leaf, item, records.get(leaf.name), context,
                                    require_record=written_by_us and config.verify)
                 for leaf in leaves]
    config = dataclasses.replace(config, tier=self.tier(item.directory),
                                 tier_peer_timeout_s=self.options.tier_peer_timeout_s,
                                 peer_timeout_s=self.options.peer_timeout_s)
    transport = registry.create(self.transport_name(), read=config)
    telemetry = compat.io_metrics_start('read')
    out, outcomes = await transport.read(targets, item)
    for t in targets:
      if t.sharding.shard_shape(t.shape) != t.shape_on_storage:  # as stock counts it
        jax.monitoring.record_event('/jax/orbax/checkpoint/deserialize/shard_shape_changed')
    with _trace('device_put'):
      out = [jax.device_put(a, leaf.format) if leaf.format is not None else a
             for a, leaf in zip(out, leaves)]
    step_dir = _step_dir(item.directory)
    st = stats_lib.RestoreStats(
        transport=transport.name if transport.name != 'persistence' else 'colocated',
        arrays=len(leaves), read_s=time.perf_counter() - t0,
        bytes_read={o.reader: o.bytes_read for o in outcomes},
        bytes_needed={o.reader: o.bytes_needed for o in outcomes if o.bytes_needed},
        chunks_verified=sum(o.chunks_verified for o in outcomes),
        step=format_lib.step_of(step_dir.rsplit('/', 1)[-1]), step_dir=step_dir,
        **stats_lib.by_source(outcomes))
    stats_lib.record_restore(st)
    compat.io_metrics_end('read', telemetry, sum(st.bytes_needed.values()) or sum(st.bytes_read.values()),
                          item.directory)
    log.info('orbax_pathways: restored %d arrays, read %.1f MiB (%s, %s; %s) in %.2f s, %d '
             'chunks verified, from %s', len(out), sum(st.bytes_read.values()) / 2**20,
             st.transport, ', '.join(sorted(st.bytes_read)), st.sources_text(), st.read_s,
             st.chunks_verified, item.directory)
    unread = sum(st.bytes_by_source.get(k, 0) for k in ('local', 'peer'))
    if unread:  # the tier is a cache of storage: damage on storage is not seen through it
      log.info('orbax_pathways: %.1f MiB of this restore came from node-local tiers, so their '
               'copies on storage were not read and not checked: `orbax-pathways verify %s` '
               'checks storage.', unread / 2**20, _step_dir(item.directory))
    return out

  @deadline_lib.with_bounds
  async def read_to_host(self, names: Sequence[str], dtypes: Sequence[Any], item: values.Item, *,
                         records: dict[str, records_lib.ArrayRecord], verify: bool,
                         written_by_us: bool = False, record_stats: bool = True,
                         context: Any = None) -> list[np.ndarray]:
    """Whole arrays as numpy on this host (restore targets that ask for ``np.ndarray``,
    ``np.ndarray`` and scalar leaves), read and verified like any restore; no devices involved.
    An array without a record is read unchecked (stock Orbax wrote it) unless the item is
    ``written_by_us`` and ``verify`` is on: then ``MissingChecksumError``. ``record_stats``:
    publish a ``RestoreStats`` (transport 'host') for this read."""
    from orbax_pathways.plan import boxes as boxes_lib  # pylint: disable=g-import-not-at-top
    from orbax_pathways.transports import share  # pylint: disable=g-import-not-at-top
    t0 = time.perf_counter()
    targets = [await self._target(RestoreLeaf(n, None, d, None), item, records.get(n), context,
                                  require_record=written_by_us and verify)
               for n, d in zip(names, dtypes)]
    boxes = [[boxes_lib.Box.full(t.shape)] for t in targets]
    buffers, rstats = await share.read_share(targets, boxes, item=item, verify=verify,
                                             context=context)
    step_dir = _step_dir(item.directory)
    if record_stats:
      stats_lib.record_restore(stats_lib.RestoreStats(
          transport='host', arrays=len(targets), read_s=time.perf_counter() - t0,
          bytes_read={'host': rstats.bytes_read}, chunks_verified=rstats.chunks_verified,
          step=format_lib.step_of(step_dir.rsplit('/', 1)[-1]), step_dir=step_dir))
    return [bufs[bx[0]] for bufs, bx in zip(buffers, boxes)]

  async def _target(self, leaf: RestoreLeaf, item: values.Item,
                    record: records_lib.ArrayRecord | None, context: Any, *,
                    require_record: bool = False) -> values.ReadTarget:
    """Resolves one leaf against what is on storage. ``require_record``: the item was written
    by orbax-pathways and verification is on, so a leaf without a record cannot be verified."""
    tspec = compat.build_read_spec(item, leaf.name,
                                   raise_array_data_missing_error=item.raise_array_data_missing_error)
    path = item.path_of(leaf.name)
    if record is None and require_record:
      raise missing_record_error(leaf.name, path, item.directory)
    dtype = leaf.dtype
    chunk_shape: tuple[int, ...] | None
    if record is not None:
      stored_shape, chunk_shape = tuple(record.shape), tuple(record.chunk_shape)
      chunks = grid_lib.chunk_index([record])
      if dtype is None:
        dtype = np.dtype(record.dtype)
    else:  # A checkpoint without our metadata (stock Orbax): ask tensorstore for the layout.
      try:
        t = await ts.open(ts.Spec(tspec), open=True,
                          context=context if context is not None else compat.ts_context(item.use_ocdbt))
      except Exception as e:
        raise reader_lib.open_error(leaf.name, path, e) from e
      stored_shape = tuple(t.shape)
      # tensorstore types each chunk dimension Optional; an open array's are all set.
      chunk_shape = tuple(t.chunk_layout.read_chunk.shape or ()) or None  # type: ignore[arg-type]
      chunks = {}
      if dtype is None:
        dtype = t.dtype.numpy_dtype
    shape = tuple(leaf.shape) if leaf.shape is not None else stored_shape
    if shape != stored_shape and leaf.strict:
      raise errors.ShapeMismatchError(
          f'Array {leaf.name!r} at {path}: Requested shape: {shape} is not compatible with the '
          f'stored shape: {stored_shape}. Truncating/padding is disabled: restore with the saved '
          'shape, or pass ArrayRestoreArgs(strict=False) (v1: ArrayOptions.Loading('
          'enable_padding_and_truncation=True)) to pad with zeros or truncate.')
    return values.ReadTarget(
        name=leaf.name, path=path, tspec=tspec, shape=shape, dtype=np.dtype(dtype),
        chunk_shape=chunk_shape, chunks=chunks, sharding=leaf.sharding, stored_shape=stored_shape,
        require_checksums=bool(chunks), stored_dtype=record.dtype if record is not None else None)
