"""Text and JSON output of every command, and verify's progress bar. No I/O besides the streams.

Called by ``cli.main`` after a command has computed its result (``steps``, ``verify``, ``diff``,
``du``); the JSON keys are listed in ``cli.main``'s docstring.
"""

from __future__ import annotations

import time
from typing import Any, Sequence, TextIO

from orbax_pathways.cli.model import CHECKSUM, CORRUPT, LOCAL_ONLY, TIER_ONLY, Item, Leaf, Step
from orbax_pathways.format.names import LOCAL_STEPS_DIR


def human_bytes(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024
  raise AssertionError


_H = human_bytes


WIDEST = 64  # a longer cell does not widen its column (it gets its own line instead)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = '') -> str:
  """Columns as wide as their widest cell up to ``WIDEST``. A longer first cell (a 300-character
  key) is printed alone on its line and its row continues below it; a longer cell elsewhere
  just pushes the rest of its own row right. No column pads every row to one long cell."""
  cells = [[str(c) for c in headers]] + [['-' if c is None else str(c) for c in r] for r in rows]
  widths = [max([len(r[i]) for r in cells if len(r[i]) <= WIDEST] or [len(cells[0][i])])
            for i in range(len(headers))]
  lines = []
  for r in cells:
    if len(r[0]) > widths[0]:
      lines.append(indent + r[0])
      r = [''] + r[1:]
    lines.append(indent + '  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
  return '\n'.join(lines)


def step_label(step: int | None) -> str:
  """``step N``; a checkpoint saved without a step number (``ocp.v1.save(path, tree)``, a bare
  ``Checkpointer``) is a ``single checkpoint``."""
  return 'single checkpoint (no step number)' if step is None else f'step {step}'


def shape(s) -> str | None:
  if s is None:
    return None
  return '(' + ', '.join(str(n) for n in s) + (',)' if len(s) == 1 else ')')


class Progress:
  """A one-line progress bar with throughput on a stream (stderr); silent when disabled."""

  def __init__(self, *, stream: TextIO, enabled: bool):
    self.stream, self.enabled = stream, enabled
    self.total_bytes = self.total_chunks = self.bytes = self.chunks = 0
    self.start_time = self._last = time.monotonic()

  def start(self, total_bytes: int, total_chunks: int) -> None:
    self.total_bytes, self.total_chunks = total_bytes, total_chunks
    self.start_time = self._last = time.monotonic()

  def advance(self, nbytes: int) -> None:
    self.bytes += nbytes
    self.chunks += 1
    now = time.monotonic()
    if self.enabled and now - self._last > 0.1:
      self._last = now
      self.stream.write('\r' + self.line())
      self.stream.flush()

  def line(self) -> str:
    elapsed = max(time.monotonic() - self.start_time, 1e-9)
    frac = self.bytes / self.total_bytes if self.total_bytes else 1.0
    bar = '#' * int(frac * 24)
    return (
        f'verify [{bar:<24}] {frac:4.0%} {_H(self.bytes)}/{_H(self.total_bytes)}'
        f' {_H(self.bytes / elapsed)}/s chunks {self.chunks}/{self.total_chunks}'
    )

  def close(self) -> None:
    if self.enabled:
      self.stream.write('\r' + self.line() + '\n')
      self.stream.flush()


# ---- ls --------------------------------------------------------------------------------------


def ls_text(steps: Sequence[Step], local_only: Sequence[int] = (), root: Any = None) -> str:
  rows, notes = [], []
  for s in steps:
    slices, devices = s.saved_with()
    assert s.bytes is not None, 'cmd_ls sizes every step before rendering it'
    rows.append([s.step, s.state, s.commit_time, _H(s.bytes), s.num_arrays, slices, devices,
                 s.name])
    if s.state == CORRUPT:
      notes += [f'step {s.step}: {p}' for p in s.problems]
  text = table(['STEP', 'STATE', 'COMMITTED', 'SIZE', 'ARRAYS', 'SLICES', 'DEVICES', 'NAME'],
               rows)
  if local_only:
    notes.append(f'local-only steps (array bytes in node-local tiers): '
                 f'{", ".join(map(str, local_only))}; `orbax-pathways ls '
                 f'{root}/{LOCAL_STEPS_DIR}` lists them')
  if notes:
    text += '\n\n' + '\n'.join(notes)
  return text


def ls_json(s: Step) -> dict[str, Any]:
  slices, devices = s.saved_with()
  return {
      'step': s.step, 'name': s.name, 'path': str(s.path), 'state': s.state,
      'problems': s.problems, 'commit_time': s.commit_time, 'commit_timestamp_nsecs': s.commit_ns,
      'bytes': s.bytes, 'arrays': s.num_arrays, 'slices': slices, 'devices': devices,
      'items': [i.name for i in s.items],
      'transports': sorted({t for i in s.items for t in i.transports}),
  }


# ---- show ------------------------------------------------------------------------------------


def show(step: Step, on_disk: int) -> tuple[dict[str, Any], str]:
  lines = [f'{step.path}  {step_label(step.step)}  {step.state}'
           f'  committed {step.commit_time or "-"}  {_H(on_disk)} on disk']
  lines += [f'! {p}' for p in step.problems]
  for item in step.items:
    lines += [''] + _show_item(item)
  n_arrays = sum(len(i.arrays) for i in step.items)
  logical = sum(l.nbytes or 0 for i in step.items for l in i.arrays)
  lines += ['', f'total: {n_arrays} arrays, {_H(logical)} logical, {_H(on_disk)} on disk']
  obj = {
      'path': str(step.path), 'step': step.step, 'name': step.name, 'state': step.state,
      'commit_time': step.commit_time, 'problems': step.problems,
      'items': [_item_json(i) for i in step.items],
      'totals': {'arrays': n_arrays, 'bytes': logical, 'bytes_on_disk': on_disk},
  }
  return obj, '\n'.join(lines)


def _show_item(item: Item) -> list[str]:
  fmt_ = ('zarr3' if item.use_zarr3 else 'zarr v2') + (' in OCDBT' if item.use_ocdbt else '')
  if item.tree_error:
    fmt_ = 'tree unreadable' + (', OCDBT' if item.use_ocdbt else '')
  head = f'item {item.name}  [{fmt_ if item.kind == "pytree" else "not a pytree item"}]'
  if item.pathways is not None:
    n = len(item.pathways.writers)
    what = 'writer' if item.pathways.source == 'index' else 'writer file'
    head += f'  written by {item.writer} ({n} {what}{"" if n == 1 else "s"})'
  else:
    head += '  written by stock orbax (orbax-pathways metadata absent: no transport, ' \
            'slices or chunk checksums)'
  lines = [head] + [f'  ! {p}' for p in item.problems]
  rows = []
  for l in item.leaves:
    shard = l.sharding.describe() + f' [{l.sharding.source}]' if l.sharding else None
    rows.append([l.key, l.value_type, l.dtype, shape(l.shape), _H(l.nbytes) if l.is_array and
                 l.nbytes is not None else None, shape(l.chunk_shape), shard])
  if rows:
    lines.append(table(['KEY', 'TYPE', 'DTYPE', 'SHAPE', 'BYTES', 'CHUNK', 'SHARDING'], rows,
                       indent='  '))
  lines += [f'  ! {l.key}: {l.error}' for l in item.leaves if l.error]
  t = _item_totals(item)
  lines.append(f'  {t["leaves"]} leaves, {t["arrays"]} arrays, {_H(t["bytes"])} logical')
  return lines


def _item_totals(item: Item) -> dict[str, int]:
  return {'leaves': len(item.leaves), 'arrays': len(item.arrays),
          'bytes': sum(l.nbytes or 0 for l in item.arrays)}


def _item_json(item: Item) -> dict[str, Any]:
  return {
      'name': item.name, 'path': str(item.path), 'kind': item.kind, 'handler': item.handler,
      'ocdbt': item.use_ocdbt, 'zarr3': item.use_zarr3, 'writer': item.writer,
      'pathways_metadata': item.pathways is not None, 'transports': item.transports,
      'problems': item.problems, 'leaves': [_leaf_json(l) for l in item.leaves],
      'totals': _item_totals(item),
  }


def _leaf_json(l: Leaf) -> dict[str, Any]:
  pw = None
  if l.record is not None:
    pw = {'chunks': len(l.record.chunks), 'chunk_nbytes': l.chunk_nbytes,
          'chunk_shape': list(l.record.chunk_shape)}
  return {
      'key': l.key, 'keypath': list(l.keypath), 'value_type': l.value_type, 'dtype': l.dtype,
      'shape': None if l.shape is None else list(l.shape),
      'bytes': l.nbytes if l.is_array else None,
      'chunk_shape': None if l.chunk_shape is None else list(l.chunk_shape),
      'sharding': l.sharding.to_json() if l.sharding else None, 'pathways': pw,
      'error': l.error,
  }


# ---- verify ----------------------------------------------------------------------------------


def verify_text(report) -> str:
  lines = [f'{report.path}  {step_label(report.step)}  {report.state}']
  for item, mode in report.modes.items():
    how = 'crc32c of every recorded chunk' if mode == CHECKSUM else \
        'decode only (no orbax-pathways checksums)'
    lines.append(f'  item {item}: {how}')
  lines += [p.describe() for p in report.problems]
  lines += [f'{"unchecked":<14} {u.item} {u.key}: {u.reason}' for u in report.unchecked]
  summary = (f'{report.arrays} arrays, {report.chunks} chunks ({report.chunks_checksummed} '
             f'checksummed), {_H(report.bytes_read)} in {report.seconds:.2f} s')
  n, m = len(report.problems), len(report.unchecked)
  k = sum(1 for u in report.unchecked if u.reason == LOCAL_ONLY)
  parts = [f'{m - k} value{"" if m - k == 1 else "s"} without a checksum (decoded only)'] \
      if m - k else []
  if k:  # a local-only step's arrays: checked by `orbax-pathways tier` on each node
    parts.append(f'{k} array{"" if k == 1 else "s"} in node-local tiers only (not checked here)')
  unchecked = '; '.join(parts) + '; ' if parts else ''
  verdict = {'ok': 'OK: ', 'unchecked': f'UNCHECKED: no damage found, but {unchecked}',
             'failed': f'FAILED: {n} problem{"" if n == 1 else "s"}; {unchecked}'}
  lines.append(verdict[report.verdict] + summary)
  return '\n'.join(lines)


# ---- diff ------------------------------------------------------------------------------------


def diff_text(obj: dict[str, Any]) -> str:
  lines = [f'a: {obj["a"]}', f'b: {obj["b"]}']
  for sign, entries in (('+', obj['added']), ('-', obj['removed'])):
    for e in entries:
      lines.append(f'{sign} {e["item"]}/{e["key"]}  {e["dtype"] or e["value_type"]} '
                   f'{shape(e["shape"]) or ""}'.rstrip())
  for e in obj['changed']:
    parts = [f'{f}: {v[0]} -> {v[1]}' for f, v in e['changes'].items() if f != 'values']
    if e['max_abs_diff'] is not None:
      parts.append(f'max abs diff {e["max_abs_diff"]:.6g}')
    elif e.get('chunks_differing'):
      n, m = e['chunks_differing']
      parts.append(f'values differ (recorded crc32c of {n} of {m} chunks)')
    elif 'values' in e['changes']:
      parts.append(f'values {e["changes"]["values"]}')
    lines.append(f'~ {e["item"]}/{e["key"]}  ' + '; '.join(parts))
  c = obj['compared']
  skipped = c['values_not_compared']
  read = c.get('values_read', [])
  by_crc = c['values_by_crc32c']
  how = ('values read and compared (--values)' + (
             f'; of {by_crc} array{"" if by_crc == 1 else "s"} of a local-only step by recorded '
             'crc32c (their bytes are in node-local tiers)' if by_crc else '')
         if c['values'] == 'read' else
         f'values of {c["values_by_crc32c"]} array{"" if c["values_by_crc32c"] == 1 else "s"} '
         'by recorded crc32c' + (
             f', of {len(read)} read and compared (their chunk grids differ: '
             f'{", ".join(read[:4])}{" ..." if len(read) > 4 else ""})' if read else
             ' (no data read)'))
  lines.append(f'compared: tree, value types, dtypes, shapes, shardings; {how}')
  if skipped:
    why = c.get('values_not_compared_why') or {}
    counts: dict[str, int] = {}
    for name in skipped:
      reason = why.get(name) or 'no checksums to compare'
      counts[reason] = counts.get(reason, 0) + 1
    reasons = (next(iter(counts)) if len(counts) == 1 else
               '; '.join(f'{r}: {n}' for r, n in counts.items()))
    lines.append(f'values not compared ({len(skipped)}): {", ".join(skipped[:8])}'
                 f'{" ..." if len(skipped) > 8 else ""}'
                 + (f' ({reasons})' if c['values'] == 'read' or all(
                     r.startswith(TIER_ONLY) for r in counts) else
                    f' ({reasons}; --values reads them)'))
  if not obj['identical']:
    lines.append(f'{len(obj["added"])} added, {len(obj["removed"])} removed, '
                 f'{len(obj["changed"])} changed, {obj["unchanged"]} unchanged')
  elif skipped:
    lines.append(f'no differences found; values of {len(skipped)} '
                 f'lea{"f" if len(skipped) == 1 else "ves"} not compared')
  else:
    lines.append('identical')
  return '\n'.join(lines)


# ---- du --------------------------------------------------------------------------------------


def du_text(obj: dict[str, Any]) -> str:
  lines = []
  for s in obj['steps']:
    lines.append(f'{_H(s["bytes"]):>10}  {step_label(s["step"])}  {s["state"]}  ({s["name"]})')
    for i in s['items']:
      for k in i['keys']:
        lines.append(f'{_H(k["bytes"]):>10}    {i["item"]}/{k["key"]}  ({k["basis"]})')
  lines.append(f'{_H(obj["bytes"]):>10}  total on disk')
  lines.append('key sizes: "chunks" = raw bytes of the chunks recorded in orbax-pathways '
               'metadata; "logical" = dtype size x shape (stored sizes unknown).')
  return '\n'.join(lines)
