"""Options of the orbax-pathways ArrayHandler, each with an environment override.

Read once when the handler is built (at ``import orbax_pathways`` for the global one).
"""

from __future__ import annotations

import dataclasses
import os

MiB = 1 << 20


def _env_int(name: str, default: int) -> int:
  raw = os.environ.get(name)
  if raw is None or raw == '':
    return default
  try:
    return int(raw)
  except ValueError:
    raise ValueError(f'{name}={raw!r} must be an integer number of bytes.') from None


def _env_bool(name: str, default: bool) -> bool:
  raw = os.environ.get(name)
  if raw is None or raw == '':
    return default
  return raw.strip().lower() in ('1', 'true', 'yes', 'on')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
  """How the handler plans and moves bytes.

  max_chunk_bytes: upper bound on one stored chunk (``ORBAX_PATHWAYS_MAX_CHUNK_BYTES``, 16 MiB).
    Chunks are cut roughly square inside each shard, so a restore onto another layout decodes
    little beyond what it needs. Stock Orbax stores a whole shard as one chunk.
  max_inflight_bytes: host bytes handed to tensorstore at once while writing
    (``ORBAX_PATHWAYS_MAX_INFLIGHT_BYTES``, 1 GiB): the write-side memory budget on top of the
    device-to-host snapshot.
  coalesce_bytes: an array of at most this many bytes (``ORBAX_PATHWAYS_COALESCE_BYTES``, 1 MiB;
    0 turns it off) is stored as few chunks as the hosts holding it allow (one when a single host
    holds it all) instead of one chunk per shard: biases, norms and counters sharded over many
    devices otherwise cost a chunk write and read each per device. Stock Orbax reads any grid.
  snapshot: how ``save()`` copies device bytes to the host (``ORBAX_PATHWAYS_SNAPSHOT``):
    'pinned' into pinned host memory (``memory_kind='pinned_host'``, one batched transfer at DMA
    speed; the numpy copy for tensorstore then happens in the background write), 'host' through
    ``np.asarray`` (what stock Orbax does; zero-copy on the CPU backend), or 'auto' (default):
    'pinned' on accelerators whose devices offer a pinned_host memory, 'host' on CPU.
  verify_checksums: check each read chunk against the crc32c recorded at save
    (``ORBAX_PATHWAYS_VERIFY``, on).
  replica_parallel: split a shard held on several hosts among them (on).
  transport: 'local', 'colocated' or 'persistence'; None detects (``ORBAX_PATHWAYS_TRANSPORT``).
  divisibility: when elastic restore cannot divide a dimension over the resized mesh axes,
    'replicate' that array along them with a warning, or 'strict' to raise
    (``ORBAX_PATHWAYS_DIVISIBILITY``).
  compression: 'auto' (default; ``ORBAX_PATHWAYS_COMPRESSION``): zstd for integer and bool arrays,
    none for floating-point arrays, whose mantissas barely compress (a few percent) while zstd
    costs about a third of the commit and much of the restore; 'zstd' (what stock Orbax writes,
    also when the checkpoint handler asks for no compression we follow it); 'none'. The choice
    depends only on the dtype, so every host of a multi-host save makes the same one. Either way
    the zarr metadata names the codec, so stock Orbax reads the result.
  gcs_grpc: use tensorstore's ``gcs_grpc`` driver instead of ``gcs`` for array data on gs://
    (``ORBAX_PATHWAYS_GCS_GRPC=1``; off). Same objects on storage; needs a tensorstore build with
    the gRPC driver and real GCS (emulators speak HTTP only).
  storage_retries: retries of one GCS request before a save or restore fails
    (``ORBAX_PATHWAYS_STORAGE_RETRIES``); None keeps tensorstore's default (32, backoff to 32 s).
    Lower it to fail fast when storage is down.
  num_slices: split devices into this many equal slices when devices carry no ``slice_index``
    (``ORBAX_PATHWAYS_NUM_SLICES``; tests and platforms that know their grouping).
  """

  max_chunk_bytes: int = 16 * MiB
  max_inflight_bytes: int = 1024 * MiB
  coalesce_bytes: int = 1 * MiB
  snapshot: str = 'auto'
  verify_checksums: bool = True
  replica_parallel: bool = True
  transport: str | None = None
  divisibility: str = 'replicate'
  compression: str = 'auto'
  gcs_grpc: bool = False
  storage_retries: int | None = None
  num_slices: int | None = None

  def compress(self, dtype, requested: bool) -> bool:
    """Whether to zstd-compress an array of ``dtype`` when the checkpoint handler asks
    ``requested`` (Orbax's ``use_compression``)."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    if not requested or self.compression == 'none':
      return False
    if self.compression == 'zstd':
      return True
    name = np.dtype(dtype).name  # ml_dtypes (bfloat16, float8_*, int4) are numpy kind 'V'
    return not (np.issubdtype(np.dtype(dtype), np.inexact) or name.startswith(('float', 'bfloat')))

  def ts_context_extra(self) -> dict:
    """Tensorstore context resources these options add to Orbax's defaults."""
    if self.storage_retries is None:
      return {}
    return {'gcs_request_retries': {'max_retries': self.storage_retries,
                                    'initial_delay': '0.1s', 'max_delay': '2s'}}

  def __post_init__(self):
    if self.divisibility not in ('replicate', 'strict'):
      raise ValueError(f"divisibility={self.divisibility!r}: use 'replicate' or 'strict'.")
    if self.compression not in ('auto', 'zstd', 'none'):
      raise ValueError(f"compression={self.compression!r}: use 'auto', 'zstd' or 'none'.")
    if self.snapshot not in ('auto', 'pinned', 'host'):
      raise ValueError(f"snapshot={self.snapshot!r}: use 'auto', 'pinned' or 'host'.")
    if self.coalesce_bytes < 0:
      raise ValueError(f'coalesce_bytes={self.coalesce_bytes} must be >= 0 (0 turns it off).')
    if self.max_chunk_bytes < 1:
      raise ValueError(f'max_chunk_bytes={self.max_chunk_bytes} must be positive.')

  @classmethod
  def from_env(cls) -> 'Options':
    slices = os.environ.get('ORBAX_PATHWAYS_NUM_SLICES')
    return cls(
        max_chunk_bytes=_env_int('ORBAX_PATHWAYS_MAX_CHUNK_BYTES', 16 * MiB),
        max_inflight_bytes=_env_int('ORBAX_PATHWAYS_MAX_INFLIGHT_BYTES', 1024 * MiB),
        coalesce_bytes=_env_int('ORBAX_PATHWAYS_COALESCE_BYTES', 1 * MiB),
        snapshot=os.environ.get('ORBAX_PATHWAYS_SNAPSHOT', 'auto'),
        verify_checksums=_env_bool('ORBAX_PATHWAYS_VERIFY', True),
        transport=os.environ.get('ORBAX_PATHWAYS_TRANSPORT') or None,
        divisibility=os.environ.get('ORBAX_PATHWAYS_DIVISIBILITY', 'replicate'),
        compression=os.environ.get('ORBAX_PATHWAYS_COMPRESSION', 'auto'),
        gcs_grpc=_env_bool('ORBAX_PATHWAYS_GCS_GRPC', False),
        num_slices=int(slices) if slices else None,
        storage_retries=(int(os.environ['ORBAX_PATHWAYS_STORAGE_RETRIES'])
                         if os.environ.get('ORBAX_PATHWAYS_STORAGE_RETRIES') else None),
    )
