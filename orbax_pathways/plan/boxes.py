"""Pure box arithmetic over integer index spaces: no jax, no I/O.

A ``Box`` is a half-open hyper-rectangle ``[start, stop)`` per dimension. Everything that decides
who writes or reads which bytes is expressed in boxes so that it can be unit-tested with integers.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Iterator, Sequence


@dataclasses.dataclass(frozen=True, order=True)
class Box:
  start: tuple[int, ...]
  stop: tuple[int, ...]

  @classmethod
  def full(cls, shape: Sequence[int]) -> 'Box':
    return cls(tuple(0 for _ in shape), tuple(int(d) for d in shape))

  @classmethod
  def from_slices(cls, index: Sequence[slice], shape: Sequence[int]) -> 'Box':
    """From a JAX ``devices_indices_map`` entry (slices with None meaning 'whole dimension')."""
    start, stop = [], []
    for s, d in zip(index, shape):
      a, b, step = s.indices(d)
      if step != 1:
        raise ValueError(f'strided shard index {s} is not supported')
      start.append(a)
      stop.append(b)
    return cls(tuple(start), tuple(stop))

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(self.start, self.stop))

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def ndim(self) -> int:
    return len(self.start)

  def is_empty(self) -> bool:
    return any(b <= a for a, b in zip(self.start, self.stop))

  def intersect(self, other: 'Box') -> 'Box | None':
    start = tuple(max(a, c) for a, c in zip(self.start, other.start))
    stop = tuple(min(b, d) for b, d in zip(self.stop, other.stop))
    box = Box(start, stop)
    return None if box.is_empty() and self.ndim else box

  def contains(self, other: 'Box') -> bool:
    return all(a <= c and d <= b for a, b, c, d in zip(self.start, self.stop, other.start, other.stop))

  def relative_to(self, outer: 'Box') -> tuple[slice, ...]:
    """Slices selecting this box inside a buffer that holds ``outer``."""
    return tuple(slice(a - o, b - o) for a, b, o in zip(self.start, self.stop, outer.start))

  def to_slices(self) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in zip(self.start, self.stop))


def divisors(n: int) -> list[int]:
  """Sorted divisors of ``n`` (O(sqrt n) once per ``n``)."""
  return list(_divisors(n))


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return tuple(sorted(set(small + [n // d for d in small])))


def choose_chunk_shape(write_shape: Sequence[int], itemsize: int, max_bytes: int, *,
                       max_aspect: int = 4, min_bytes: int = 64 * 1024,
                       split_axes: Sequence[int] | None = None) -> tuple[int, ...]:
  """The chunk shape used for one array (see ``_choose_chunk_shape``; cached: arrays of one
  model share a handful of piece shapes)."""
  return _choose_chunk_shape(tuple(int(d) for d in write_shape), int(itemsize), int(max_bytes),
                             int(max_aspect), int(min_bytes),
                             tuple(int(a) for a in split_axes) if split_axes else None)


@functools.lru_cache(maxsize=4096)
def _choose_chunk_shape(write_shape: tuple[int, ...], itemsize: int, max_bytes: int,
                        max_aspect: int, min_bytes: int,
                        split_axes: tuple[int, ...] | None = None) -> tuple[int, ...]:
  """The chunk shape used for one array: divides ``write_shape`` and is at most ``max_bytes``.

  Unlike splitting only the sharded dimension, this halves (to the next divisor) whichever
  dimension of the current chunk is largest, so chunks stay roughly square. A later restore
  that slices the array along any axis then decodes at most about one chunk-width of extra data
  per boundary instead of whole full-width slabs. That holds for shards already under
  ``max_bytes`` too: a chunk more than ``max_aspect`` times longer on one side than on another
  keeps halving its longest side while it is larger than ``min_bytes``.
  Zero-size dimensions become 1 (zarr rejects 0). ``split_axes`` (Orbax's ``SaveArgs.shard_axes``)
  restricts the splitting to those dimensions; a chunk that cannot shrink further along them
  stays larger than ``max_bytes``, as with Orbax.
  """
  shape = [max(1, int(d)) for d in write_shape]
  if not shape:
    return ()
  chunk = list(shape)

  def elongated() -> bool:
    sides = [c for c in chunk if c > 1]
    return len(sides) > 1 and max(sides) > max_aspect * min(sides)

  while True:
    nbytes = math.prod(chunk) * itemsize
    allowed = [i for i in range(len(chunk)) if split_axes is None or i in split_axes]
    if nbytes > max_bytes:
      order = sorted(allowed, key=lambda i: -chunk[i])
    elif nbytes > min_bytes and elongated() and split_axes is None:
      order = [max(range(len(chunk)), key=lambda i: chunk[i])]  # only the longest side
    else:
      break
    for i in order:
      smaller = [d for d in _divisors(shape[i]) if d < chunk[i]]
      if smaller:
        # The largest divisor of the write shape not above half the current chunk.
        half = [d for d in smaller if d <= chunk[i] // 2] or smaller[:1]
        chunk[i] = half[-1]
        break
    else:
      break  # Nothing left to split.
  return tuple(chunk)


def chunk_grid(box: Box, chunk_shape: Sequence[int]) -> Iterator[Box]:
  """The chunks (aligned to a global grid of ``chunk_shape``) that intersect ``box``, clipped
  to the grid cell, not to the box. Callers intersect when they need the overlap."""
  if box.ndim == 0:
    yield box
    return
  ranges = []
  for a, b, c in zip(box.start, box.stop, chunk_shape):
    first, last = a // c, (b - 1) // c
    ranges.append(range(first, last + 1))
  for idx in itertools.product(*ranges):
    start = tuple(i * c for i, c in zip(idx, chunk_shape))
    stop = tuple(s + c for s, c in zip(start, chunk_shape))
    yield Box(start, stop)


def clip(box: Box, shape: Sequence[int]) -> Box:
  return Box(box.start, tuple(min(b, d) for b, d in zip(box.stop, shape)))
