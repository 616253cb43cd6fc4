"""What the CLI knows about a checkpoint, as plain dataclasses: steps, items, leaves, shardings.

Filled by ``cli.steps`` (directory and JSON metadata) and ``cli.arrays`` (zarr metadata through
tensorstore); read by ``verify``, ``diff``, ``du`` and ``render``. No I/O here.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Any, Mapping, Sequence

import numpy as np

from orbax_pathways.format import names as fmt
from orbax_pathways.format import grid as grid_lib
from orbax_pathways.format import item as item_lib
from orbax_pathways.format import records as records_lib

COMPLETE, PARTIAL, CORRUPT = 'complete', 'partial', 'corrupt'  # Step.state
CHECKSUM, DECODE = 'checksum', 'decode'  # how verify checks an item
# Why verify leaves a local-only step's jax.Array chunks unchecked (render counts them apart).
LOCAL_ONLY = ('a local-only step: its chunks are in the node-local tiers of the hosts that wrote '
              'them, not in storage (on each node, `orbax-pathways tier` checks them against '
              'these records)')
# Why diff cannot read a local-only step's jax.Array values (its checksums may still decide).
TIER_ONLY = "a local-only step's array bytes are in the node-local tiers, not in storage"


@dataclasses.dataclass(frozen=True)
class Sharding:
  """How a leaf was sharded at save time, from our metadata ('pathways') or Orbax's ``_sharding``."""

  source: str
  kind: str
  mesh_shape: tuple[int, ...] = ()
  axis_names: tuple[str, ...] = ()
  spec: tuple[Any, ...] = ()
  device_ids: tuple[int, ...] = ()
  num_slices: int | None = None
  slice_axes: tuple[str, ...] = ()
  device: str | None = None

  def describe(self) -> str:
    if self.kind == 'named':
      mesh = ', '.join(f'{a}={n}' for a, n in zip(self.axis_names, self.mesh_shape))
      out = f'mesh({mesh}) {format_spec(self.spec)}'
      if self.num_slices and self.num_slices > 1:
        out += f' slices={self.num_slices}'
      return out
    if self.kind == 'single_device':
      return f'single device {self.device}' if self.device else 'single device'
    return self.kind

  def key(self) -> tuple[Any, ...]:
    """What `diff` compares: layout, not where the metadata came from."""
    return (self.kind, self.mesh_shape, self.axis_names, _norm_spec(self.spec))

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d['spec'] = [list(p) if isinstance(p, tuple) else p for p in self.spec]
    d['description'] = self.describe()
    return d


@dataclasses.dataclass
class Leaf:
  """One leaf of an item's tree. Array fields stay None until the zarr metadata is opened."""

  key: str  # Orbax param name: keypath joined with '.'; also the zarr path inside the item.
  keypath: tuple[str, ...]
  value_type: str
  write_shape: tuple[int, ...] | None = None
  dtype: str | None = None
  shape: tuple[int, ...] | None = None
  chunk_shape: tuple[int, ...] | None = None
  sharding: Sharding | None = None
  record: records_lib.ArrayRecord | None = None
  error: str | None = None  # Why the zarr metadata could not be read.

  @property
  def is_array(self) -> bool:
    return self.value_type in fmt.ARRAY_VALUE_TYPES or self.write_shape is not None

  @property
  def is_jax_array(self) -> bool:
    """Saved by the jax.Array handler: ours when orbax-pathways was installed."""
    return self.value_type == fmt.JAX_ARRAY_VALUE_TYPE

  @property
  def nbytes(self) -> int | None:
    """Logical bytes: itemsize * prod(shape)."""
    if self.dtype is None or self.shape is None:
      return None
    return np_dtype(self.dtype).itemsize * math.prod(self.shape)

  @property
  def chunks(self) -> Mapping[tuple[int, ...], records_lib.ChunkRecord]:
    """Origin -> recorded chunk (empty without our metadata)."""
    return grid_lib.chunk_index([self.record]) if self.record is not None else {}

  @property
  def chunk_nbytes(self) -> int | None:
    """Raw bytes of the chunks our writers recorded (None without our metadata)."""
    if self.record is None:
      return None
    return sum(c.nbytes for c in self.chunks.values())


