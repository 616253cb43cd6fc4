"""Reads an Orbax checkpoint directory into plain dataclasses: steps, states, items, leaves.

What is read, per step directory (``research/orbax_internals.md`` §0):
  ``_CHECKPOINT_METADATA``     JSON: item handlers, commit timestamp.
  ``commit_success.txt``       commit marker (Orbax >= 0.12.2, and the gs:// commit-file mode).
  ``<item>/_METADATA``         JSON tree: per leaf ``value_type`` / ``write_shape``; ``use_ocdbt``,
                               ``use_zarr3``, ``store_array_data_equal_to_fill_value``.
  ``<item>/_sharding``         JSON: urlsafe-b64(param name) -> JSON string of the saved sharding.
  ``<item>/_strings.json``     string leaves.
  ``<item>/_pathways/*``       our metadata (``orbax_pathways.storage.meta_io.read_item``).
  zarr metadata               dtype / shape / chunks, opened through tensorstore with Orbax's own
                               spec rules (OCDBT kvstore rooted at the item, else ``<item>/<param>``).

Nothing here imports jax. Local paths and ``gs://`` go through ``etils.epath`` and tensorstore.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
from typing import Any, Iterator, Sequence

from etils import epath
import numpy as np

from orbax_pathways import metadata as pw_metadata
from orbax_pathways.storage import meta_io

TMP_SUFFIX = '.orbax-checkpoint-tmp'
CHECKPOINT_METADATA = '_CHECKPOINT_METADATA'
COMMIT_SUCCESS = 'commit_success.txt'
ITEM_METADATA = '_METADATA'
SHARDING_FILE = '_sharding'
STRINGS_FILE = '_strings.json'
ARRAY_VALUE_TYPES = frozenset({'jax.Array', 'np.ndarray', 'scalar'})

COMPLETE, PARTIAL, CORRUPT = 'complete', 'partial', 'corrupt'

_STEP_RE = re.compile(r'^(?:(?P<prefix>.+)_)?(?P<step>\d+)(?P<tmp>\.orbax-checkpoint-tmp.*)?$')


class CliError(Exception):
  """A user error: printed as one line, exit code 2, no traceback."""


# ----------------------------------------------------------------------------------------------
# Dataclasses.


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
  record: pw_metadata.ArrayRecord | None = None
  error: str | None = None  # Why the zarr metadata could not be read.

  @property
  def is_array(self) -> bool:
    return self.value_type in ARRAY_VALUE_TYPES or self.write_shape is not None

  @property
  def nbytes(self) -> int | None:
    """Logical bytes: itemsize * prod(shape)."""
    if self.dtype is None or self.shape is None:
      return None
    return np_dtype(self.dtype).itemsize * math.prod(self.shape)

  @property
  def chunk_nbytes(self) -> int | None:
    """Raw bytes of the chunks our writers recorded (None without our metadata)."""
    if self.record is None:
      return None
    return sum(c.nbytes for c in pw_metadata.chunk_index([self.record]).values())


@dataclasses.dataclass
class Item:
  """One item (``<step>/<name>``) of a step."""

  name: str
  path: epath.Path
  kind: str  # 'pytree' (has _METADATA) or 'other'.
  handler: str | None = None
  use_ocdbt: bool = False
  use_zarr3: bool = False
  store_fill: bool = True
  leaves: list[Leaf] = dataclasses.field(default_factory=list)
  pathways: pw_metadata.ItemMetadata | None = None
  problems: list[str] = dataclasses.field(default_factory=list)

  @property
  def arrays(self) -> list[Leaf]:
    return [l for l in self.leaves if l.is_array]

  @property
  def transports(self) -> list[str]:
    return sorted(self.pathways.transports()) if self.pathways else []

  @property
  def writer(self) -> str:
    return ', '.join(self.transports) if self.pathways else 'stock orbax'


@dataclasses.dataclass
class Step:
  """One step directory and its state."""

  path: epath.Path
  name: str
  step: int | None
  state: str
  problems: list[str] = dataclasses.field(default_factory=list)
  commit_ns: int | None = None
  items: list[Item] = dataclasses.field(default_factory=list)
  bytes: int | None = None

  @property
  def tmp(self) -> bool:
    return TMP_SUFFIX in self.name

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
    slices, devices, seen = 0, set(), False
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
# Small helpers.


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


def to_path(s: str | os.PathLike[str]) -> epath.Path:
  """A CLI argument as an epath (local paths made absolute: tensorstore's OCDBT needs that)."""
  text = os.fspath(s)
  if '://' not in text:
    text = os.path.abspath(text)
  path = epath.Path(text)
  preflight(path)
  return path


def is_remote(path: epath.Path) -> bool:
  return '://' in os.fspath(path)


def preflight(path: epath.Path) -> None:
  """Fails fast, in one line, on gs:// without credentials (gcsfs would retry for a minute)."""
  if not os.fspath(path).startswith('gs://') or os.environ.get('STORAGE_EMULATOR_HOST'):
    return
  try:
    import google.auth  # pylint: disable=g-import-not-at-top
    import google.auth.exceptions  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  try:
    google.auth.default()
  except google.auth.exceptions.DefaultCredentialsError as e:
    raise CliError(
        f'cannot read {path}: no Google Cloud credentials found (looked for Application Default '
        'Credentials: GOOGLE_APPLICATION_CREDENTIALS, gcloud, the GCE metadata server). Run '
        '`gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS.'
    ) from e


_CREDENTIAL_HINTS = (
    'DefaultCredentialsError', 'default credentials', 'Could not automatically determine',
    'UNAUTHENTICATED', 'PERMISSION_DENIED', 'Anonymous caller', 'RefreshError', 'invalid_grant',
)
_HTTP_AUTH = re.compile(r'\b(401|403)\b')


def classify_remote_error(path: epath.Path, e: BaseException) -> CliError | None:
  """The single place that turns a storage exception into a user error (by its text)."""
  text = f'{type(e).__name__}: {e}'
  if not is_remote(path):
    return None
  if isinstance(e, ImportError) or 'Please install gcsfs' in text:
    return CliError(f'cannot read {path}: gs:// paths need gcsfs (pip install gcsfs).')
  if any(h in text for h in _CREDENTIAL_HINTS) or _HTTP_AUTH.search(text):
    return CliError(
        f'cannot read {path}: no usable Google Cloud credentials ({type(e).__name__}). '
        'Run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS.'
    )
  return CliError(f'cannot read {path}: {text.splitlines()[0][:300]}')


@contextlib.contextmanager
def remote_errors(path: epath.Path) -> Iterator[None]:
  """Turns credential / transport failures on gs:// into one-line CliErrors."""
  try:
    yield
  except CliError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    err = classify_remote_error(path, e)
    if err is None:
      raise
    raise err from e


def path_exists(path: epath.Path) -> bool:
  with remote_errors(path):
    return path.exists()


def _read_json(path: epath.Path) -> Any:
  return json.loads(path.read_text())


def _listdir(path: epath.Path) -> list[epath.Path]:
  with remote_errors(path):
    return sorted(path.iterdir(), key=lambda p: p.name)


def dir_size(path: epath.Path) -> int:
  """Total bytes of the files under ``path`` (one listing on gs://)."""
  if not is_remote(path):
    total = 0
    for root, _, files in os.walk(os.fspath(path)):
      for f in files:
        with contextlib.suppress(OSError):
          total += os.stat(os.path.join(root, f)).st_size
    return total
  import fsspec  # pylint: disable=g-import-not-at-top

  with remote_errors(path):
    fs, p = fsspec.core.url_to_fs(os.fspath(path))
    return sum(int(i.get('size') or 0) for i in fs.find(p, detail=True).values())


# ----------------------------------------------------------------------------------------------
# Steps.


def parse_step_name(name: str) -> tuple[int, bool] | None:
  """'12' -> (12, False); 'ckpt_12.orbax-checkpoint-tmp' -> (12, True); not a step -> None."""
  m = _STEP_RE.match(name)
  if not m:
    return None
  return int(m.group('step')), m.group('tmp') is not None


def looks_like_step(path: epath.Path) -> bool:
  if path_exists(path / CHECKPOINT_METADATA) or path_exists(path / COMMIT_SUCCESS):
    return True
  return path_exists(path / ITEM_METADATA)


def list_step_dirs(root: epath.Path) -> list[epath.Path]:
  """Step directories of a checkpoint root, sorted by (step, tmp last). Raises CliError."""
  if not path_exists(root):
    raise CliError(f'{root} does not exist: pass the directory given to ocp.CheckpointManager.')
  if not root.is_dir():
    raise CliError(f'{root} is a file, not a checkpoint directory.')
  steps = []
  for p in _listdir(root):
    parsed = parse_step_name(p.name)
    if parsed is not None and p.is_dir():
      steps.append((parsed, p))
  if not steps:
    if looks_like_step(root):
      raise CliError(
          f'{root} is a single checkpoint step, not a directory of steps; '
          f'run `orbax-pathways show {root}` instead.'
      )
    raise CliError(
        f'{root} is not an Orbax checkpoint directory: found no step directories '
        '(named <N>, <prefix>_<N> or <N>.orbax-checkpoint-tmp).'
    )
  return [p for _, p in sorted(steps, key=lambda t: (t[0][0], t[0][1], t[1].name))]


def resolve_step(path: str | os.PathLike[str], step: int | None = None) -> epath.Path:
  """``DIR/STEP`` or ``DIR`` + ``--step N`` -> the step directory. Raises CliError."""
  p = to_path(path)
  if step is None:
    if not path_exists(p):
      parent = p.parent
      if parse_step_name(p.name) and path_exists(parent):
        present = _step_numbers(parent)
        raise CliError(
            f'step directory {p} does not exist; steps in {parent}: {present or "none"}.'
        )
      raise CliError(f'{p} does not exist: pass a checkpoint step directory (DIR/STEP).')
    if looks_like_step(p) or (parse_step_name(p.name) and p.is_dir()):
      return p
    present = _step_numbers(p)  # Raises when p is not a checkpoint root either.
    raise CliError(
        f'{p} is a checkpoint directory with steps {present}; '
        f'pass one step: {p}/<STEP> or --step N.'
    )
  candidates = [
      d for d in list_step_dirs(p) if (parse_step_name(d.name) or (None,))[0] == step
  ]
  if not candidates:
    raise CliError(f'step {step} not found in {p}; steps present: {_step_numbers(p)}.')
  final = [d for d in candidates if TMP_SUFFIX not in d.name]
  return (final or candidates)[0]


def _step_numbers(root: epath.Path) -> str:
  nums = []
  for d in list_step_dirs(root):
    n, tmp = parse_step_name(d.name)
    nums.append(f'{n}{" (partial)" if tmp else ""}')
  return ', '.join(nums)


def read_step(path: epath.PathLike, *, open_arrays: bool = False) -> Step:
  """Reads one step: state, commit time, items and their leaves (zarr metadata if open_arrays)."""
  path = to_path(path)
  parsed = parse_step_name(path.name)
  step = Step(path=path, name=path.name, step=parsed[0] if parsed else None, state=PARTIAL)
  with remote_errors(path):
    ckpt_meta = _read_checkpoint_metadata(path, step)
    handlers = (ckpt_meta or {}).get('item_handlers') or {}
    step.items = _read_items(path, handlers if isinstance(handlers, dict) else {})
  for item in step.items:
    step.problems.extend(item.problems)
  step.state = _state(step, ckpt_meta, path_exists(path / COMMIT_SUCCESS))
  if open_arrays:
    from orbax_pathways.cli.arrays import open_leaves  # pylint: disable=g-import-not-at-top
    for item in step.items:
      open_leaves(item)
  return step


def _read_checkpoint_metadata(path: epath.Path, step: Step) -> dict[str, Any] | None:
  p = path / CHECKPOINT_METADATA
  if not p.exists():
    if not step.tmp:
      step.problems.append(f'{p} is missing')
    return None
  try:
    meta = _read_json(p)
    if not isinstance(meta, dict):
      raise ValueError(f'expected a JSON object, got {type(meta).__name__}')
  except ValueError as e:
    step.problems.append(f'{p} is unreadable: {e}')
    return None
  ts = meta.get('commit_timestamp_nsecs')
  step.commit_ns = int(ts) if isinstance(ts, (int, float)) and ts else None
  return meta


def _state(step: Step, ckpt_meta: dict[str, Any] | None, committed_file: bool) -> str:
  if step.tmp:
    return PARTIAL
  marked = committed_file or step.commit_ns is not None
  unreadable = bool(step.problems)
  if marked:
    return CORRUPT if unreadable else COMPLETE
  # Final name, no marker: unfinished (commit-file mode) unless its metadata is itself damaged.
  if ckpt_meta is None and path_exists(step.path / CHECKPOINT_METADATA):
    return CORRUPT
  step.problems.append('no commit marker (commit_success.txt or commit timestamp)')
  return PARTIAL


def _read_items(step_dir: epath.Path, handlers: dict[str, Any]) -> list[Item]:
  if (step_dir / ITEM_METADATA).exists():  # A bare PyTreeCheckpointer save: the step is the item.
    return [read_item(step_dir, '.', None)]
  items = []
  for p in _listdir(step_dir):
    if not p.is_dir():
      continue
    name = p.name.split(TMP_SUFFIX)[0]
    if name in handlers or (p / ITEM_METADATA).exists() or TMP_SUFFIX in p.name:
      items.append(read_item(p, name, handlers.get(name)))
  return items


def read_item(path: epath.Path, name: str, handler: str | None) -> Item:
  """Reads ``_METADATA``, ``_sharding`` and our metadata of one item (no tensorstore)."""
  item = Item(name=name, path=path, kind='other', handler=handler)
  meta_path = path / ITEM_METADATA
  if meta_path.exists():
    item.kind = 'pytree'
    try:
      _parse_item_metadata(item, _read_json(meta_path))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      item.problems.append(f'{meta_path} is unreadable: {type(e).__name__}: {e}')
  elif _is_pytree_handler(handler) and TMP_SUFFIX not in path.name:
    item.problems.append(f'{meta_path} is missing')
  try:
    item.pathways = meta_io.read_item(path)
  except pw_metadata.MetadataError as e:
    item.problems.append(str(e))
  _attach_shardings(item)
  return item


def _is_pytree_handler(handler: str | None) -> bool:
  return bool(handler) and ('PyTree' in handler or 'Standard' in handler)


def _parse_item_metadata(item: Item, meta: dict[str, Any]) -> None:
  tree = meta['tree_metadata']
  item.use_ocdbt = bool(meta.get('use_ocdbt', False))
  item.use_zarr3 = bool(meta.get('use_zarr3', False))
  item.store_fill = bool(meta.get('store_array_data_equal_to_fill_value', False))
  for entry in tree.values():
    keypath = tuple(str(k['key']) for k in entry['key_metadata'])
    value = entry['value_metadata']
    ws = value.get('write_shape')
    item.leaves.append(
        Leaf(
            key='.'.join(keypath),
            keypath=keypath,
            value_type=str(value.get('value_type')),
            write_shape=tuple(ws) if ws is not None else None,
        )
    )
  if 'use_ocdbt' not in meta:  # Older Orbax: OCDBT iff the merged manifest exists.
    item.use_ocdbt = (item.path / 'manifest.ocdbt').exists()


def _attach_shardings(item: Item) -> None:
  """Fills each leaf's sharding (ours first, else Orbax's ``_sharding``) and our record."""
  records = item.pathways.arrays() if item.pathways else {}
  orbax = _read_orbax_shardings(item)
  for leaf in item.leaves:
    leaf.record = records.get(leaf.key)
    if leaf.record is not None and leaf.record.sharding is not None:
      leaf.sharding = _from_record(leaf.record.sharding)
    elif leaf.key in orbax:
      leaf.sharding = orbax[leaf.key]
  known = {l.key for l in item.leaves}
  for name in sorted(set(records) - known) if item.kind == 'pytree' else ():
    item.problems.append(
        f'{item.path / pw_metadata.DIRNAME}: array {name!r} is not in {ITEM_METADATA}'
    )


def _from_record(r: pw_metadata.ShardingRecord) -> Sharding:
  return Sharding(
      source='pathways', kind=r.kind, mesh_shape=tuple(r.mesh_shape),
      axis_names=tuple(r.axis_names), spec=tuple(r.spec), device_ids=tuple(r.device_ids),
      num_slices=r.num_slices, slice_axes=tuple(r.slice_axes),
  )


def _read_orbax_shardings(item: Item) -> dict[str, Sharding]:
  p = item.path / SHARDING_FILE
  if not p.exists():
    return {}
  try:
    raw = _read_json(p)
    out = {}
    for k, v in raw.items():
      name = base64.urlsafe_b64decode(k.encode()).decode()
      out[name] = _parse_orbax_sharding(json.loads(v) if isinstance(v, str) else v)
    return out
  except (ValueError, TypeError, AttributeError, KeyError) as e:
    item.problems.append(f'{p} is unreadable: {type(e).__name__}: {e}')
    return {}


def _parse_orbax_sharding(d: dict[str, Any]) -> Sharding:
  kind = d.get('sharding_type')
  if kind == 'NamedSharding':
    ids = tuple(int(x['id']) for x in _flatten(d.get('device_mesh', {}).get('mesh', [])))
    spec = tuple(tuple(p) if isinstance(p, list) else p for p in d.get('partition_spec', []))
    return Sharding(
        source='orbax', kind='named', mesh_shape=tuple(d.get('shape', ())),
        axis_names=tuple(d.get('axis_names', ())), spec=spec, device_ids=ids,
    )
  if kind == 'SingleDeviceSharding':
    return Sharding(source='orbax', kind='single_device', device=d.get('device_str'))
  return Sharding(source='orbax', kind=str(kind or 'other'))


def _flatten(x: Any) -> Iterator[Any]:
  if isinstance(x, list):
    for y in x:
      yield from _flatten(y)
  else:
    yield x
