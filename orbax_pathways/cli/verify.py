"""``orbax-pathways verify``: read every chunk of every array of a step and check it.

Per item, two modes:
  checksum     our ``_pathways`` metadata is present: every recorded chunk region (origin +
               chunk_shape, clipped to the array) is read in the stored dtype and its crc32c
               (of ``np.ascontiguousarray(chunk).tobytes()``) compared with the recorded one.
               Chunks of the grid that no writer recorded are reported too.
  decode       stock Orbax: every chunk of the zarr write-chunk grid is read and decoded. Orbax
               stores every chunk (``store_array_data_equal_to_fill_value``), so a missing chunk
               is an error, not zeros.
Metadata is checked in both modes: ``_CHECKPOINT_METADATA``, commit marker, ``_METADATA``,
``_sharding``, ``array_metadatas/*``, ``_strings.json``, zarr metadata, our msgpack files.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import sys
import time
from typing import Any, Iterable, TextIO

import numpy as np

from orbax_pathways import checksum
from orbax_pathways import metadata as pw_metadata
from orbax_pathways.cli import arrays
from orbax_pathways.cli import inspect

CHECKSUM, DECODE = 'checksum', 'decode'


@dataclasses.dataclass(frozen=True)
class Problem:
  """One failed check. ``origin`` is set for a bad chunk, None for array- or file-level problems."""

  kind: str  # crc_mismatch | read_error | open_error | missing_record | metadata | not_committed
  path: str
  item: str | None = None
  array: str | None = None
  origin: tuple[int, ...] | None = None
  expected_crc32c: int | None = None
  found_crc32c: int | None = None
  error: str | None = None

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d['origin'] = list(self.origin) if self.origin is not None else None
    return d

  def describe(self) -> str:
    where = ' '.join(
        x for x in (self.item, self.array, None if self.origin is None else f'chunk {self.origin}')
        if x
    )
    if self.kind == 'crc_mismatch':
      what = f'crc32c expected {self.expected_crc32c:#010x}, found {self.found_crc32c:#010x}'
    else:
      what = self.error or ''
    return f'{self.kind:<14} {where + "  " if where else ""}{self.path}\n{"":15}{what}'


@dataclasses.dataclass
class Report:
  path: str
  step: int | None
  state: str
  modes: dict[str, str] = dataclasses.field(default_factory=dict)  # item -> checksum | decode
  arrays: int = 0
  chunks: int = 0
  chunks_checksummed: int = 0
  bytes_read: int = 0
  seconds: float = 0.0
  problems: list[Problem] = dataclasses.field(default_factory=list)

  @property
  def ok(self) -> bool:
    return not self.problems

  def to_json(self) -> dict[str, Any]:
    return {
        'path': self.path, 'step': self.step, 'state': self.state, 'ok': self.ok,
        'modes': self.modes, 'arrays': self.arrays, 'chunks': self.chunks,
        'chunks_checksummed': self.chunks_checksummed, 'bytes_read': self.bytes_read,
        'seconds': round(self.seconds, 3), 'problems': [p.to_json() for p in self.problems],
    }


@dataclasses.dataclass(frozen=True)
class _Task:
  item: inspect.Item
  leaf: inspect.Leaf
  store: Any
  origin: tuple[int, ...]
  chunk_shape: tuple[int, ...]
  expected: pw_metadata.ChunkRecord | None

  @property
  def nbytes(self) -> int:
    box = arrays.chunk_box(self.origin, self.chunk_shape, self.leaf.shape)
    return math.prod(s.stop - s.start for s in box) * self.store.dtype.numpy_dtype.itemsize


class Progress:
  """A one-line progress bar with throughput on a stream (stderr); silent when disabled."""

  def __init__(self, total_bytes: int, total_chunks: int, *, stream: TextIO, enabled: bool):
    self.total_bytes, self.total_chunks = total_bytes, total_chunks
    self.stream, self.enabled = stream, enabled
    self.bytes = self.chunks = 0
    self.start = self._last = time.monotonic()

  def advance(self, nbytes: int) -> None:
    self.bytes += nbytes
    self.chunks += 1
    now = time.monotonic()
    if self.enabled and now - self._last > 0.1:
      self._last = now
      self.stream.write('\r' + self.line())
      self.stream.flush()

  def line(self) -> str:
    elapsed = max(time.monotonic() - self.start, 1e-9)
    frac = self.bytes / self.total_bytes if self.total_bytes else 1.0
    bar = '#' * int(frac * 24)
    return (
        f'verify [{bar:<24}] {frac:4.0%} {human_bytes(self.bytes)}/{human_bytes(self.total_bytes)}'
        f' {human_bytes(self.bytes / elapsed)}/s chunks {self.chunks}/{self.total_chunks}'
    )

  def close(self) -> None:
    if self.enabled:
      self.stream.write('\r' + self.line() + '\n')
      self.stream.flush()


def human_bytes(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024
  raise AssertionError


def crc32c(a: np.ndarray) -> int:
  """The same checksum the writer recorded (``orbax_pathways.checksum``)."""
  return checksum.of_array(a)


# ----------------------------------------------------------------------------------------------


def verify_step(
    step_dir, *, progress_stream: TextIO | None = None, progress: bool | None = None,
    window: int = 16, window_bytes: int = 512 << 20,
) -> Report:
  """Checks one step; returns a Report whose ``problems`` is empty only when everything passed."""
  t0 = time.monotonic()
  step = inspect.read_step(step_dir)
  report = Report(path=str(step.path), step=step.step, state=step.state)
  report.problems += _step_problems(step)
  tasks: list[_Task] = []
  for item in step.items:
    if item.kind != 'pytree' or not item.leaves:
      continue
    report.modes[item.name] = CHECKSUM if item.pathways is not None else DECODE
    report.problems += _file_problems(item)
    tasks += _item_tasks(item, report)
  stream = progress_stream or sys.stderr
  enabled = stream.isatty() if progress is None else progress
  bar = Progress(sum(t.nbytes for t in tasks), len(tasks), stream=stream, enabled=enabled)
  _run(tasks, report, bar, window=window, window_bytes=window_bytes)
  bar.close()
  report.seconds = time.monotonic() - t0
  return report


def _step_problems(step: inspect.Step) -> list[Problem]:
  out = [Problem('metadata', path=str(step.path), error=p) for p in step.problems
         if not p.startswith('no commit marker')]
  if step.state == inspect.PARTIAL:
    out.append(Problem(
        'not_committed', path=str(step.path),
        error='step was never committed (temporary name or no commit marker); '
        'it is an interrupted save and restore ignores it',
    ))
  return out


def _file_problems(item: inspect.Item) -> list[Problem]:
  """Orbax metadata files beside the arrays: must parse; string leaves must be present."""
  out = []
  am = item.path / 'array_metadatas'
  if am.exists():
    for p in sorted(am.iterdir(), key=lambda p: p.name):
      try:
        json.loads(p.read_text())
      except ValueError as e:
        out.append(Problem('metadata', path=str(p), item=item.name, error=f'unreadable: {e}'))
  strings = [l.key for l in item.leaves if l.value_type == 'string']
  if strings:
    p = item.path / inspect.STRINGS_FILE
    try:
      values = json.loads(p.read_text())
      missing = [s for s in strings if s not in values]
      if missing:
        out.append(Problem('metadata', path=str(p), item=item.name,
                           error=f'string leaves missing: {", ".join(missing)}'))
    except (OSError, ValueError) as e:
      out.append(Problem('metadata', path=str(p), item=item.name, error=arrays.first_line(e)))
  return out


def _item_tasks(item: inspect.Item, report: Report) -> list[_Task]:
  opened = [(leaf, arrays.open_array(item, leaf)) for leaf in item.arrays]
  tasks = []
  for leaf, fut in opened:
    location = arrays.kvstore_location(item, leaf)
    try:
      store = fut.result()
    except Exception as e:  # pylint: disable=broad-except
      report.problems.append(Problem('open_error', path=location, item=item.name,
                                     array=leaf.key, error=arrays.first_line(e)))
      continue
    report.arrays += 1
    leaf.dtype, leaf.shape = store.dtype.name, tuple(int(n) for n in store.shape)
    leaf.chunk_shape = arrays.write_chunk_shape(store)
    if leaf.record is None:
      tasks += [_Task(item, leaf, store, o, leaf.chunk_shape, None)
                for o in arrays.chunk_origins(leaf.shape, leaf.chunk_shape)]
    else:
      tasks += _record_tasks(item, leaf, store, report)
  return tasks


def _record_tasks(item, leaf, store, report: Report) -> list[_Task]:
  """Chunks our metadata recorded for ``leaf``, after checking the record against the zarr array."""
  rec = leaf.record
  where = dict(path=str(item.path / pw_metadata.DIRNAME), item=item.name, array=leaf.key)
  mismatch = []
  if inspect.np_dtype(rec.dtype) != store.dtype.numpy_dtype:
    mismatch.append(f'dtype {rec.dtype} recorded, {leaf.dtype} stored')
  if tuple(rec.shape) != leaf.shape:
    mismatch.append(f'shape {tuple(rec.shape)} recorded, {leaf.shape} stored')
  if mismatch:
    report.problems.append(Problem('metadata', error='; '.join(mismatch), **where))
    return []
  index: dict[tuple[int, ...], pw_metadata.ChunkRecord] = {}
  for c in rec.chunks:
    prev = index.setdefault(tuple(c.origin), c)
    if prev.crc32c != c.crc32c:
      report.problems.append(Problem(
          'metadata', origin=tuple(c.origin),
          error=f'writers disagree on crc32c ({prev.crc32c:#010x} vs {c.crc32c:#010x})', **where))
  chunk = tuple(rec.chunk_shape)
  for origin in arrays.chunk_origins(leaf.shape, chunk):
    if origin not in index:
      report.problems.append(Problem(
          'missing_record', origin=origin,
          error='no writer recorded this chunk (a writer file is missing or incomplete)', **where))
  return [_Task(item, leaf, store, o, chunk, c) for o, c in sorted(index.items())]


def _run(tasks: Iterable[_Task], report: Report, bar: Progress, *, window: int,
         window_bytes: int) -> None:
  pending: collections.deque = collections.deque()
  in_flight = 0
  for task in tasks:
    box = arrays.chunk_box(task.origin, task.chunk_shape, task.leaf.shape)
    pending.append((task, task.store[box].read()))
    in_flight += task.nbytes
    while pending and (len(pending) >= window or in_flight > window_bytes):
      in_flight -= _finish(*pending.popleft(), report, bar)
  while pending:
    _finish(*pending.popleft(), report, bar)


def _finish(task: _Task, fut, report: Report, bar: Progress) -> int:
  nbytes = task.nbytes
  report.chunks += 1
  where = dict(
      path=arrays.chunk_location(task.item, task.leaf, task.origin), item=task.item.name,
      array=task.leaf.key, origin=task.origin,
  )
  try:
    data = fut.result()
  except Exception as e:  # pylint: disable=broad-except  # tensorstore: ValueError, OSError...
    report.problems.append(Problem('read_error', error=arrays.first_line(e), **where))
  else:
    report.bytes_read += data.nbytes
    if task.expected is not None:
      report.chunks_checksummed += 1
      found = crc32c(data)
      if found != task.expected.crc32c:
        report.problems.append(Problem('crc_mismatch', expected_crc32c=task.expected.crc32c,
                                       found_crc32c=found, **where))
  bar.advance(nbytes)
  return nbytes
