"""Where a tier entry lives and what its manifest holds: pure names and msgpack, no I/O.

An entry is one writer's chunks of one item of one save::

    <tier_dir>/<root key>/<step name>/<item name>/<writer>.<save id>/
        manifest.msgpack   written last (atomic rename): the entry is whole once it exists
        COMMITTED          created after the step committed (the manager's after_commit hook)
        <a>.<c>.bin        raw bytes of chunk c of array a (stored dtype, C order, clipped),
                           or of a band that begins with chunk c (below)

A *band* (schema 2) is the part of one writer piece that spans one chunk row: the rows of a
chunk grid cell along the first dimension, the piece's whole extent along every other one. Where
the chunk grid cuts a piece along a later dimension (column blocks), the chunks of one row are
stored side by side as one file, in C order of the band, because that is how they lie in a
same-mesh restore's region buffer: the band file is mapped there whole (``storage/pages``), and
each chunk's crc32c is computed over its rows where they lie. A chunk that spans its piece's
trailing dimensions is its own band and keeps a file of its own, as in schema 1. An array lists
its multi-chunk bands in ``bands`` (file, origin, shape); a chunk whose ``files`` entry names a
band lies inside it.

``root key`` names the checkpoint directory (the manager's root, local path or gs://) by a
readable tail and a hash, so two jobs or directories on one node never share entries; the step
name is Orbax's (``12``, ``ckpt_12``); the save id is the one the writer's ``_pathways`` record
and the item's index carry, so a re-save of the same step (or another job's save) is told apart.
Several processes of one node write side by side (their writer names differ).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from typing import Any, Sequence

import msgpack
import numpy as np

from orbax_pathways.format import names as format_lib
from orbax_pathways.format import urls
from orbax_pathways.plan import boxes as boxes_lib

MANIFEST = 'manifest.msgpack'
COMMITTED = 'COMMITTED'
ROOT_FILE = 'root.txt'
KIND = 'orbax-pathways-tier'
SCHEMA = 2  # 2: bands (a schema-1 manifest reads as one without)
DEFAULT_SHM = '/dev/shm'


def normalize_root(root: Any) -> str:
  """The checkpoint directory as one string: gs:// kept, local paths absolute."""
  text = os.fspath(root).rstrip('/')
  if urls.is_url(text):
    return text
  return os.path.abspath(text)


def root_key(root: Any) -> str:
  """A directory name for ``root``: its last two components (sanitized) and 16 hex of its hash."""
  norm = normalize_root(root)
  tail = '_'.join(norm.split('://', 1)[-1].strip('/').split('/')[-2:])
  tail = re.sub(r'[^A-Za-z0-9_.-]', '_', tail)[-48:] or 'root'
  return f'{tail}-{hashlib.sha256(norm.encode()).hexdigest()[:16]}'


def split_item_dir(item_dir: Any) -> tuple[str, str, str]:
  """(checkpoint root, final step name, final item name) of an item directory, during a save
  (Orbax's temporary names) or after the commit."""
  text = os.fspath(item_dir).rstrip('/')
  step_dir, _, item = text.rpartition('/')
  root, _, step = step_dir.rpartition('/')
  return normalize_root(root or '.'), format_lib.final_name(step), format_lib.final_name(item)


def item_dir_of(root: str, step_name: str, item_name: str) -> str:
  return f'{root.rstrip("/")}/{step_name}/{item_name}'


def entry_name(writer: str, save_id: str) -> str:
  return f'{writer}.{save_id}'


def parse_entry_name(name: str) -> tuple[str, str] | None:
  writer, dot, save_id = name.rpartition('.')
  return (writer, save_id) if dot and writer and save_id else None


def entry_dir(tier_dir: str, root: str, step_name: str, item_name: str, writer: str,
              save_id: str) -> str:
  return os.path.join(tier_dir, root_key(root), step_name, item_name, entry_name(writer, save_id))


def chunk_file(array_index: int, chunk_index: int) -> str:
  return f'{array_index}.{chunk_index}.bin'


CHUNK_FILE_RE = re.compile(r'^[0-9]+\.[0-9]+\.bin$')  # chunk_file's names, nothing else


