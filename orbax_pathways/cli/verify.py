"""``orbax-pathways verify``: read every chunk of every array of a step and check it.

Runs on the machine running the CLI (``main.cmd_verify``). Per item, two modes:
  checksum     our ``_pathways`` metadata is present: every recorded chunk region (origin +
               chunk_shape, clipped to the array) is read in the stored dtype and its crc32c
               compared with the recorded one. A chunk of the grid that no writer recorded is a
               ``missing_record`` problem naming the chunk (and is still read and decoded); so is
               every chunk of a ``jax.Array`` leaf that has no record at all.
  decode       stock Orbax: every chunk of the zarr write-chunk grid is read and decoded. Orbax
               stores every chunk (``store_array_data_equal_to_fill_value``), so a missing chunk
               is an error, not zeros.
An item without ``_pathways`` that orbax-pathways demonstrably wrote (a sibling item of the same
step has records, or the colocated transport's ``ocdbt.process_w<id>`` databases are there) fails
with ``missing_record``: its records were deleted, so nothing in it can be checked.
Metadata is checked in both modes: ``_CHECKPOINT_METADATA``, commit marker, ``_METADATA``,
``_sharding``, ``array_metadatas/*``, ``_strings.json``, zarr metadata, our msgpack files. A
damaged ``_pathways/index.msgpack`` is a ``metadata`` problem; the chunks are then checked
against the writer records beside it (what a restore falls back to).

What it reads: storage only, never a node-local tier (``orbax-pathways tier`` checks those
copies). A restore that the tier serves takes those chunks from node memory, checked against
the committed crc32c, and does not read their copies on storage: damage there stays unseen
until this command (or a restore from storage) reads them. The restore says so in its log
(``engine.Engine.restore``, once per restore). A local-only step
(``<directory>/.orbax-pathways-local/<step>``, docs/multi_tier.md) holds its jax.Array chunks
in the writers' tiers only: their records, zarr metadata and every other leaf are checked
here; the chunks themselves are ``unchecked`` (exit 3), naming the command that checks them on
each node.

Verdict (``Report.verdict``, the exit status of ``orbax-pathways verify``):
  ok         every value was checked against a recorded crc32c and matched (exit 0);
  unchecked  nothing is damaged as far as decoding can tell, but some values carry no checksum
             (``Report.unchecked``: stock Orbax items, arrays of the persistence transport,
             string leaves, host leaves saved by Orbax v1 or by an older orbax-pathways) (exit 3);
  failed     a problem (``Report.problems``): damage, a missing record, unreadable metadata
             (exit 1).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Iterable, TypedDict

from orbax_pathways.format import checksum
from orbax_pathways.format import names as fmt
from orbax_pathways.format import item as item_lib
from orbax_pathways.format import records as records_lib
from orbax_pathways.cli import arrays
from orbax_pathways.cli import paths
from orbax_pathways.cli import steps
from orbax_pathways.cli.model import (CHECKSUM, DECODE, LOCAL_ONLY, PARTIAL, Item, Leaf, Step,
                                      np_dtype)
from orbax_pathways.storage import meta_io


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


@dataclasses.dataclass(frozen=True)
class Unchecked:
  """A value verify could only decode (or parse): nothing recorded a checksum for it."""

  item: str
  key: str
  reason: str

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


OK, UNCHECKED, FAILED = 'ok', 'unchecked', 'failed'
EXIT_CODES = {OK: 0, FAILED: 1, UNCHECKED: 3}  # 2: user error, 130: interrupted (cli/main.py)


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
  unchecked: list[Unchecked] = dataclasses.field(default_factory=list)

  @property
  def verdict(self) -> str:
    """``failed`` (problems), ``unchecked`` (none, but values without a checksum) or ``ok``."""
    if self.problems:
      return FAILED
    return UNCHECKED if self.unchecked else OK

  @property
  def ok(self) -> bool:
    """Every value checked and intact."""
    return self.verdict == OK

  @property
  def exit_code(self) -> int:
    return EXIT_CODES[self.verdict]

  def to_json(self) -> dict[str, Any]:
    return {
        'path': self.path, 'step': self.step, 'state': self.state, 'ok': self.ok,
        'verdict': self.verdict, 'modes': self.modes, 'arrays': self.arrays,
        'chunks': self.chunks, 'chunks_checksummed': self.chunks_checksummed,
        'bytes_read': self.bytes_read, 'seconds': round(self.seconds, 3),
        'problems': [p.to_json() for p in self.problems],
        'unchecked': [u.to_json() for u in self.unchecked],
    }


class _Where(TypedDict):
  """The ``Problem`` fields that place a problem in an array."""

  path: str
  item: str | None
  array: str | None


class _ChunkWhere(_Where):
  """... and in one of its chunks."""

  origin: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Task:
  item: Item
  leaf: Leaf
  store: Any
  origin: tuple[int, ...]
  chunk_shape: tuple[int, ...]
  expected: records_lib.ChunkRecord | None

  @property
  def region(self):
    assert self.leaf.shape is not None, 'tasks are made for opened leaves (fill_from_store)'
    return fmt.chunk_region(self.origin, self.chunk_shape, self.leaf.shape)

  @property
  def nbytes(self) -> int:
    return self.region.size * self.store.dtype.numpy_dtype.itemsize


class NoProgress:
  """What ``verify_step`` reports progress to by default: nothing (see ``render.Progress``)."""

  def start(self, total_bytes: int, total_chunks: int) -> None:
    pass

  def advance(self, nbytes: int) -> None:
    pass

  def close(self) -> None:
    pass


# ----------------------------------------------------------------------------------------------


def verify_step(step_dir, *, progress=None, window: int = 16,
                window_bytes: int = 512 << 20) -> Report:
  """Checks one step; returns a Report whose ``problems`` is empty only when everything passed."""
  t0 = time.monotonic()
  progress = progress or NoProgress()
  step = steps.read_step(step_dir)
  report = Report(path=str(step.path), step=step.step, state=step.state)
  index_problems = {item.name: _index_problems(item) for item in step.items
                    if item.kind == 'pytree' and item.leaves}
  said = [p.path for ps in index_problems.values() for p in ps]
  report.problems += [p for p in _step_problems(step)  # a damaged index is said per item
                      if not any(s in (p.error or '') for s in said)]
  tasks: list[_Task] = []
  for item in step.items:
    if item.kind != 'pytree' or not item.leaves:
      continue
    report.problems += index_problems[item.name]
    checksummed = item.pathways is not None and not (item.pathways.writers and all(
        w.transport in fmt.CHECKSUMLESS_TRANSPORTS for w in item.pathways.writers))
    report.modes[item.name] = CHECKSUM if checksummed else DECODE
    report.problems += _file_problems(item)
    report.problems += _deleted_records(step, item)
    report.unchecked += [Unchecked(item.name, l.key, 'string leaf (_strings.json has no '
                                   'checksum)') for l in item.leaves if l.value_type == 'string']
    tasks += _item_tasks(item, report)
  progress.start(sum(t.nbytes for t in tasks), len(tasks))
  _run(tasks, report, progress, window=window, window_bytes=window_bytes)
  progress.close()
  report.seconds = time.monotonic() - t0
  return report


def _step_problems(step: Step) -> list[Problem]:
  out = [Problem('metadata', path=str(step.path), error=p) for p in step.problems
         if not p.startswith('no commit marker')]
  if step.state == PARTIAL:
    out.append(Problem(
        'not_committed', path=str(step.path),
        error='step was never committed (temporary name or no commit marker); '
        'it is an interrupted save and restore ignores it',
    ))
  return out


def _file_problems(item: Item) -> list[Problem]:
  """Orbax metadata files beside the arrays: must parse; string leaves must be present."""
  out = []
  am = item.path / fmt.ARRAY_METADATAS_DIR
  if am.exists():
    for p in sorted(am.iterdir(), key=lambda p: p.name):
      try:
        paths.read_json(p)
      except paths.DamagedFile as e:
        out.append(Problem('metadata', path=str(p), item=item.name, error=steps.damaged(e)))
  strings = [l.key for l in item.leaves if l.value_type == 'string']
  if strings:
    p = item.path / fmt.STRINGS_FILE
    try:
      values = paths.read_json(p)
      missing = [s for s in strings if s not in values]
      if missing:
        out.append(Problem('metadata', path=str(p), item=item.name,
                           error=f'string leaves missing: {", ".join(missing)}'))
    except paths.DamagedFile as e:
      out.append(Problem('metadata', path=str(p), item=item.name, error=steps.damaged(e)))
    except OSError as e:
      out.append(Problem('metadata', path=str(p), item=item.name, error=arrays.first_line(e)))
  return out


def written_by_us_evidence(step: Step, item: Item) -> str | None:
  """Why ``item`` (which has no ``_pathways`` records) must have been written by orbax-pathways,
  or None when nothing that survives says so (stock Orbax writes the same files)."""
  if item.pathways is not None or not any(l.is_jax_array for l in item.leaves):
    return None
  colocated = sorted(p.name for p in paths.listdir(item.path)
                     if fmt.COLOCATED_OCDBT_RE.match(p.name))
  if colocated:
    return (f'its OCDBT databases {", ".join(colocated[:3])}{" ..." if len(colocated) > 3 else ""}'
            ' were written by the orbax-pathways colocated transport')
  siblings = [i.name for i in step.items if i.pathways is not None]
  if siblings:
    return (f'item(s) {", ".join(siblings)} of the same save have orbax-pathways records, so '
            'its jax.Array leaves were written by orbax-pathways too')
  return None


def _index_problems(item: Item) -> list[Problem]:
  """A damaged ``_pathways/index.msgpack`` is a problem; when its writer records are intact the
  item is then checked against them (restore rebuilds the index from them the same way)."""
  index = item.path / fmt.PATHWAYS_DIR / records_lib.INDEX_FILENAME
  try:
    if not index.exists():
      return []
    item_lib.decode_index(index.read_bytes(), path=str(index))
    return []
  except records_lib.MetadataError as e:
    error = str(e)
  except OSError as e:
    error = f'cannot read {index}: {arrays.first_line(e)}'
  try:
    records = meta_io.read_records(item.path)
  except (OSError, records_lib.MetadataError):
    records = []
  if records:
    item.pathways = item_lib.merge(records)
    merged = item.pathways.arrays()
    for leaf in item.leaves:
      leaf.record = leaf.record or merged.get(leaf.key)
    error += (f' The {len(records)} writer record(s) beside it are intact: the chunks were '
              'checked against them, and a restore rebuilds the index from them.')
  else:
    error += ' No writer record is beside it: nothing in this item could be checked.'
  return [Problem('metadata', path=str(index), item=item.name, error=error)]


def _deleted_records(step: Step, item: Item) -> list[Problem]:
  evidence = written_by_us_evidence(step, item)
  if evidence is None:
    return []
  return [Problem(
      'missing_record', path=str(item.path / fmt.PATHWAYS_DIR), item=item.name,
      error=f'{fmt.PATHWAYS_DIR}/ is missing but {evidence}: its checksum records were deleted, '
      'so no chunk could be checked (every chunk was only decoded). Restore another step, or put '
      f'{fmt.PATHWAYS_DIR}/ back from a copy of this checkpoint.')]


def _item_tasks(item: Item, report: Report) -> list[_Task]:
  opened = [(leaf, arrays.open_array(item, leaf)) for leaf in item.arrays]
  tasks = []
  for leaf, fut in opened:
    try:
      store = fut.result()
    except Exception as e:  # pylint: disable=broad-except
      report.problems.append(Problem('open_error', path=arrays.kvstore_location(item, leaf),
                                     item=item.name, array=leaf.key, error=arrays.first_line(e)))
      continue
    report.arrays += 1
    arrays.fill_from_store(leaf, store)
    assert leaf.shape is not None and leaf.chunk_shape is not None, 'fill_from_store sets both'
    in_tiers = item.in_tiers_only(leaf)  # no bytes on storage
    if leaf.record is not None and leaf.key not in item.checksumless:
      recorded = _record_tasks(item, leaf, store, report)  # the records checked either way
      if in_tiers:
        report.unchecked.append(Unchecked(item.name, leaf.key, LOCAL_ONLY))
      else:
        tasks += recorded
      continue
    why = _why_unrecorded(item, leaf)
    lost = why is None
    if why is not None:
      report.unchecked.append(Unchecked(item.name, leaf.key, why))
    for origin in fmt.chunk_origins(leaf.shape, leaf.chunk_shape):
      if lost:
        report.problems.append(_missing_record(item, leaf, origin))
      if not in_tiers:
        tasks.append(_Task(item, leaf, store, origin, leaf.chunk_shape, None))
  return tasks


HOST_WRITER_KINDS = ('numpy.', 'scalar.')  # frontends/orbax_v0.host_writer_name


def _why_unrecorded(item: Item, leaf: Leaf) -> str | None:
  """Why an array without a usable record is only decoded (an ``unchecked`` entry), or None when
  it should have had one (a ``missing_record`` problem): a jax.Array leaf in an item with our
  metadata; a numpy or scalar leaf in an item whose host leaves were recorded."""
  if item.pathways is None:
    return 'no orbax-pathways checksums (written by stock Orbax)'
  if leaf.key in item.checksumless:
    return 'written by the persistence transport, which records no checksums'
  if leaf.is_jax_array:
    return None
  if any(w.writer.startswith(HOST_WRITER_KINDS) for w in item.pathways.writers):
    return None
  return (f'{leaf.value_type} leaf saved by Orbax\'s own handler (Orbax v1, or an '
          'orbax-pathways version that did not record numpy and scalar leaves)')


def _missing_record(item: Item, leaf: Leaf, origin: tuple[int, ...]) -> Problem:
  what = ('its bytes, in the node-local tiers of a local-only step, cannot be checked against '
          'anything' if item.in_tiers_only(leaf) else
          'it was decoded but its checksum could not be checked')
  return Problem(
      'missing_record', path=arrays.chunk_location(item, leaf, origin), item=item.name,
      array=leaf.key, origin=origin,
      error=f'no writer in {item.path / fmt.PATHWAYS_DIR} recorded this chunk (a writer file is '
      f'missing or incomplete): {what}')


def _record_tasks(item: Item, leaf: Leaf, store: Any, report: Report) -> list[_Task]:
  """Every chunk of ``leaf``'s grid, after checking our record against the zarr array: recorded
  chunks are checksummed, unrecorded ones decoded and reported."""
  rec = leaf.record
  assert rec is not None and leaf.shape is not None, 'called for opened leaves with a record'
  where: _Where = dict(path=str(item.path / fmt.PATHWAYS_DIR), item=item.name, array=leaf.key)
  mismatch = []
  if np_dtype(rec.dtype) != store.dtype.numpy_dtype:
    mismatch.append(f'dtype {rec.dtype} recorded, {leaf.dtype} stored')
  if tuple(rec.shape) != leaf.shape:
    mismatch.append(f'shape {tuple(rec.shape)} recorded, {leaf.shape} stored')
  if mismatch:
    report.problems.append(Problem('metadata', error='; '.join(mismatch), **where))
    return []
  index: dict[tuple[int, ...], records_lib.ChunkRecord] = {}
  for c in rec.chunks:
    prev = index.setdefault(tuple(c.origin), c)
    if prev.crc32c != c.crc32c:
      report.problems.append(Problem(
          'metadata', origin=tuple(c.origin),
          error=f'writers disagree on crc32c ({prev.crc32c:#010x} vs {c.crc32c:#010x})', **where))
  chunk = tuple(rec.chunk_shape)
  tasks = []
  for origin in fmt.chunk_origins(leaf.shape, chunk):
    if origin not in index:
      report.problems.append(_missing_record(item, leaf, origin))
    tasks.append(_Task(item, leaf, store, origin, chunk, index.get(origin)))
  return tasks


def _run(tasks: Iterable[_Task], report: Report, progress, *, window: int,
         window_bytes: int) -> None:
  pending: collections.deque[tuple[_Task, Any]] = collections.deque()  # (task, read future)
  in_flight = 0
  for task in tasks:
    pending.append((task, task.store[task.region.to_slices()].read()))
    in_flight += task.nbytes
    while pending and (len(pending) >= window or in_flight > window_bytes):
      in_flight -= _finish(*pending.popleft(), report, progress)
  while pending:
    _finish(*pending.popleft(), report, progress)


def _finish(task: _Task, fut, report: Report, progress) -> int:
  nbytes = task.nbytes
  report.chunks += 1
  where: _ChunkWhere = dict(
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
      found = checksum.of_array(data)
      if found != task.expected.crc32c:
        report.problems.append(Problem('crc_mismatch', expected_crc32c=task.expected.crc32c,
                                       found_crc32c=found, **where))
  progress.advance(nbytes)
  return nbytes