@dataclasses.dataclass
class Item:
  """One item (``<step>/<name>``) of a step."""

  name: str
  path: Any  # epath.Path
  kind: str  # 'pytree' (has _METADATA) or 'other'.
  handler: str | None = None
  use_ocdbt: bool = False
  use_zarr3: bool = False
  store_fill: bool = True
  tree_error: str | None = None  # _METADATA present but unreadable: leaves unknown.
  leaves: list[Leaf] = dataclasses.field(default_factory=list)
  pathways: item_lib.ItemMetadata | None = None
  problems: list[str] = dataclasses.field(default_factory=list)

  def in_tiers_only(self, leaf: Leaf) -> bool:
    """Whether ``leaf``'s bytes are in node-local tiers, not here: a jax.Array of an item of a
    local-only step (``DIR/.orbax-pathways-local/N``); only its records are on storage."""
    return leaf.is_jax_array and fmt.is_local_only(self.path)

  @property
  def arrays(self) -> list[Leaf]:
    return [l for l in self.leaves if l.is_array]

  @property
  def transports(self) -> list[str]:
    return sorted(self.pathways.transports()) if self.pathways else []

  @property
  def writer(self) -> str:
    return ', '.join(self.transports) if self.pathways else 'stock orbax'

  @property
  def checksumless(self) -> set[str]:
    """Arrays whose only records come from transports that record no checksums (persistence)."""
    if self.pathways is None:
      return set()
    if self.pathways.source == 'index':  # one merged record per array: no chunks, no checksums
      if not self.pathways.transports() & fmt.CHECKSUMLESS_TRANSPORTS:
        return set()
      return {name for name, a in self.pathways.arrays().items() if not a.chunks}
    with_crc: set[str] = set()
    without: set[str] = set()
    for w in self.pathways.writers:
      names = {a.name for a in w.arrays}
      (without if w.transport in fmt.CHECKSUMLESS_TRANSPORTS else with_crc).update(names)
    return without - with_crc


@dataclasses.dataclass
class Step:
  """One step directory and its state."""

  path: Any  # epath.Path
  name: str
  step: int | None
  state: str
  problems: list[str] = dataclasses.field(default_factory=list)
  commit_ns: int | None = None
  items: list[Item] = dataclasses.field(default_factory=list)
  bytes: int | None = None

  @property
  def tmp(self) -> bool:
    return fmt.is_tmp(self.name)

  @property
  def commit_time(self) -> str | None:
    return format_ns(self.commit_ns)

  @property
  def num_arrays(self) -> int | None:
    if not any(i.kind == 'pytree' for i in self.items):
      return None
    return sum(len(i.arrays) for i in self.items)

  def saved_with(self) -> tuple[int | None, int | None]:
    """(slice count, device count) from our sharding records; None when absent."""
    slices, seen = 0, False
    devices: set[int] = set()
    for item in self.items:
      for leaf in item.leaves:
        s = leaf.sharding
        if s is None or s.source != 'pathways':
          continue
        seen = True
        slices = max(slices, s.num_slices or 1)
        devices.update(s.device_ids)
    if not seen:
      return None, None
    return slices, (len(devices) or None)


# ----------------------------------------------------------------------------------------------


def format_ns(ns: int | None) -> str | None:
  if ns is None:
    return None
  t = datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.timezone.utc)
  return t.strftime('%Y-%m-%dT%H:%M:%SZ')


def np_dtype(name: str) -> np.dtype:
  try:
    return np.dtype(name)
  except TypeError:
    import ml_dtypes  # pylint: disable=g-import-not-at-top  # bfloat16, float8_*, int4.

    return np.dtype(getattr(ml_dtypes, name))


def _norm_spec(spec: Sequence[Any]) -> tuple[Any, ...]:
  out = []
  for p in spec:
    if isinstance(p, (list, tuple)):
      p = tuple(p)
      p = p[0] if len(p) == 1 else p
    out.append(p)
  while out and out[-1] is None:  # P('x', None) == P('x').
    out.pop()
  return tuple(out)


def format_spec(spec: Sequence[Any]) -> str:
  def one(p):
    if p is None:
      return 'None'
    if isinstance(p, (list, tuple)):
      return '(' + ', '.join(repr(x) for x in p) + (',)' if len(p) == 1 else ')')
    return repr(p)

  return 'P(' + ', '.join(one(p) for p in spec) + ')'