def _int_tuple(x: Any) -> bool:
  return isinstance(x, tuple) and all(isinstance(v, int) and v >= 0 for v in x)


def manifest_problem(m: Manifest) -> str:
  """What makes a decoded manifest unusable ('' when nothing): an array whose per-chunk lists
  differ in length, or a file name that is not one ``chunk_file`` makes (a path such as
  ``../x`` or ``/etc/passwd`` must never be opened), a chunk file named twice, a band outside
  its array or a chunk outside the band it names. Pure; the files themselves are checked by
  ``store.read_entry``."""
  names: set[str] = set()  # every file named so far, chunk or band, across arrays
  for a in m.arrays:
    n = len(a.origins)
    if not len(a.files) == len(a.crc32c) == len(a.nbytes) == n:
      return (f'array {a.name!r}: {n} origins, {len(a.files)} files, {len(a.nbytes)} sizes, '
              f'{len(a.crc32c)} checksums')
    bad = next((x for x in a.files if not isinstance(x, str) or not CHUNK_FILE_RE.match(x)), None)
    if bad is not None:
      return f'array {a.name!r}: {bad!r} is not a chunk file name'
    size = next((x for x in a.nbytes if not isinstance(x, int) or x < 0), None)
    if size is not None:
      return f'array {a.name!r}: a chunk has size {size!r}'
    if not a.bands:
      if names.intersection(a.files) or len(set(a.files)) != n:
        return 'a chunk file is named twice'
      names.update(a.files)
      continue
    if not (_int_tuple(a.shape) and _int_tuple(a.chunk_shape)
            and len(a.chunk_shape) == len(a.shape)
            and all(_int_tuple(o) and len(o) == len(a.shape) for o in a.origins)):
      return f'array {a.name!r}: its shapes or origins are not {len(a.shape)}-d'
    try:
      itemsize = dtype_of(a.dtype).itemsize
    except TypeError:
      return f'array {a.name!r}: {a.dtype!r} is not a dtype'
    bands: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for band in a.bands:
      if (len(band) != 3 or not isinstance(band[0], str) or not CHUNK_FILE_RE.match(band[0])
          or band[0] in bands or band[0] in names
          or not (_int_tuple(band[1]) and _int_tuple(band[2]))
          or not len(band[1]) == len(band[2]) == len(a.shape)
          or any(o + s > d for o, s, d in zip(band[1], band[2], a.shape))):
        return f'array {a.name!r}: {str(band)[:80]} is not a band of {list(a.shape)}'
      bands[band[0]] = (band[1], band[2])
    filled = dict.fromkeys(bands, 0)
    for origin, f, nbytes in zip(a.origins, a.files, a.nbytes):
      if f in bands:
        start, shape = bands[f]
        box = chunk_box(a, origin)
        if any(o < b or e > b + s for o, e, b, s in zip(box.start, box.stop, start, shape)):
          return f'array {a.name!r}: chunk {list(origin)} lies outside its band {f}'
        filled[f] += nbytes
      elif f in names:
        return 'a chunk file is named twice'
      names.add(f)
    for f, (_, shape) in bands.items():
      if filled[f] != math.prod(shape) * itemsize:
        return (f'array {a.name!r}: band {f} holds {math.prod(shape) * itemsize} bytes, its '
                f'chunks {filled[f]}')
  return ''


def chunk_box(a: 'TierArray', origin: Sequence[int]) -> boxes_lib.Box:
  """The box of ``a``'s chunk at ``origin``: its chunk shape, clipped to the array (what the
  chunk's file, or its part of a band, holds). Pure."""
  origin = tuple(int(o) for o in origin)
  return boxes_lib.clip(boxes_lib.Box(origin, tuple(o + c for o, c in zip(origin, a.chunk_shape))),
                        a.shape)


def dtype_of(name: str) -> np.dtype:
  """``name`` as a numpy dtype (bfloat16 & co. included); TypeError if it is none."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top,unused-import  (registers bfloat16 & co.)
  return np.dtype(name)


def file_sizes(m: Manifest) -> dict[str, int]:
  """Every file ``m`` names, with the size it must have: a chunk file its chunk's ``nbytes``, a
  band file the sum of its chunks' (they tile it). Pure; ``m`` passed ``manifest_problem``."""
  out: dict[str, int] = {}
  for a in m.arrays:
    for f, n in zip(a.files, a.nbytes):
      out[f] = out.get(f, 0) + int(n)
  return out


