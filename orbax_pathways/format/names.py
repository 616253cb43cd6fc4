"""The on-disk format in one place: names, chunk keys, the chunk grid, the chunk index, and where
Orbax's tensorstore specs put an array. Pure: no jax and no tensorstore (numpy-free, even).

Who calls it: the save and restore path on every host (through ``storage/``, ``metadata``) and the
``orbax-pathways`` CLI on any machine, so the two cannot drift apart. Every Orbax name here is
checked against Orbax's own constant by ``tests/format/test_format.py``; every key and grid rule against
what tensorstore writes.

A step directory, as Orbax lays it out (``docs/format.md``)::

  <root>/<step>[.orbax-checkpoint-tmp]/    step name: ``<N>`` or ``<prefix>_<N>`` (STEP_NAME_RE)
    _CHECKPOINT_METADATA                   item handlers, commit timestamp
    commit_success.txt                     commit marker (gs://, and Orbax >= 0.12.2 everywhere)
    <item>[.orbax-checkpoint-tmp]/
      _METADATA  _sharding  _strings.json  array_metadatas/process_<i>
      manifest.ocdbt  d/  ocdbt.process_<id>/      (OCDBT: one kvstore rooted at the item)
      <param>/...                                  (no OCDBT: one zarr directory per param)
      _pathways/<writer>.msgpack                   (ours: ``orbax_pathways.format``)
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator, Sequence

from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.format import urls

# ---- Orbax's step directory ------------------------------------------------------------------

TMP_SUFFIX = '.orbax-checkpoint-tmp'  # atomicity_types.TMP_DIR_SUFFIX: uncommitted step or item
COMMIT_SUCCESS_FILE = 'commit_success.txt'  # atomicity_types.COMMIT_SUCCESS_FILE
CHECKPOINT_METADATA_FILE = '_CHECKPOINT_METADATA'  # metadata/checkpoint.py: step metadata

# ---- Orbax's item directory (PyTreeCheckpointHandler) ----------------------------------------

ITEM_METADATA_FILE = '_METADATA'  # format_utils.PYTREE_METADATA_FILE: the tree
SHARDING_FILE = '_sharding'  # urlsafe-b64(param name) -> JSON sharding
STRINGS_FILE = '_strings.json'  # StringHandler: string leaves
ARRAY_METADATAS_DIR = 'array_metadatas'  # array_metadata_store: process_<i> files
OCDBT_MANIFEST_FILE = 'manifest.ocdbt'  # format_utils.OCDBT_MANIFEST_FILE: merged OCDBT root
OCDBT_PROCESS_PREFIX = 'ocdbt.process_'  # ocdbt_process_spec.PROCESS_PREFIX: per-writer database
JAX_ARRAY_VALUE_TYPE = 'jax.Array'  # jax_array_handlers.JAX_ARRAY_TYPE_STR in _METADATA
ARRAY_VALUE_TYPES = frozenset({JAX_ARRAY_VALUE_TYPE, 'np.ndarray', 'scalar'})

# ---- What orbax-pathways adds ----------------------------------------------------------------

PATHWAYS_DIR = '_pathways'  # <item>/_pathways/<writer>.msgpack (metadata.DIRNAME)
# <directory>/.orbax-pathways-local/<step>: a local-only step's Orbax files and records, its
# array bytes in the writers' node-local tiers only (docs/multi_tier.md). A dot name: Orbax's
# step listing, which takes step-number names only, never lists it as a step.
LOCAL_STEPS_DIR = '.orbax-pathways-local'
# In a node's tier directory: the steps each process saves there alone (multitier/node_steps.py).
# A dot name: the tier's entries are under hex keys, and its listing skips dot names.
NODE_STEPS_DIR = '.node-steps'
# Beside a node step's items: the processes that saved the step, by device (``node_layout``).
NODE_PROCESSES_FILE = '_node_processes.msgpack'


def is_node_step(path: object) -> bool:
  """Whether ``path`` is in a node's directory of node steps (``NODE_STEPS_DIR``)."""
  return NODE_STEPS_DIR in str(path).split('/')


def is_local_only(item_dir: object) -> bool:
  """Whether ``item_dir`` (an item of a step) is an item of a local-only step."""
  parts = str(item_dir).rstrip('/').split('/')
  return len(parts) >= 3 and parts[-3] == LOCAL_STEPS_DIR
PATHWAYS_SUFFIX = '.msgpack'  # metadata.SUFFIX
# The colocated transport's writers are named w<cpu device id>: their OCDBT databases are
# ``ocdbt.process_w<id>/``, a name stock Orbax never writes (its process ids are integers).
# A write retried past its deadline goes to ``<database>retry<n>`` (storage/writer.retry_spec).
COLOCATED_OCDBT_RE = re.compile(re.escape(OCDBT_PROCESS_PREFIX) + r'w\d+(retry\d+)?$')
# Writer records of these transports carry the sharding but no chunk checksums (the Pathways
# persistence plugin computes none): their arrays verify by decoding only.
CHECKSUMLESS_TRANSPORTS = frozenset({'persistence'})
# The in-process transport's name in writer records: the name it had when the format was set
# (``Options.transport`` calls it 'in_process').
IN_PROCESS_RECORD = 'local'

# ---- Step names ------------------------------------------------------------------------------

STEP_NAME_RE = re.compile(
    r'^(?:(?P<prefix>.+)_)?(?P<step>\d+)(?P<tmp>' + re.escape(TMP_SUFFIX) + r'.*)?$')


