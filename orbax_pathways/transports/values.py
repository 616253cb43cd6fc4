"""The values that cross the engine's boundaries: small, frozen and picklable.

Front doors (the Orbax v0 TypeHandler, the v1 LeafHandler) convert Orbax's ``ParamInfo`` /
``SaveArgs`` / ``RestoreArgs`` into these once; the engine and the transports see nothing else.
Transports ship them to worker hosts (colocated Python pickles them), so they hold no jax arrays,
no Orbax objects and no tensorstore contexts (a restore target's ``jax.sharding`` pickles).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import numpy as np

from orbax_pathways.format import records as records_lib
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import restore as restore_plan
from orbax_pathways.plan import save as save_plan

Box = boxes_lib.Box


@dataclasses.dataclass(frozen=True)
class Item:
  """One checkpoint item's directory and how Orbax encodes its arrays (same for every leaf of a
  save or restore call).

  ``directory`` is the item directory as a string (local path or ``gs://``); during a save it
  may be Orbax's temporary path. ``context_extra`` are tensorstore context resources our options
  add to Orbax's defaults (GCS retries).
  """

  directory: str
  use_ocdbt: bool = True
  use_zarr3: bool = False
  ocdbt_target_data_file_size: int | None = None
  gcs_grpc: bool = False
  context_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  raise_array_data_missing_error: bool = True
  metadata_key: str | None = None  # Orbax's name for the zarr metadata file (None: default)

  def path_of(self, name: str) -> str:
    """The array's location for messages (its zarr directory, or its key in the OCDBT item)."""
    return f'{self.directory.rstrip("/")}/{name}'


@dataclasses.dataclass(frozen=True)
class PlanSettings:
  """How a save is planned, the same on every host of it (picklable, shipped to workers).

  ``replica_parallel``: split a shard held by several hosts among them (Orbax's
  ``use_replica_parallel`` and ours), into at most ``max_replicas`` pieces (Orbax's
  ``max_replicas_for_replica_parallel``), each of at least ``min_split_bytes`` (Orbax's
  ``min_slice_bytes_for_replica_parallel``; ours is 1 MiB). ``coalesce_bytes``: small arrays as
  one chunk per host (``Options.coalesce_bytes``; 0 for transports that write whole shards).
  """

  replica_parallel: bool = True
  coalesce_bytes: int = 0
  min_split_bytes: int | None = None
  max_replicas: int | None = None


@dataclasses.dataclass(frozen=True)
class SaveLeaf:
  """One array to save, as the engine sees it (its bytes stay on the devices).

  ``dtype`` is the dtype of the array handed to the transport (a PRNG key's key data);
  ``stored_dtype`` what goes to storage (``SaveArgs.dtype`` casts). ``ext_metadata`` is Orbax's
  per-array extension (the PRNG key implementation). ``sharding`` is recorded by the primary
  writer for elastic restore and the CLI. ``max_chunk_bytes`` caps the chunk size
  (``SaveArgs.chunk_byte_size``, else ``Options.max_chunk_bytes``).
  """

  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  stored_dtype: np.dtype
  compress: bool
  max_chunk_bytes: int
  sharding: records_lib.ShardingRecord | None = None
  ext_metadata: Mapping[str, Any] | None = None
  split_axes: tuple[int, ...] | None = None  # chunk only along these axes (SaveArgs.shard_axes)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """How one leaf is laid out on storage: the first write's shape (Orbax's ``write_shape``)
  and the chunk grid. Returned by the engine so front doors fill Orbax's metadata."""

  write_shape: tuple[int, ...]
  chunk_shape: tuple[int, ...]

  @classmethod
  def of(cls, leaf: SaveLeaf, plan: save_plan.ArrayWritePlan) -> 'LeafLayout':
    write_shape = plan.writes[0].box.shape if plan.writes else leaf.shape
    return cls(tuple(write_shape), tuple(plan.chunk_shape))


@dataclasses.dataclass(frozen=True)
class WriterOutcome:
  """What one writer host did in one save (returned to the controller; a few integers)."""

  writer: str
  bytes_written: int
  chunks_written: int


@dataclasses.dataclass(frozen=True)
class ReadTarget:
  """One array to read, resolved against storage: what to open, its chunking and checksums,
  and the boxes of the global array that the target's devices need.

  ``sharding`` is the target ``jax.sharding.Sharding`` (picklable); ``needed`` are the distinct
  boxes the *reading* host needs (the controller's own devices for the in-process transport; each
  worker recomputes its own for colocated reads).
  """

  name: str
  path: str
  tspec: Mapping[str, Any]
  shape: tuple[int, ...]
  dtype: np.dtype
  chunk_shape: tuple[int, ...] | None
  chunks: Mapping[tuple[int, ...], records_lib.ChunkRecord]
  sharding: Any
  stored_shape: tuple[int, ...] | None = None  # differs from ``shape`` only when padding/truncating
  require_checksums: bool = False  # written with checksums: every chunk must have a record
  stored_dtype: str | None = None  # the committed record's (None: no record)

  @property
  def shape_on_storage(self) -> tuple[int, ...]:
    return tuple(self.stored_shape) if self.stored_shape is not None else tuple(self.shape)


@dataclasses.dataclass(frozen=True)
class ReadOutcome:
  """What one reading host did (bytes decoded from storage, chunks whose crc32c it checked)."""

  reader: str
  bytes_read: int
  chunks_verified: int
  bytes_needed: int = 0
  # Per source of the chain ('local', 'peer', 'relay', 'storage'): bytes, and seconds summed over
  # concurrent reads. Empty where the transport reads storage only without counting.
  bytes_by_source: Mapping[str, int] = dataclasses.field(default_factory=dict)
  seconds_by_source: Mapping[str, float] = dataclasses.field(default_factory=dict)


@functools.lru_cache(maxsize=4096)
def _cached_read_plan(shape, chunk_shape, needed) -> restore_plan.ArrayReadPlan:
  return restore_plan.plan_array_reads(shape, chunk_shape, list(needed))


def read_plan(target: ReadTarget, needed: list[Box]) -> restore_plan.ArrayReadPlan:
  """The chunk-aligned regions of the stored array a host reads to fill ``needed`` (boxes in
  storage coordinates; pure; cached: a job restores the same layouts again and again)."""
  chunk_shape = tuple(target.chunk_shape) if target.chunk_shape else None
  return _cached_read_plan(target.shape_on_storage, chunk_shape, tuple(needed))
