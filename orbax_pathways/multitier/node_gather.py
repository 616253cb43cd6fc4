"""A node step restored onto another layout: each process gathers the saved parts its devices
need now from the nodes that hold them, joins them into one Orbax checkpoint, and restores it.

Called by ``node_steps.resume`` on every process of the manager, for a step the resume's round
marked as restored this way (the job now has another process count, or a process runs on a
node another process saved: ``plan/node_verdict.decide``). A node step is one part per saving
process (writer ``p<i>``: the shards its devices held, every numpy and scalar leaf), each an
Orbax checkpoint of that process alone, without OCDBT (a file per chunk; an older node step:
its own OCDBT tree, ``ocdbt.process_<i>``) and with its records (``_pathways/p<i>.msgpack``).
What a restoring process does, on its own host:

1. reads the step's layout from a part this node holds (its own, another process's saved here,
   or a partner copy), or fetches the metadata files of one (no array bytes) from the node of
   a process that holds one;
2. plans which parts hold the boxes its devices need now (``plan/node_parts.py``: the saved
   shardings and which process saved each device), preferring parts this node holds;
3. fetches each part it needs and lacks, whole, from a node holding it (``fleet/node_copy.py``:
   the job's peer channel, authenticated, every file checked against its crc32c and size);
4. joins them in a scratch directory beside this node's node steps (``assemble``): the items'
   Orbax metadata from one part, every part's chunk files (each chunk once) and record (an
   older step's OCDBT trees merged as Orbax merges a multi-process save,
   ``_compat/orbax.merge_ocdbt``); files are hard links;
5. restores it with the node steps' handlers (every chunk read is checked against the records of
   the part that wrote it; a box no gathered part covers raises, and the resume passes the step
   over on every process), then removes the scratch directory. Where a part proves damaged
   (a fetch or the restore fails), the parts used are fetched once more from the other node
   holding each (a part is kept as saved and as its partner's copy) and the step joined again.

What grows with what: a process reads the parts its devices overlap (for a state sharded over
every device, about ``old processes / new processes + 1`` parts), each whole: a part's bytes
beyond the boxes it needs are fetched too. Where each part is: one key-value read per part this
node lacks (two where its node as saved is gone: the part's key, then its copy's), published by
the processes holding it beside the resume's round (``node_round.agreed``); after a failure,
one more per part used.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from typing import Any, Callable, Mapping

import jax

from orbax_pathways._compat import jax_distributed
from orbax_pathways._compat import orbax as compat
from orbax_pathways.fleet import node_copy
from orbax_pathways.format import names as format_names
from orbax_pathways.format import records as records_lib
from orbax_pathways.multitier import node_layout
from orbax_pathways.peer import exchange
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import node_parts
from orbax_pathways.sharding import layout
from orbax_pathways.storage import meta_io
from orbax_pathways.tier import fsafe

log = logging.getLogger('orbax_pathways')

GATHER_SUFFIX = '.gather'
_WRITER_RECORD = re.compile(r'^p\d+' + re.escape(format_names.PATHWAYS_SUFFIX) + '$')
INDEX = records_lib.INDEX_FILENAME
_OCDBT_PREFIX = 'ocdbt.process_'
_ZARRAY = '.zarray'
_ZARR_CHUNK = re.compile(r'^\d+(\.\d+)*$')  # a zarr v2 chunk file ('.' separator)


def _committed(step_dir: str) -> bool:
  """Whether the node step (or copy) at ``step_dir`` is whole: Orbax's commit marker is there
  (a save or a deletion killed midway leaves a directory without it)."""
  return fsafe.exists(os.path.join(step_dir, format_names.COMMIT_SUCCESS_FILE))


def parts_here(root: str, digest: str, step: int) -> dict[int, str]:
  """Writer -> the directory of its part of node step ``step`` on this node, committed: the
  step saved in this node's node steps (by whichever process), and the partner copies it
  keeps."""
  found: dict[int, str] = {}
  saved = os.path.join(root, format_names.NODE_STEPS_DIR, digest, str(step))
  if fsafe.is_dir(saved) and _committed(saved):
    saver = node_layout.saver(saved)
    if saver is not None:
      found[saver] = saved
  copies = node_layout.copies_dir(root, digest)
  for writer in fsafe.subdirs(copies):
    path = os.path.join(copies, writer, str(step))
    if (writer.startswith('p') and writer[1:].isdigit() and fsafe.is_dir(path)
        and _committed(path)):
      found.setdefault(int(writer[1:]), path)
  return found


def _is_metadata(rel: str) -> bool:
  """Whether a part's file (relative path) is metadata: anything but its arrays' bytes (its
  OCDBT trees, or its zarr chunk files)."""
  parts = rel.split('/')
  return not ((len(parts) > 1 and _is_ocdbt(parts[1]))
              or (len(parts) == 3 and _ZARR_CHUNK.match(parts[2]) is not None))


def _is_ocdbt(name: str) -> bool:
  """Whether ``name`` in an item directory is of its OCDBT trees (the merged tree's manifest
  and nodes, or a process's tree), not of its Orbax metadata or records."""
  return name in ('d', 'manifest.ocdbt') or name.startswith(_OCDBT_PREFIX)


def _zarr_arrays(item_dir: str) -> list[str]:
  """The arrays of an item saved without OCDBT: its directories holding a ``.zarray``."""
  return [n for n in fsafe.subdirs(item_dir)
          if fsafe.exists(os.path.join(item_dir, n, _ZARRAY))]


def _item_of(step_dir: str, item: str | None, step: int) -> str:
  name = node_layout.tree_item(step_dir, item)
  if name is None:
    raise ValueError(f'node step {step} holds the items {fsafe.subdirs(step_dir)}: a restore '
                     'onto another layout takes a step of one tree'
                     f'{"" if item is None else f" ({item!r})"}')
  return name


def _layout(record: records_lib.ShardingRecord | None) -> node_parts.SavedLayout:
  if record is None or record.kind != 'named':
    return node_parts.UNKNOWN
  return node_parts.SavedLayout(tuple(record.mesh_shape), tuple(record.axis_names),
                                tuple(record.device_ids), tuple(record.spec))


def _plan(abstract_state: Any, item_dir: str, step: int
          ) -> list[tuple[node_parts.SavedLayout | None, tuple[int, ...], list[boxes_lib.Box]]]:
  """Per leaf of ``abstract_state``: its saved layout (None: a numpy or scalar leaf, which
  every part holds), shape, and the boxes this process's devices hold of it now (a leaf with
  no sharding: the whole array)."""
  saved = meta_io.read_item(item_dir)
  if saved is None:
    raise ValueError(f'node step {step} at {item_dir} has no orbax-pathways records')
  arrays = saved.arrays()
  names = jax.tree.leaves(compat.param_names(abstract_state))
  out: list[tuple[node_parts.SavedLayout | None, tuple[int, ...], list[boxes_lib.Box]]] = []
  for leaf, name in zip(jax.tree.leaves(abstract_state), names):
    record = arrays.get(name)
    if record is None:
      raise ValueError(f'array {name!r} is not in node step {step} ({item_dir}): the restore '
                       f'asks for it; the step holds {sorted(arrays)[:8]}')
    shape = tuple(record.shape)
    sharding = getattr(leaf, 'sharding', None)
    if isinstance(sharding, jax.sharding.Sharding):
      boxes = list(layout.device_boxes(sharding, shape, addressable_only=True).values())
    else:
      boxes = [boxes_lib.Box.full(shape)]
    host_leaf = record.sharding is None and not any(c.writer.startswith('p')
                                                    for c in record.chunks)
    out.append((None if host_leaf else _layout(record.sharding), shape, boxes))
  return out


def _link_file(src: str, dst: str) -> None:
  """A hard link at ``dst`` to the regular file ``src`` (a node's files, one file system),
  else a ``0600`` copy; never through a symlink."""
  with fsafe.open_regular(src):
    pass
  try:
    os.link(src, dst, follow_symlinks=False)
  except OSError as e:
    if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
      raise
    shutil.copyfile(src, dst, follow_symlinks=False)
    os.chmod(dst, fsafe.FILE_MODE)


def _link_tree(src: str, dst: str) -> None:
  """``src``'s files into the new directory ``dst`` (``_link_file``)."""
  os.mkdir(dst, fsafe.DIR_MODE)
  for name in fsafe.names(src):
    s, d = os.path.join(src, name), os.path.join(dst, name)
    if fsafe.is_dir(s):
      _link_tree(s, d)
    else:
      _link_file(s, d)


def assemble(base: str, parts: Mapping[int, str], item: str, into: str) -> None:
  """One Orbax step at ``into`` (new) from the parts of a node step: the step's and the item's
  metadata from ``base`` (any part, or its metadata alone), each part's arrays and record from
  ``parts`` (writer -> part directory). A part saved without OCDBT (each chunk a file of its
  own) gives its chunk files, each linked once (a chunk several processes held, replicated, is
  the same bytes in each part, and the records check whichever is read); a part saved as OCDBT
  (as older versions saved node steps) gives its tree, the trees then merged into the item's."""
  os.mkdir(into, fsafe.DIR_MODE)
  for name in fsafe.names(base):
    if name != item and not fsafe.is_dir(os.path.join(base, name)):
      _link_file(os.path.join(base, name), os.path.join(into, name))
  src_item, item_dir = os.path.join(base, item), os.path.join(into, item)
  os.mkdir(item_dir, fsafe.DIR_MODE)
  arrays = set(_zarr_arrays(src_item))
  for name in fsafe.names(src_item):
    path = os.path.join(src_item, name)
    if _is_ocdbt(name):
      continue
    if name == format_names.PATHWAYS_DIR:
      os.mkdir(os.path.join(item_dir, name), fsafe.DIR_MODE)
      for rec in fsafe.names(path):  # the numpy leaves' records; the writers' come with them
        if not _WRITER_RECORD.match(rec) and rec != INDEX:
          _link_file(os.path.join(path, rec), os.path.join(item_dir, name, rec))
    elif name in arrays:  # its zarr metadata here; its chunks come with the parts
      os.mkdir(os.path.join(item_dir, name), fsafe.DIR_MODE)
      for f in fsafe.names(path):
        if _ZARR_CHUNK.match(f) is None:
          _link_file(os.path.join(path, f), os.path.join(item_dir, name, f))
    elif fsafe.is_dir(path):
      _link_tree(path, os.path.join(item_dir, name))
    else:
      _link_file(path, os.path.join(item_dir, name))
  ocdbt = None
  for writer, part in sorted(parts.items()):
    part_item = os.path.join(part, item)
    trees = [n for n in fsafe.subdirs(part_item) if n.startswith(_OCDBT_PREFIX)]
    record = node_copy.writer_name(writer) + format_names.PATHWAYS_SUFFIX
    has_record = record in fsafe.names(os.path.join(part_item, format_names.PATHWAYS_DIR))
    held = sorted(set(_zarr_arrays(part_item)) & arrays)
    if not has_record or len(trees) > 1 or (trees and held) or (not trees and not held):
      raise ValueError(f'{part_item} is not process {writer}\'s part of a node step: it holds '
                       f'the OCDBT trees {trees}, the arrays {held[:4]} of the step\'s '
                       f'{len(arrays)}, and {"a" if has_record else "no"} {record}')
    if ocdbt is not None and ocdbt != bool(trees):
      raise ValueError(f'{part_item}: the parts of node step {into} mix OCDBT and zarr files')
    ocdbt = bool(trees)
    if trees:
      _link_tree(os.path.join(part_item, trees[0]), os.path.join(item_dir, trees[0]))
    for name in held:
      for f in fsafe.names(os.path.join(part_item, name)):
        dst = os.path.join(item_dir, name, f)
        if _ZARR_CHUNK.match(f) is not None and not fsafe.exists(dst):
          _link_file(os.path.join(part_item, name, f), dst)
    _link_file(os.path.join(part_item, format_names.PATHWAYS_DIR, record),
               os.path.join(item_dir, format_names.PATHWAYS_DIR, record))
  if ocdbt:
    compat.merge_ocdbt(item_dir)


def restore(root: str, digest: str, step: int, holders: Callable[[int], tuple[int, str] | None],
            first: int | None, abstract_state: Any, item: str | None, timeout_s: float,
            restore_from: Callable[[str], Any],
            others: Callable[[int, int | None], tuple[int, str] | None] | None = None) -> Any:
  """Node step ``step`` restored as ``abstract_state`` onto this process's devices from the
  parts it needs (module docstring): ``holders(process)`` is the process whose node holds that
  saving process's part and that server's address (None: no live node), asked only for the
  parts this node lacks; ``first`` a saving process whose part some live node holds (the
  step's metadata, where this node holds no part); ``restore_from(directory)`` restores step
  ``step`` of the Orbax step directory ``directory`` (the node steps' handlers). Where the
  fetches or the restore fail (a damaged part: a chunk's checksum, a tree unreadable) and
  ``others(process, than)`` names another holder of a part used (a part is held as saved and
  as its partner's copy; ``than``: the process that served it, None for this node), those
  parts are fetched from there and the step is joined and restored once more. Raises why not
  (a part nobody holds, a fetch that failed, a box no part covers, the second try failing)."""
  here = parts_here(root, digest, step)
  scratch = os.path.join(root, format_names.NODE_STEPS_DIR, digest + GATHER_SUFFIX)
  fsafe.remove_tree(scratch)  # what an earlier restore left when its process was killed
  work = os.path.join(fsafe.private_dirs(root, format_names.NODE_STEPS_DIR,
                                         digest + GATHER_SUFFIX), str(step))
  os.mkdir(work, fsafe.DIR_MODE)
  secret: list[bytes] = []

  def fetch(writer: str, into: str, only: Callable[[str], bool] | None = None,
            holder: tuple[int, str] | None = None) -> None:
    holder = holder or holders(int(writer[1:]))
    if holder is None:
      raise LookupError(f'no live node holds process {writer[1:]}\'s part of node step {step}')
    if not secret:
      secret.append(exchange.job_secret(jax_distributed.distributed_client(), timeout_s))
    why = node_copy.fetch(holder[1], secret[0], digest, writer, step, into, timeout_s, only)
    if why is not None:
      raise RuntimeError(f'orbax_pathways: process {writer[1:]}\'s part of node step {step} '
                         f'could not be fetched from process {holder[0]} ({holder[1]}): {why}')

  def join_and_restore(parts: Mapping[int, str], name: str, meta: str, into: str) -> Any:
    merged = os.path.join(work, into)
    os.mkdir(merged, fsafe.DIR_MODE)
    assemble(meta, parts, name, os.path.join(merged, str(step)))
    return restore_from(merged)

  try:
    # The step's metadata: from a part this node holds that says its layout (a part whose
    # process was killed before writing it does not), else fetched from a node holding one.
    meta = next((here[w] for w in sorted(here)
                 if node_layout.read_processes(here[w]) is not None), None)
    if meta is None and first is not None:
      meta = os.path.join(work, 'metadata')
      fetch(node_copy.writer_name(first), meta, _is_metadata)
    elif meta is None:
      raise LookupError(f'no node holds a part of node step {step}')
    saved = node_layout.read_processes(meta)
    if saved is None:
      raise ValueError(f'node step {step} at {meta} does not say which process saved which '
                       f'device ({format_names.NODE_PROCESSES_FILE}): it restores onto its '
                       'own layout only')
    count, runs = saved
    name = _item_of(meta, item, step)
    need = node_parts.needed(_plan(abstract_state, os.path.join(meta, name), step), runs,
                             count, local=set(here),
                             live=lambda w: w in here or holders(w) is not None)
    lost = sorted(w for w in need if w not in here and holders(w) is None)
    if lost:
      raise LookupError(f'node step {step}: the parts of processes {lost} hold shards this '
                        f'process\'s devices need now, and no live node holds them')
    parts: dict[int, str] = {}
    served: dict[int, int | None] = {}  # writer -> the process whose node gave it (None: here)

    def gather(writers: list[int], suffix: str, alternates: Mapping[int, tuple[int, str]]):
      for writer in writers:
        if writer in alternates:  # the second try: from the other node holding it
          holder: tuple[int, str] | None = alternates[writer]
        elif writer in here and not suffix:
          parts[writer], served[writer] = here[writer], None
          continue
        else:
          holder = holders(writer)
        parts[writer] = os.path.join(work, node_copy.writer_name(writer) + suffix)
        served[writer] = None if holder is None else holder[0]
        fetch(node_copy.writer_name(writer), parts[writer], holder=holder)

    try:
      gather(sorted(need), '', {})
      state = join_and_restore(parts, name, meta, 'merged')
    except Exception as e:  # pylint: disable=broad-except  (tried once more from other holders)
      again = {w: h for w in served
               if (h := others(w, served[w]) if others is not None else None) is not None}
      if not again:
        raise
      log.warning('orbax_pathways.preemption.resume: node step %d failed to restore onto this '
                  'layout from the parts of processes %s (%s: %s); fetching %s from the other '
                  'nodes holding them.', step, sorted(need), type(e).__name__, str(e)[:300],
                  ', '.join(f'process {w}\'s part from process {h[0]}'
                            for w, h in sorted(again.items())))
      # The parts with another holder from there; the rest as before (those the first try
      # fetched whole are kept; one it had not reached yet is fetched now).
      unfetched = [w for w in sorted(need) if w not in served]
      gather(sorted(again), '.again', again)
      gather(unfetched, '', {})
      state = join_and_restore(parts, name, meta, 'merged.again')
    log.info('orbax_pathways.preemption.resume: node step %d restored onto this layout from '
             'the parts of processes %s (%d fetched from other nodes).', step, sorted(need),
             sum(1 for w in need if w not in here))
    return state
  finally:
    fsafe.remove_tree(scratch)