def parse_step_name(name: str) -> tuple[int, bool] | None:
  """'12' -> (12, False); 'ckpt_0012.orbax-checkpoint-tmp' -> (12, True); not a step -> None."""
  m = STEP_NAME_RE.match(name)
  if not m:
    return None
  return int(m.group('step')), m.group('tmp') is not None


def step_of(name: str) -> int | None:
  """The step number of a step directory name ('12', 'ckpt_12', '12.orbax-checkpoint-tmp'), or
  None; the engine files each save's and restore's stats under it."""
  parsed = parse_step_name(name)
  return parsed[0] if parsed else None


def is_tmp(name: str) -> bool:
  """A step or item directory name that Orbax has not committed (renamed) yet."""
  return TMP_SUFFIX in name


def final_name(name: str) -> str:
  """The committed name of a step or item directory ('default.orbax-checkpoint-tmp' -> 'default')."""
  return name.split(TMP_SUFFIX)[0]


# ---- Chunks ----------------------------------------------------------------------------------


def chunk_origins(shape: Sequence[int], chunk_shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
  """Origins of the regular chunk grid over ``shape`` in C order (one empty origin for a scalar,
  none for a zero-size array). The grid is ``plan.boxes.chunk_grid``, the one the writer uses."""
  chunk = [max(1, int(c)) for c in chunk_shape]
  for box in boxes_lib.chunk_grid(boxes_lib.Box.full(shape), chunk):
    yield box.start


def chunk_region(origin: Sequence[int], chunk_shape: Sequence[int],
                 shape: Sequence[int]) -> boxes_lib.Box:
  """The chunk at ``origin``, clipped to the array bounds (what its checksum covers)."""
  start = tuple(int(o) for o in origin)
  stop = tuple(o + max(1, int(c)) for o, c in zip(start, chunk_shape))
  return boxes_lib.clip(boxes_lib.Box(start, stop), shape)


def chunk_key(origin: Sequence[int], chunk_shape: Sequence[int], *, zarr3: bool) -> str:
  """The zarr key of the chunk at ``origin``, relative to the array, as tensorstore names it with
  Orbax's specs: zarr v2 ``'1.0'`` ('.' separator; ``'0'`` for a scalar), zarr3 ``'c/1/0'``
  (default encoding; ``'c'`` for a scalar)."""
  idx = [str(int(o) // max(1, int(c))) for o, c in zip(origin, chunk_shape)]
  if zarr3:
    return '/'.join(['c', *idx])
  return '.'.join(idx) if idx else '0'


def param_chunk_key(param: str, origin: Sequence[int], chunk_shape: Sequence[int], *,
                    zarr3: bool) -> str:
  """The chunk's key inside the item: its OCDBT key, or its file path below the item directory."""
  return f'{param}/{chunk_key(origin, chunk_shape, zarr3=zarr3)}'


# ---- Where Orbax's tensorstore specs put an array (tensorstore_utils.build_kvstore_tspec) ----


def _normalize(path: str) -> str:
  return os.path.normpath(os.fspath(path)).replace('gs:/', 'gs://')


_REMOTE_READ_COALESCING = {
    'experimental_read_coalescing_threshold_bytes': 1000000,
    'experimental_read_coalescing_merged_bytes': 500000000000,
    'experimental_read_coalescing_interval': '1ms',
}


def kvstore_spec(item_dir: str, param: str, *, ocdbt: bool, gcs_driver: str = 'gcs') -> dict[str, Any]:
  """Where param ``param`` of the item at ``item_dir`` lives, for reading.

  OCDBT: one database rooted at the item directory (the merged ``manifest.ocdbt``), the param a
  key prefix inside it. Otherwise: the zarr directory ``<item>/<param>``. ``gs://`` paths use
  tensorstore's ``gcs`` driver (``gcs_driver``: Orbax reads ``TENSORSTORE_GCS_BACKEND``), others
  ``file`` (absolute paths: OCDBT requires them). Orbax's write-only settings (per-writer
  ``ocdbt.process_<id>`` base, file locking, OCDBT config) are not part of a read spec.
  """
  directory = _normalize(item_dir)
  # gs:// only: Orbax's read specs name no other bucket scheme.
  bucket = urls.bucket_kvstore(directory, gcs_driver=gcs_driver) if urls.is_gcs(directory) else None
  if ocdbt:
    base = bucket if bucket is not None else {'driver': 'file', 'path': directory + '/'}
    spec: dict[str, Any] = {'driver': 'ocdbt', 'base': base, 'path': param,
                            'cache_pool': 'cache_pool#ocdbt'}
    if bucket is not None:  # Orbax merges adjacent reads on remote storage.
      spec.update(_REMOTE_READ_COALESCING)
    return spec
  path = f'{directory}/{param}'
  zarr_bucket = urls.bucket_kvstore(path, gcs_driver=gcs_driver) if bucket is not None else None
  if zarr_bucket is not None:
    return zarr_bucket
  return {'driver': 'file', 'path': path}


def array_read_spec(item_dir: str, param: str, *, ocdbt: bool, zarr3: bool,
                    raise_missing_chunks: bool = True, gcs_driver: str = 'gcs') -> dict[str, Any]:
  """Orbax's read spec of one saved array (``tensorstore_utils.ArrayReadSpec``).

  ``raise_missing_chunks``: Orbax stores chunks equal to the fill value
  (``store_array_data_equal_to_fill_value`` in ``_METADATA``), so a missing chunk is an error.
  """
  return {
      'driver': 'zarr3' if zarr3 else 'zarr',
      'kvstore': kvstore_spec(item_dir, param, ocdbt=ocdbt, gcs_driver=gcs_driver),
      'recheck_cached_data': False,
      'recheck_cached_metadata': False,
      'fill_missing_data_reads': not raise_missing_chunks,
  }