def band_boxes(a: TierArray) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
  """Band file -> (origin, shape) of ``a``'s multi-chunk bands. Pure."""
  return {f: (tuple(o), tuple(s)) for f, o, s in a.bands}


@dataclasses.dataclass(frozen=True)
class TierArray:
  """One array of an entry: its stored layout and the chunks this writer wrote (file names
  relative to the entry directory; ``crc32c`` as computed at save, informational: restore
  checks storage's)."""

  name: str
  dtype: str
  shape: tuple[int, ...]
  chunk_shape: tuple[int, ...]
  origins: tuple[tuple[int, ...], ...]
  crc32c: tuple[int, ...]
  nbytes: tuple[int, ...]
  files: tuple[str, ...]
  # (file, origin, shape) of each multi-chunk band (schema 2; see the module docstring).
  bands: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()


@dataclasses.dataclass(frozen=True)
class Manifest:
  root: str
  step_name: str
  item: str
  writer: str
  save_id: str
  arrays: tuple[TierArray, ...]
  library_version: str = ''

  @property
  def nbytes(self) -> int:
    return sum(sum(a.nbytes) for a in self.arrays)

  @property
  def chunks(self) -> int:
    return sum(len(a.origins) for a in self.arrays)


def encode(m: Manifest) -> bytes:
  return msgpack.packb({
      'kind': KIND, 'schema': SCHEMA, 'root': m.root, 'step': m.step_name, 'item': m.item,
      'writer': m.writer, 'save_id': m.save_id, 'library_version': m.library_version,
      'arrays': {a.name: {'dtype': a.dtype, 'shape': list(a.shape),
                          'chunk_shape': list(a.chunk_shape),
                          'origins': [list(o) for o in a.origins], 'crc32c': list(a.crc32c),
                          'nbytes': list(a.nbytes), 'files': list(a.files),
                          **({'bands': [[f, list(o), list(sh)] for f, o, sh in a.bands]}
                             if a.bands else {})}
                 for a in m.arrays}}, use_bin_type=True)


def decode(data: bytes) -> Manifest:
  """Parses a manifest; ValueError (with what is wrong) if it is not one this version reads."""
  try:
    o = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if o.get('kind') != KIND or int(o['schema']) > SCHEMA:
      raise ValueError(f'kind {o.get("kind")!r}, schema {o.get("schema")!r}')
    arrays = tuple(
        TierArray(name=n, dtype=a['dtype'], shape=tuple(a['shape']),
                  chunk_shape=tuple(a['chunk_shape']),
                  origins=tuple(tuple(x) for x in a['origins']), crc32c=tuple(a['crc32c']),
                  nbytes=tuple(a['nbytes']), files=tuple(a['files']),
                  bands=tuple((f, tuple(o), tuple(sh)) for f, o, sh in a.get('bands', ())))
        for n, a in o['arrays'].items())
    return Manifest(root=o['root'], step_name=o['step'], item=o['item'], writer=o['writer'],
                    save_id=o['save_id'], arrays=arrays,
                    library_version=o.get('library_version', ''))
  except ValueError:
    raise
  except Exception as e:  # msgpack and malformed fields raise several unrelated types
    raise ValueError(f'{type(e).__name__}: {e}') from e


def keep_steps(steps: Sequence[tuple[int, bool]], keep: int) -> set[int]:
  """Which step numbers of one checkpoint directory a node keeps, given each entry's (step,
  committed): the newest ``keep`` committed steps, and every step newer than the newest
  committed one (saves in flight; at most ``keep + 1`` of them, for front doors without a
  commit hook that marks entries). Everything older is dropped, so a step's copy goes only once
  a newer one is committed."""
  committed = sorted({s for s, c in steps if c}, reverse=True)
  newest = committed[0] if committed else -1
  pending = sorted({s for s, _ in steps if s > newest}, reverse=True)
  return set(committed[:keep]) | set(pending[:keep + 1])
