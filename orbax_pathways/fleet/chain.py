"""The source chain of a restore: each needed chunk from this node's tier, else a surviving
peer's tier (``peer/client.py``), else, when other processes need it too, one storage read shared
with them (``fleet/relay.py``), else storage; every chunk checked against the committed step's
checksums.

Who calls what, on which host: the in-process transport's ``read`` (every process) builds the chain
once per restore with ``for_restore`` (with an ``Exchange`` under multi-controller JAX: this
process then also serves its node's tier to the others and publishes what it holds) and
hands it to ``share.read_share``; the storage reader
(``storage/reader.read_array``) calls ``fill`` once per chunk-aligned region, which, in one
executor thread per region, plans with ``plan/sources.assign`` (pure) and puts the chunks a
source holds into the region's buffer (``tier/chunk_read.Place``); the reader reads the rest from
storage and verifies it as before. ``report`` logs, once per restore, what was not usable.

A source is anything with ``name``, ``held(read)`` (origins of the chunks it holds of one array)
and ``read_chunk(read, chunk, dtype)`` (the chunk's bytes in the stored ``dtype``, or raises
``SourceError``); a source with ``read_into(read, chunk, place)`` (this node's tier) reads
straight into the region buffer instead; ``counted_as(read, chunk)``, where a source has it,
names the source the chunk's bytes are counted under (a relay chunk this process read from
storage: ``storage``). Bytes are never converted: a chunk in another dtype or shape than the
committed step stores is refused, and a chunk is used only if the crc32c of its bytes, as they
lie in the region buffer, and its size equal the committed step's record (read from storage's
index, never from the source); otherwise storage reads it (over what the source put there).
Never chunks of two saves mixed: a tier entry joins the chain only when its save id is the one
storage's index records for its writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
import weakref
from typing import Any, Container, Iterator, Mapping, Protocol, Sequence

import numpy as np

from orbax_pathways.format import grid as grid_lib
from orbax_pathways.format import names as format_names
from orbax_pathways.plan import batches
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import sources as plan_sources
from orbax_pathways.storage import meta_io
from orbax_pathways.storage import pages
from orbax_pathways.tier import chunk_read
from orbax_pathways.peer import exchange as tier_exchange
from orbax_pathways.tier import fsafe
from orbax_pathways.tier import manifest as manifest_lib
from orbax_pathways.peer import client as tier_peer
from orbax_pathways.peer import server as tier_server
from orbax_pathways.fleet import ops as fleet_ops
from orbax_pathways.fleet import relay as tier_relay
from orbax_pathways.tier import config as tier_config
from orbax_pathways.tier import store
from orbax_pathways.peer import wire as tier_wire

Box = boxes_lib.Box
log = logging.getLogger('orbax_pathways')
# The names stats report, in chain order. 'relay': read from storage by another process that
# needed the chunk too, and passed on (``fleet/relay.py``).
SOURCES = ('local', 'peer', 'relay', 'storage')
_COPIES = ('local', 'peer')  # the sources that hold tier copies (a failed one tries the next)


class SourceError(Exception):
  """A source cannot provide a chunk it listed (missing or unreadable file, lost peer)."""


@contextlib.contextmanager
def source_errors(path: str) -> Iterator[None]:
  """Reading the file ``path`` into a region buffer: what fails is a ``SourceError`` naming it
  (the chain then asks the next source, else storage)."""
  try:
    yield
  except OSError as e:  # fsafe.UnsafeError too: a symlink, a FIFO, another size
    what = e.strerror or str(e)
    raise SourceError(what if path in what else f'{path}: {what}') from e
  except (ValueError, BufferError) as e:  # a mapping that cannot be made: never a crash
    raise SourceError(f'{path}: {e}') from e


class Source(Protocol):
  name: str

  def held(self, read: Any) -> Container[tuple[int, ...]]:
    ...

  def read_chunk(self, read: Any, chunk: Box, dtype: np.dtype) -> np.ndarray:
    ...


@dataclasses.dataclass(frozen=True)
class _Held:
  path: str
  dtype: str
  shape: tuple[int, ...]
  chunk_shape: tuple[int, ...]
  files: dict[tuple[int, ...], str]
  bands: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # band file -> (origin, shape)


class LocalSource:
  """This node's tier entries of one committed item (every writer whose save id matches).

  A copy is used only where it is the committed step's, bit for bit: its manifest's shape and
  chunk shape are the committed record's (``held``), its dtype is the one storage stores (the
  region buffer's, ``read_into``), and each chunk file is a regular file (never a symlink, FIFO
  or device: ``fsafe.open_regular``, which cannot block) of exactly the committed chunk's
  ``nbytes``. Its bytes go straight into the region buffer as raw bits (``chunk_read``).

  A chunk stored in a band (``tier/manifest.py``) is read from the band file, which must be
  exactly the band's size: where the band is one page-aligned run of the region buffer, the
  first of its chunks to be read maps the whole band there (``storage/pages``), once, under a
  lock, before any chunk of it is filled (so a later fallback's bytes are never mapped over),
  and each of its chunks is then checked where it lies; elsewhere each chunk is copied out of
  the band."""

  name = 'local'

  def __init__(self, found: Sequence[store.Entry]):
    self._arrays: dict[str, list[_Held]] = {}
    for e in found:
      assert e.manifest is not None
      for a in e.manifest.arrays:
        self._arrays.setdefault(a.name, []).append(
            _Held(e.path, a.dtype, a.shape, a.chunk_shape, dict(zip(a.origins, a.files)),
                  manifest_lib.band_boxes(a)))
    self._lock = threading.Lock()
    # Region buffer -> {band path: mapped there}: each band is mapped at most once per buffer.
    self._mapped: weakref.WeakKeyDictionary[Any, dict[str, bool]] = weakref.WeakKeyDictionary()

  def _matching(self, read: Any) -> list[_Held]:
    return [h for h in self._arrays.get(read.name, ())
            if read.chunk_shape is not None and h.chunk_shape == tuple(read.chunk_shape)
            and h.shape == tuple(read.plan.global_shape)]

  def held(self, read: Any) -> Container[tuple[int, ...]]:
    out: set[tuple[int, ...]] = set()
    for h in self._matching(read):
      out.update(h.files)
    return out

  def _file(self, read: Any, chunk: Box, dtype: np.dtype
            ) -> tuple[str, tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """The path of the chunk's file and, for a band file, the band's (origin, shape), once its
    entry's dtype is the committed one."""
    for h in self._matching(read):
      name = h.files.get(chunk.start)
      if name is None:
        continue
      if not isinstance(name, str) or os.path.basename(name) != name or name in ('', '.', '..'):
        raise SourceError(f'{h.path}: its manifest names {name!r} for chunk '
                          f'{list(chunk.start)} of {read.name!r}, not a file of the entry')
      try:
        found: np.dtype | None = layout_dtype(h.dtype)
      except TypeError:
        found = None
      if found != dtype:
        raise SourceError(f'{h.path}: array {read.name!r} is {h.dtype} in this copy\'s manifest, '
                          f'{dtype} in the committed step; the copy is not used')
      return os.path.join(h.path, name), h.bands.get(name)
    raise SourceError(f'no file for chunk {list(chunk.start)} of {read.name!r}')

  def read_into(self, read: Any, chunk: Box, place: chunk_read.Place) -> None:
    """Reads the chunk's file into its place in the region buffer (``SourceError`` if the copy
    is not the committed one's layout, or its file is missing, unsafe or of the wrong size)."""
    path, band = self._file(read, chunk, place.dtype)
    record = read.chunks.get(chunk.start)
    size = record.nbytes if record is not None else place.nbytes
    with source_errors(path):
      if band is not None:
        size = math.prod(band[1]) * place.dtype.itemsize
        if self._in_mapped_band(place, path, band, size):
          place.checksum_in_place()
          return
        with fsafe.open_regular(path, size) as f:
          place.fill_from_band(f.fileno(), *band)
        return
      with fsafe.open_regular(path, size) as f:
        place.fill_from_file(f.fileno(), path)

  def _in_mapped_band(self, place: chunk_read.Place, path: str,
                      band: tuple[tuple[int, ...], tuple[int, ...]], size: int) -> bool:
    """Whether the band at ``path`` is mapped over its run of ``place``'s region buffer: mapped
    by the first of its chunks to ask (``storage/pages.map_file``), once per buffer."""
    owner = pages.owner(place.region)
    if owner is None:
      return False
    offset = chunk_read.band_run(place.region, place.region_box, *band)
    if offset is None:
      return False
    with self._lock:
      done = self._mapped.setdefault(owner, {})
      if path not in done:
        with fsafe.open_regular(path, size) as f:
          done[path] = pages.map_file(place.region, offset, size, f.fileno()) is not None
      return done[path]

  def read_chunk(self, read: Any, chunk: Box, dtype: np.dtype) -> np.ndarray:
    """The chunk's bytes as a new array in the stored ``dtype`` (the ``Source`` protocol; the
    chain itself uses ``read_into``)."""
    out = np.empty(chunk.shape, dtype)
    self.read_into(read, chunk, chunk_read.Place(out, chunk, chunk))
    return out


layout_dtype = manifest_lib.dtype_of


class SourceChain:
  """The sources of one restore on one host, in order, and what each delivered."""

  def __init__(self, sources: Sequence[Source], where: str):
    self.sources = list(sources)
    self.where = where
    # A local-only step: storage holds none of its bytes, so nothing falls back to it (the
    # reader raises for a chunk no source gives) and no relay reads storage for others.
    self.tier_only = format_names.is_local_only(where)
    self.bytes: dict[str, int] = {}
    self.seconds: dict[str, float] = {}
    self.problems: list[str] = []
    self.verified = 0  # chunks delivered by a source, each checked against its record
    self._held: dict[tuple[str, int], Container[tuple[int, ...]]] = {}
    self._lock = threading.Lock()  # regions are filled concurrently, in executor threads

  def _held_by(self, read: Any, i: int) -> Container[tuple[int, ...]]:
    key = (read.name, i)
    with self._lock:
      if key not in self._held:
        self._held[key] = self.sources[i].held(read)
      return self._held[key]

  def add(self, source: str, nbytes: int, seconds: float) -> None:
    with self._lock:
      self._add(source, nbytes, seconds)

  def _add(self, source: str, nbytes: int, seconds: float) -> None:
    self.verified += 1
    self.bytes[source] = self.bytes.get(source, 0) + nbytes
    self.seconds[source] = self.seconds.get(source, 0.0) + seconds

  def _take(self, read: Any, i: int, place: chunk_read.Place) -> bool:
    """Fills ``place`` (a chunk's place in the region buffer, in the stored dtype) from source
    ``i``, as raw bits; True when the bytes, as they lie there, match the committed record."""
    chunk = place.chunk
    record = read.chunks.get(chunk.start) if read.chunks else None
    src = self.sources[i]
    if record is None:
      self.problems.append(f'{src.name}: {read.name!r} chunk {list(chunk.start)} has no '
                           'committed checksum to check it against')
      return False
    if record.nbytes != place.nbytes:
      self.problems.append(
          f'{src.name}: {read.name!r} chunk {list(chunk.start)}: the committed record says '
          f'{record.nbytes} bytes, the chunk holds {place.nbytes} ({chunk.size} x {place.dtype})')
      return False
    try:
      if hasattr(src, 'read_into'):  # straight into the region buffer
        src.read_into(read, chunk, place)
      else:
        place.fill_from_array(src.read_chunk(read, chunk, place.dtype))
    except (SourceError, tier_wire.PeerError) as e:
      self.problems.append(f'{src.name}: {e}')
      return False
    except ValueError as e:  # fill_from_array: another dtype or shape; nothing converted
      self.problems.append(f'{src.name}: {read.name!r} chunk {list(chunk.start)}: {e}')
      return False
    if place.crc32c != record.crc32c:
      found = -1 if place.crc32c is None else place.crc32c
      self.problems.append(
          f'{src.name}: {read.name!r} chunk {list(chunk.start)} is damaged (committed crc32c '
          f'{record.crc32c:#010x}, {record.nbytes} bytes; found {found:#010x})')
      return False
    return True

  async def fill(self, read: Any, region: Box, data: np.ndarray) -> list[Box]:
    """Fills the chunks of ``region`` that a source holds (and whose bytes check out) into
    ``data`` (the region's buffer: C-contiguous, the stored dtype); returns the boxes still to
    read from storage (a chunk that failed is read again there, over what was put in its
    place)."""
    if not self.sources or not read.chunks:
      return [region]
    loop = asyncio.get_running_loop()
    # In executor threads: the plan's first question to the peer source finds out what peers
    # hold (key-value reads and one request per peer, each with a deadline), and the reads
    # block; neither may run on the event loop. One hop for a region of up to GROUP_BYTES (the
    # common case: regions are filled concurrently); a larger one is split into groups of
    # chunks read concurrently, as tensorstore decodes a large region's chunks in parallel.
    plan, groups, failed = await loop.run_in_executor(None, self._plan_and_fill, read, region,
                                                      data)
    if groups:  # every group settles before anything is raised: no thread outlives the loop
      done = await asyncio.gather(*(
          loop.run_in_executor(None, self._fill_chunks, read, region, data, g) for g in groups),
          return_exceptions=True)
      for more in done:
        if isinstance(more, BaseException):
          raise more
        failed += more
    if not plan.chunks:
      return [region]
    return list(plan.storage) + failed

  def _plan_and_fill(self, read: Any, region: Box, data: np.ndarray
                     ) -> tuple[plan_sources.RegionSources, list[list[tuple[int, Box]]], list[Box]]:
    """(the region's plan, groups of its chunks still to fill, chunks that failed): fills them
    all here when they fit in one group."""
    held = [self._held_by(read, i) for i in range(len(self.sources))]
    plan = plan_sources.assign(region, read.chunk_shape, read.plan.global_shape, held)
    groups = _groups(plan.chunks, data.dtype.itemsize)
    if len(groups) == 1:
      return plan, [], self._fill_chunks(read, region, data, groups[0])
    return plan, groups, []

  def _fill_chunks(self, read: Any, region: Box, data: np.ndarray,
                   chunks: Sequence[tuple[int, Box]]) -> list[Box]:
    """Fills ``chunks`` ((source, chunk) pairs of the region's plan); returns those that
    failed."""
    failed = []
    for i, chunk in chunks:
      if not any(self._fill_one(read, region, data, j, chunk) for j in self._after(read, i, chunk)):
        failed.append(chunk)
    return failed

  def _after(self, read: Any, i: int, chunk: Box):
    """Source ``i`` (the plan's), then each later tier source that holds ``chunk``, lazily: a
    chunk one source cannot give (its copy damaged, its peer gone) is asked of the next one
    that holds a copy (a peer's replica or partner copy) before storage. A source with
    ``distrust`` is told first that the copy before it failed (the peer source then also asks
    for the chunks of a writer this node's tier holds)."""
    yield i
    for j in range(i + 1, len(self.sources)):
      src = self.sources[j]
      if src.name not in _COPIES:  # the relay is a storage read: storage's turn, as planned
        continue
      if hasattr(src, 'distrust'):
        src.distrust(read, chunk.start)
      if chunk.start in self._held_by(read, j):
        yield j

  def _fill_one(self, read: Any, region: Box, data: np.ndarray, i: int, chunk: Box) -> bool:
    t0 = time.perf_counter()
    place = chunk_read.Place(data, region, chunk)
    if not self._take(read, i, place):
      return False
    src = self.sources[i]
    name = src.counted_as(read, chunk) if hasattr(src, 'counted_as') else src.name
    self.add(name, place.nbytes, time.perf_counter() - t0)
    return True

  def report(self) -> None:
    """One log line for this restore if any source fell back."""
    if self.problems:
      log.warning('orbax_pathways: node-local copy of %s: %d chunk(s) or peer(s) not usable, '
                  'read %s instead (first: %s)', self.where, len(self.problems),
                  'through tensorstore' if format_names.is_node_step(self.where)
                  else 'from storage', self.problems[0])


GROUP_BYTES = 32 << 20  # a region's chunks are filled by one thread up to this many bytes


def _groups(chunks: Sequence[tuple[int, Box]], itemsize: int,
            limit: int = GROUP_BYTES) -> list[list[tuple[int, Box]]]:
  """``chunks`` in order, cut into consecutive groups of at most ``limit`` bytes (a larger chunk
  alone); ``[]`` when there are none. Pure."""
  return [[chunks[i] for i in batch]
          for batch in batches.in_order([c[1].size * itemsize for c in chunks], limit)]


def _writers_held(usable: Sequence[store.Entry], committed: Any) -> dict[str, list[tuple[str, str]]]:
  """Writer -> the (entry writer, save id) of this node's usable entries that hold chunks it
  wrote: each entry holds its own writer's, and (``tier_scope='held'``) the chunks of other
  writers that the committed index's writer column names. Pure."""
  arrays = committed.arrays() if committed is not None else {}
  out: dict[str, set[tuple[str, str]]] = {}
  for e in usable:
    tag = (e.writer, e.save_id)
    out.setdefault(e.writer, set()).add(tag)
    for a in e.manifest.arrays if e.manifest is not None else ():
      chunks = arrays[a.name].chunks if a.name in arrays else None
      if isinstance(chunks, grid_lib.ChunkGrid):
        for w in chunks.writers_at(a.origins):
          out.setdefault(w, set()).add(tag)
  return {w: sorted(t) for w, t in out.items()}


def for_restore(cfg: tier_config.TierConfig | None, item_dir: str,
                save_ids: Mapping[str, str] | str | None = None,
                peers: tier_exchange.Exchange | None = None,
                relay_targets: Mapping[str, tier_relay.Target] | None = None
                ) -> SourceChain | None:
  """The chain for restoring ``item_dir`` on this host: this node's tier entries of the item
  whose save id storage's index records for their writer (the index this restore's front door
  just read, from ``meta_io``'s cache), then, with ``peers`` (every process of a
  multi-controller restore passes one), the other processes' tiers. None (storage only) when
  the tier is off or nothing could serve; one log line when this node holds only unusable
  copies. A colocated worker, which has no index, passes the committed save id the controller
  sent it as ``save_ids`` (a str: a colocated save gives every writer the same id). With ``peers`` and ``relay_targets`` (the restore's arrays), a
  chunk no tier holds that other processes need too is read from storage once for them all
  (``fleet/relay.py``)."""
  if cfg is None:
    return None
  root, step_name, item = manifest_lib.split_item_dir(item_dir)
  found = store.entries(cfg.tier_dir, root, step_name, item) if os.path.isdir(cfg.tier_dir) else []
  if not found and peers is None and not format_names.is_local_only(item_dir):
    return None
  # The front door read the index moments ago in this restore: no second request for it. An
  # item without an index (schema 1, a save that never reached Orbax's finalize) records no
  # save ids: its tier copies are never used.
  if save_ids is None:
    committed = meta_io.cached_index(item_dir)
    save_ids = {w.writer: w.save_id for w in committed.writers} if committed is not None else {}
  every = save_ids if isinstance(save_ids, str) else None
  ids: Mapping[str, str] = {} if isinstance(save_ids, str) else save_ids

  def committed_id(writer: str) -> str:
    return every if every is not None else ids.get(writer, '')

  usable, skipped = [], []
  for e in found:
    if e.manifest is None:
      skipped.append(f'{e.path} ({e.error})')
    elif not committed_id(e.writer) or committed_id(e.writer) != e.save_id:
      skipped.append(f'{e.path} (stale: save {e.save_id}, the committed step records '
                     f'{committed_id(e.writer) or "no save id"} for writer {e.writer})')
    else:
      store.touch(e.path)  # in use: node-level clean-up (tier/gc.py) leaves it alone
      usable.append(e)
  if skipped:
    log.info('orbax_pathways: node-local copy of %s not used: %s; reading storage for it',
             item_dir, '; '.join(skipped[:3]) + (f' (+{len(skipped) - 3} more)' if len(skipped) > 3 else ''))
  chain = SourceChain([LocalSource(usable)] if usable else [], item_dir)
  if peers is not None and ids:
    prefix = peers.prefix(item_dir)
    peer_source = tier_peer.PeerSource(peers, prefix, tier_peer.item_parts(item_dir), ids,
                                       {e.writer for e in usable}, chain.problems)
    relay = (tier_relay.RelaySource(peer_source, relay_targets, peers.timeout_s)
             if relay_targets and not chain.tier_only else None)
    try:
      address = tier_server.serve(cfg.tier_dir, ops=fleet_ops.TABLE)
      if relay is not None:  # before publishing: whoever sees our key may ask for a relay
        tier_relay.register(relay)
      peers.publish(prefix, address, [(e.writer, e.save_id) for e in usable],
                    holds=_writers_held(usable, meta_io.cached_index(item_dir)))
    except Exception as e:  # pylint: disable=broad-except  (no peers: storage, as before)
      log.warning('orbax_pathways: node-local tiers of other hosts not used for %s: this '
                  'process could not serve or publish its own (%s: %s)', item_dir,
                  type(e).__name__, e)
    else:
      chain.sources.append(peer_source)
      if relay is not None:
        chain.sources.append(relay)
  return chain if chain.sources or chain.tier_only else None
