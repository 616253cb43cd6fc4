"""Reads and writes ``<item>/_pathways/`` (what is in it: ``orbax_pathways.format``).

Who calls what, on which host:

- ``write_record``: each writer process (in-process transport) in the background part of a save; the
  persistence transport's controller.
- ``write_index``: whoever knows the item is complete, before the step becomes visible: the
  primary host in Orbax's finalize (``storage/index.merge_item``), or the colocated controller
  once every worker call has returned.
- ``read_item``: every restoring process (the Orbax front door, twice for a restore without a
  target: ``metadata()`` then ``deserialize()``), ``elastic.remapped_abstract_state`` and the CLI.
  It reads one object, the index; a second call for the same item checks the index's storage
  generation (a conditional read: no bytes move when unchanged) and answers from a small cache.
  An item without an index (written before schema 2, or by an interrupted finalize) has its
  records listed and read concurrently; so has one whose index cannot be decoded (truncated,
  empty, garbage: the index only saves reads), with one warning per process naming it.
- ``read_records``: ``storage/index.merge_item`` / ``merge_pending`` (the records they join),
  tests and the CLI.

I/O goes through tensorstore's kvstore (``file``, ``gcs``, ``s3``): one request per object read
or written, storage generations for the cache check, concurrent reads bounded by tensorstore's
own per-driver concurrency limits, atomic writes on local disk. Every request has a deadline
(``storage/hedge.run_sync``): past it, the same request is issued again through a fresh context
and the first answer wins (objects are written whole, so a repeated write is harmless).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
from typing import Any, Sequence

import tensorstore as ts

from orbax_pathways.format import item as item_lib

from orbax_pathways.format import records as records_lib
from orbax_pathways import version
from orbax_pathways.storage import hedge
from orbax_pathways.format import urls

log = logging.getLogger('orbax_pathways')

# Items whose index stays cached (per process). Small: a restore touches one or a few items.
CACHE_ITEMS = 16

_ctx_lock = threading.Lock()
_context: ts.Context | None = None
_cache_lock = threading.Lock()
_cache: collections.OrderedDict[str, tuple[bytes, item_lib.ItemMetadata]] = collections.OrderedDict()
# Reads by kind, for tests and benchmarks: see read_counts().
_stats: collections.Counter[str] = collections.Counter()


def context() -> ts.Context:
  """This process's tensorstore context for the package's own small objects (records, the
  writer lease), built at first use; any thread. A retry opens a fresh one (``hedge``)."""
  global _context
  with _ctx_lock:
    if _context is None:
      _context = ts.Context()
    return _context


def kvstore_spec(item_dir: Any) -> dict:
  """The tensorstore kvstore spec of ``<item_dir>/`` (a local path, ``file://``, ``gs://`` or
  ``s3://``)."""
  d = os.fspath(item_dir).rstrip('/')
  scheme = urls.scheme(d)
  if not scheme:
    return {'driver': 'file', 'path': os.path.abspath(d) + '/'}
  if scheme == 'file':
    return {'driver': 'file', 'path': d[len('file://'):] + '/'}
  spec = urls.bucket_kvstore(d)
  if spec is not None:
    return dict(spec, path=(spec['path'] + '/') if spec['path'] else '')
  return ts.KvStore.Spec(d + '/').to_json()


def _kv(item_dir: Any, attempt: int = 0) -> ts.KvStore:
  """The item's kvstore: through the shared context, or a fresh one for a later attempt."""
  ctx = context() if attempt == 0 else hedge.fresh_context(context(), attempt)
  return ts.KvStore.open(kvstore_spec(item_dir), context=ctx).result()


# How many records ``read_records`` waits on at once (each wait has its deadline).
READ_THREADS = 16


def _request(item_dir: Any, call, *, nbytes: int, what: str, kind: str):
  """``call(kvstore)``'s answer, with a deadline and later attempts (``hedge.run_sync``)."""
  return hedge.run_sync(lambda n: call(_kv(item_dir, n)), nbytes=nbytes, what=what, kind=kind)


def _key(name: str) -> str:
  return f'{records_lib.DIRNAME}/{name}'


def record_path(item_dir: Any, writer: str) -> str:
  return f'{os.fspath(item_dir).rstrip("/")}/{_key(records_lib.writer_filename(writer))}'


def index_path(item_dir: Any) -> str:
  return f'{os.fspath(item_dir).rstrip("/")}/{_key(records_lib.INDEX_FILENAME)}'


def read_counts() -> dict[str, int]:
  """Objects this process has read from ``_pathways/`` since it started, by kind: ``index``,
  ``index_unchanged`` (a cache check: a conditional read that moved no bytes), ``record`` and
  ``list``. A restore of an item with an index reads one ``index`` per call."""
  return dict(_stats)


# ---- write -------------------------------------------------------------------------------------


def write_record(item_dir: Any, record: records_lib.WriterRecord) -> str:
  """Writes one writer's record (one object, never rewritten)."""
  data = records_lib.encode(record)
  key = _key(records_lib.writer_filename(record.writer))
  _request(item_dir, lambda kv: kv.write(key, data), nbytes=len(data), kind='write',
           what=record_path(item_dir, record.writer))
  return record_path(item_dir, record.writer)


def write_index(item_dir: Any, item: item_lib.ItemMetadata) -> str:
  """Writes the item's index (one object). Called once per save, before the commit."""
  data = item_lib.encode_index(item, library_version=version.VERSION)
  _request(item_dir, lambda kv: kv.write(_key(records_lib.INDEX_FILENAME), data),
           nbytes=len(data), kind='write', what=index_path(item_dir))
  return index_path(item_dir)


# ---- read --------------------------------------------------------------------------------------


def list_item(item_dir: Any) -> tuple[list[str], bool]:
  """(keys of the item's writer records, sorted; whether it has an index): one listing."""
  prefix = f'{records_lib.DIRNAME}/'
  key_range = ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord('/') + 1))
  listed = _request(item_dir, lambda kv: kv.list(key_range), nbytes=0, kind='read',
                    what=f'the listing of {os.fspath(item_dir).rstrip("/")}/{prefix}')
  keys = [k.decode() for k in listed]
  _stats['list'] += 1
  index_key = _key(records_lib.INDEX_FILENAME)
  records = sorted(k for k in keys if k.endswith(records_lib.SUFFIX) and k != index_key
                   and '/' not in k[len(prefix):])
  return records, index_key in keys


def read_records(item_dir: Any, keys: Sequence[str] | None = None) -> list[records_lib.WriterRecord]:
  """Every writer record of an item (or those at ``keys``), read concurrently: all reads are
  issued at once and tensorstore bounds how many are in flight (its per-driver concurrency)."""
  keys = list_item(item_dir)[0] if keys is None else list(keys)
  base = os.fspath(item_dir).rstrip('/')

  def read(k: str):
    return _request(item_dir, lambda kv: kv.read(k), nbytes=0, kind='read', what=f'{base}/{k}')

  if len(keys) <= 1:
    results = [read(k) for k in keys]
  else:
    with concurrent.futures.ThreadPoolExecutor(min(READ_THREADS, len(keys))) as pool:
      results = list(pool.map(read, keys))
  out = []
  for k, r in zip(keys, results):
    _stats['record'] += 1
    if r.state != 'value':
      raise FileNotFoundError(f'{base}/{k} disappeared while it was being read')
    out.append(records_lib.decode(r.value, path=f'{base}/{k}'))
  return out


def _cache_key(item_dir: Any) -> str:
  return os.fspath(item_dir).rstrip('/')


def read_index(item_dir: Any) -> item_lib.ItemMetadata | None:
  """The item's index, or None if it has none. Cached per item path: a later call re-reads it
  only if its storage generation changed (a step directory deleted and saved again under the
  same number gets a new generation), and a conditional read moves no bytes otherwise. A
  damaged index raises ``records_lib.DamagedIndexError`` naming it."""
  return _read_index(item_dir, rebuild=False)


def _read_index(item_dir: Any, *, rebuild: bool) -> item_lib.ItemMetadata | None:
  """``read_index``; with ``rebuild``, a damaged index is replaced by the item's records
  (``_rebuilt``), and that is cached under the damaged object's generation like an index."""
  key = _cache_key(item_dir)
  with _cache_lock:
    cached = _cache.get(key)
  index_key, what = _key(records_lib.INDEX_FILENAME), index_path(item_dir)
  if cached is not None:
    generation = cached[0]
    r = _request(item_dir, lambda kv: kv.read(index_key, if_not_equal=generation), nbytes=0,
                 kind='read', what=what)
    if r.state == 'unspecified':  # unchanged since we read it
      _stats['index_unchanged'] += 1
      with _cache_lock:
        _cache.move_to_end(key)
      item = cached[1]
      if item.damaged_index is not None and not rebuild:
        raise records_lib.DamagedIndexError(item.damaged_index)
      return item
  else:
    r = _request(item_dir, lambda kv: kv.read(index_key), nbytes=0, kind='read', what=what)
  if r.state == 'missing':
    with _cache_lock:
      _cache.pop(key, None)
    return None
  _stats['index'] += 1
  try:
    item = item_lib.decode_index(r.value, path=index_path(item_dir))
  except records_lib.DamagedIndexError as e:
    if not rebuild:
      raise
    item = _rebuilt(item_dir, e)
  with _cache_lock:
    _cache[key] = (r.stamp.generation, item)
    _cache.move_to_end(key)
    while len(_cache) > CACHE_ITEMS:
      _cache.popitem(last=False)
  return item


def _rebuilt(item_dir: Any, damage: records_lib.DamagedIndexError) -> item_lib.ItemMetadata:
  """The item from its writer records, for an index that cannot be decoded (the index only
  saves reads: the records hold the same checksums). Logs one warning naming the index (the
  result is cached under the damaged index's generation, so a process says it once). Without
  records (a colocated save writes none) the index's own error stands; a damaged record as
  well names both."""
  try:
    records = read_records(item_dir)
  except records_lib.MetadataError as e:
    raise records_lib.DamagedIndexError(
        f'{damage} The writer records beside it cannot replace it either: {e}') from damage
  if not records:
    raise damage
  log.warning('orbax_pathways: %s Reading the %d writer record(s) beside it instead: the same '
              'checksums, the array data is not affected (deleting the index silences this).',
              damage, len(records))
  return dataclasses.replace(item_lib.merge(records), damaged_index=str(damage))

def cached_index(item_dir: Any) -> item_lib.ItemMetadata | None:
  """The index ``read_index`` last returned for ``item_dir``, without any request (None if not
  cached): for a caller inside the restore that just read it (the tier's source chain)."""
  with _cache_lock:
    cached = _cache.get(_cache_key(item_dir))
  return cached[1] if cached is not None else None


def read_item(item_dir: Any) -> item_lib.ItemMetadata | None:
  """An item's metadata (its index; without one, its writer records merged), or None for an
  item written without orbax-pathways. A damaged index is rebuilt from the records (one
  warning per process; ``ItemMetadata.damaged_index`` says what was wrong); without records
  its ``DamagedIndexError`` is raised."""
  item = _read_index(item_dir, rebuild=True)
  if item is not None:
    return item
  records = read_records(item_dir)
  return item_lib.merge(records) if records else None


def clear_cache() -> None:
  with _cache_lock:
    _cache.clear()
