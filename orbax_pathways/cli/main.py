"""``orbax-pathways``: inspect Orbax checkpoints (with or without orbax-pathways metadata).

Commands (every one takes ``--json``; tables otherwise):
  ls DIR                     every step: state, commit time, size, arrays, saved slices/devices.
  show DIR/STEP | DIR --step N
                             per item the tree: key, dtype, shape, bytes, chunk, sharding; totals;
                             the transport that wrote it ("stock orbax" without our metadata).
  verify DIR/STEP | DIR --step N
                             reads every chunk; crc32c against our metadata, else decode-only.
  diff DIR/A DIR/B [--values]
                             added / removed / changed leaves (shape, dtype, sharding, values).
  du DIR | DIR/STEP          bytes on disk per step; per top-level key: recorded chunk bytes
                             (basis "chunks", from our metadata) or dtype x shape ("logical").

Exit codes: 0 ok; 1 verify found problems / diff found differences; 2 user error (bad path,
missing step, no credentials: one line on stderr, no traceback); 130 interrupted.

JSON output (top-level keys; ``bytes`` are integers, times ISO-8601 UTC):
  ls      {path, steps: [{step, name, path, state, problems, commit_time, commit_timestamp_nsecs,
           bytes, arrays, slices, devices, items, transports}]}
  show    {path, step, name, state, commit_time, problems, items: [{name, path, kind, handler,
           ocdbt, zarr3, writer, pathways_metadata, transports, leaves: [{key, value_type,
           dtype, shape, bytes, chunk_shape, sharding, pathways, error}], totals}], totals}
  verify  {path, step, state, ok, modes, arrays, chunks, chunks_checksummed, bytes_read,
           seconds, problems: [{kind, path, item, array, origin, expected_crc32c,
           found_crc32c, error}]}
  diff    {a, b, values_compared, identical, added, removed, changed: [{item, key, changes,
           max_abs_diff}], unchanged}
  du      {path, bytes, steps: [{step, name, state, bytes, items: [{item, keys: [{key, bytes,
           basis}]}]}]}
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Sequence, TextIO

from orbax_pathways.cli import arrays
from orbax_pathways.cli import inspect
from orbax_pathways.cli import verify as verify_lib

PROG = 'orbax-pathways'
_H = verify_lib.human_bytes


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the CLI; returns the exit code (the console script exits with it)."""
  if 'jax' not in sys.modules:  # Never initialize an accelerator from the CLI.
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  _quiet_storage_loggers()
  parser = _parser()
  try:
    args = parser.parse_args(argv)
  except SystemExit as e:  # argparse: usage errors exit 2, --help exits 0.
    return int(e.code or 0)
  try:
    return args.func(args, sys.stdout)
  except inspect.CliError as e:
    print(f'{PROG}: error: {e}', file=sys.stderr)
    return 2
  except PermissionError as e:
    print(f'{PROG}: error: permission denied: {e.filename or e}', file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f'{PROG}: interrupted', file=sys.stderr)
    return 130
  except BrokenPipeError:
    return 1


def _quiet_storage_loggers() -> None:
  """gcsfs / google-auth log retries with tracebacks; the CLI reports failures in one line."""
  for name in ('gcsfs', 'fsspec', 'google.auth', 'google_auth_httplib2'):
    logging.getLogger(name).setLevel(logging.CRITICAL)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=PROG, description='Inspect and verify Orbax checkpoints.')
  sub = p.add_subparsers(dest='command', required=True, metavar='COMMAND')

  def cmd(name, func, help_):
    s = sub.add_parser(name, help=help_, description=help_)
    s.add_argument('--json', action='store_true', help='print JSON instead of a table')
    s.set_defaults(func=func)
    return s

  s = cmd('ls', cmd_ls, 'list the steps of a checkpoint directory')
  s.add_argument('dir', help='directory given to ocp.CheckpointManager (local or gs://)')
  for name, func, help_ in (('show', cmd_show, 'show the tree of one step'),
                            ('verify', cmd_verify, 'read and check every chunk of one step')):
    s = cmd(name, func, help_)
    s.add_argument('path', help='DIR/STEP, or DIR with --step N')
    s.add_argument('--step', type=int, help='step number inside DIR')
  s.add_argument('--progress', action=argparse.BooleanOptionalAction, default=None,
                 help='progress bar on stderr (default: when stderr is a terminal)')
  s = cmd('diff', cmd_diff, 'compare the trees of two steps')
  s.add_argument('a', help='first step: DIR/STEP')
  s.add_argument('b', help='second step: DIR/STEP')
  s.add_argument('--values', action='store_true', help='also read both and compare values')
  s = cmd('du', cmd_du, 'bytes per step and per top-level key')
  s.add_argument('path', help='checkpoint directory, or one step DIR/STEP')
  return p


def _emit(out: TextIO, args, obj: dict[str, Any], text: str) -> None:
  if args.json:
    json.dump(obj, out, indent=2, sort_keys=False)
    out.write('\n')
  else:
    out.write(text if text.endswith('\n') else text + '\n')


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = '') -> str:
  cells = [[str(c) for c in headers]] + [['-' if c is None else str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
  return '\n'.join(
      indent + '  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells
  )


def _shape(shape) -> str | None:
  if shape is None:
    return None
  return '(' + ', '.join(str(n) for n in shape) + (',)' if len(shape) == 1 else ')')


# ----------------------------------------------------------------------------------------------
# ls


def cmd_ls(args, out: TextIO) -> int:
  root = inspect.to_path(args.dir)
  steps = [inspect.read_step(d) for d in inspect.list_step_dirs(root)]
  for s in steps:
    s.bytes = inspect.dir_size(s.path)
  rows, notes = [], []
  for s in steps:
    slices, devices = s.saved_with()
    rows.append([s.step, s.state, s.commit_time, _H(s.bytes), s.num_arrays, slices, devices,
                 s.name])
    if s.state == inspect.CORRUPT:
      notes += [f'step {s.step}: {p}' for p in s.problems]
  text = table(['STEP', 'STATE', 'COMMITTED', 'SIZE', 'ARRAYS', 'SLICES', 'DEVICES', 'NAME'],
               rows)
  if notes:
    text += '\n\n' + '\n'.join(notes)
  _emit(out, args, {'path': str(root), 'steps': [_ls_json(s) for s in steps]}, text)
  return 0


def _ls_json(s: inspect.Step) -> dict[str, Any]:
  slices, devices = s.saved_with()
  return {
      'step': s.step, 'name': s.name, 'path': str(s.path), 'state': s.state,
      'problems': s.problems, 'commit_time': s.commit_time, 'commit_timestamp_nsecs': s.commit_ns,
      'bytes': s.bytes, 'arrays': s.num_arrays, 'slices': slices, 'devices': devices,
      'items': [i.name for i in s.items],
      'transports': sorted({t for i in s.items for t in i.transports}),
  }


# ----------------------------------------------------------------------------------------------
# show


def cmd_show(args, out: TextIO) -> int:
  step = inspect.read_step(inspect.resolve_step(args.path, args.step), open_arrays=True)
  on_disk = inspect.dir_size(step.path)
  lines = [f'{step.path}  step {step.step}  {step.state}'
           f'  committed {step.commit_time or "-"}  {_H(on_disk)} on disk']
  lines += [f'! {p}' for p in step.problems]
  for item in step.items:
    lines += [''] + _show_item(item)
  arrays = sum(len(i.arrays) for i in step.items)
  logical = sum(l.nbytes or 0 for i in step.items for l in i.arrays)
  lines += ['', f'total: {arrays} arrays, {_H(logical)} logical, {_H(on_disk)} on disk']
  obj = {
      'path': str(step.path), 'step': step.step, 'name': step.name, 'state': step.state,
      'commit_time': step.commit_time, 'problems': step.problems,
      'items': [_item_json(i) for i in step.items],
      'totals': {'arrays': arrays, 'bytes': logical, 'bytes_on_disk': on_disk},
  }
  _emit(out, args, obj, '\n'.join(lines))
  return 0


def _show_item(item: inspect.Item) -> list[str]:
  fmt = ('zarr3' if item.use_zarr3 else 'zarr v2') + (' in OCDBT' if item.use_ocdbt else '')
  head = f'item {item.name}  [{fmt if item.kind == "pytree" else "not a pytree item"}]'
  if item.pathways is not None:
    n = len(item.pathways.writers)
    head += f'  written by {item.writer} ({n} writer file{"" if n == 1 else "s"})'
  else:
    head += '  written by stock orbax (orbax-pathways metadata absent: no transport, ' \
            'slices or chunk checksums)'
  lines = [head] + [f'  ! {p}' for p in item.problems]
  rows = []
  for l in item.leaves:
    shard = l.sharding.describe() + f' [{l.sharding.source}]' if l.sharding else None
    rows.append([l.key, l.value_type, l.dtype, _shape(l.shape), _H(l.nbytes) if l.is_array and
                 l.nbytes is not None else None, _shape(l.chunk_shape), shard])
  if rows:
    lines.append(table(['KEY', 'TYPE', 'DTYPE', 'SHAPE', 'BYTES', 'CHUNK', 'SHARDING'], rows,
                       indent='  '))
  lines += [f'  ! {l.key}: {l.error}' for l in item.leaves if l.error]
  t = _item_totals(item)
  lines.append(f'  {t["leaves"]} leaves, {t["arrays"]} arrays, {_H(t["bytes"])} logical')
  return lines


def _item_totals(item: inspect.Item) -> dict[str, int]:
  return {'leaves': len(item.leaves), 'arrays': len(item.arrays),
          'bytes': sum(l.nbytes or 0 for l in item.arrays)}


def _item_json(item: inspect.Item) -> dict[str, Any]:
  return {
      'name': item.name, 'path': str(item.path), 'kind': item.kind, 'handler': item.handler,
      'ocdbt': item.use_ocdbt, 'zarr3': item.use_zarr3, 'writer': item.writer,
      'pathways_metadata': item.pathways is not None, 'transports': item.transports,
      'problems': item.problems, 'leaves': [_leaf_json(l) for l in item.leaves],
      'totals': _item_totals(item),
  }


def _leaf_json(l: inspect.Leaf) -> dict[str, Any]:
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


# ----------------------------------------------------------------------------------------------
# verify


def cmd_verify(args, out: TextIO) -> int:
  report = verify_lib.verify_step(inspect.resolve_step(args.path, args.step),
                                  progress=args.progress)
  lines = [f'{report.path}  step {report.step}  {report.state}']
  for item, mode in report.modes.items():
    how = 'crc32c of every recorded chunk' if mode == verify_lib.CHECKSUM else \
        'decode only (no orbax-pathways checksums)'
    lines.append(f'  item {item}: {how}')
  lines += [p.describe() for p in report.problems]
  summary = (f'{report.arrays} arrays, {report.chunks} chunks ({report.chunks_checksummed} '
             f'checksummed), {_H(report.bytes_read)} in {report.seconds:.2f} s')
  n = len(report.problems)
  lines.append(('OK: ' if report.ok else f'FAILED: {n} problem{"" if n == 1 else "s"}; ') + summary)
  _emit(out, args, report.to_json(), '\n'.join(lines))
  return 0 if report.ok else 1


# ----------------------------------------------------------------------------------------------
# diff


def cmd_diff(args, out: TextIO) -> int:
  a = inspect.read_step(inspect.resolve_step(args.a), open_arrays=True)
  b = inspect.read_step(inspect.resolve_step(args.b), open_arrays=True)
  la, lb = _leaf_map(a), _leaf_map(b)
  added = [_brief(k, lb[k]) for k in sorted(set(lb) - set(la))]
  removed = [_brief(k, la[k]) for k in sorted(set(la) - set(lb))]
  changed, unchanged = [], 0
  for k in sorted(set(la) & set(lb)):
    entry = _compare(k, la[k], lb[k], values=args.values)
    if entry:
      changed.append(entry)
    else:
      unchanged += 1
  identical = not (added or removed or changed)
  obj = {'a': str(a.path), 'b': str(b.path), 'values_compared': args.values,
         'identical': identical, 'added': added, 'removed': removed, 'changed': changed,
         'unchanged': unchanged}
  _emit(out, args, obj, _diff_text(obj))
  return 0 if identical else 1


def _leaf_map(step: inspect.Step) -> dict[tuple[str, str], tuple[inspect.Item, inspect.Leaf]]:
  return {(i.name, l.key): (i, l) for i in step.items for l in i.leaves}


def _brief(k, il) -> dict[str, Any]:
  _, l = il
  return {'item': k[0], 'key': k[1], 'value_type': l.value_type, 'dtype': l.dtype,
          'shape': None if l.shape is None else list(l.shape)}


def _compare(k, a, b, *, values: bool) -> dict[str, Any] | None:
  (ia, la), (ib, lb) = a, b
  changes = {}
  for field in ('value_type', 'dtype', 'shape'):
    va, vb = getattr(la, field), getattr(lb, field)
    if va != vb:
      changes[field] = [list(va) if isinstance(va, tuple) else va,
                        list(vb) if isinstance(vb, tuple) else vb]
  sa = la.sharding.describe() if la.sharding else None
  sb = lb.sharding.describe() if lb.sharding else None
  if (la.sharding.key() if la.sharding else None) != (lb.sharding.key() if lb.sharding else None):
    changes['sharding'] = [sa, sb]
  max_abs = None
  if values and 'shape' not in changes:
    try:
      max_abs = arrays.max_abs_diff(ia, la, ib, lb)
    except Exception as e:  # pylint: disable=broad-except  # tensorstore read errors.
      changes['values'] = f'unreadable: {arrays.first_line(e)}'
    else:
      if max_abs is not None and max_abs != 0.0:
        changes['values'] = 'differ'
  if not changes:
    return None
  return {'item': k[0], 'key': k[1], 'changes': changes, 'max_abs_diff': max_abs}


def _diff_text(obj: dict[str, Any]) -> str:
  lines = [f'a: {obj["a"]}', f'b: {obj["b"]}']
  for sign, entries in (('+', obj['added']), ('-', obj['removed'])):
    for e in entries:
      lines.append(f'{sign} {e["item"]}/{e["key"]}  {e["dtype"] or e["value_type"]} '
                   f'{_shape(e["shape"]) or ""}'.rstrip())
  for e in obj['changed']:
    parts = [f'{f}: {v[0]} -> {v[1]}' for f, v in e['changes'].items() if f != 'values']
    if e['max_abs_diff'] is not None:
      parts.append(f'max abs diff {e["max_abs_diff"]:.6g}')
    elif 'values' in e['changes']:
      parts.append(f'values {e["changes"]["values"]}')
    lines.append(f'~ {e["item"]}/{e["key"]}  ' + '; '.join(parts))
  lines.append('identical' if obj['identical'] else
               f'{len(obj["added"])} added, {len(obj["removed"])} removed, '
               f'{len(obj["changed"])} changed, {obj["unchanged"]} unchanged')
  return '\n'.join(lines)


# ----------------------------------------------------------------------------------------------
# du


def cmd_du(args, out: TextIO) -> int:
  path = inspect.to_path(args.path)
  if inspect.path_exists(path) and inspect.looks_like_step(path):
    dirs = [path]
  else:
    dirs = inspect.list_step_dirs(path)
  steps = []
  for d in dirs:
    step = inspect.read_step(d, open_arrays=True)
    steps.append({'step': step.step, 'name': step.name, 'state': step.state,
                  'bytes': inspect.dir_size(step.path),
                  'items': [{'item': i.name, 'keys': _du_keys(i)} for i in step.items]})
  obj = {'path': str(path), 'bytes': sum(s['bytes'] for s in steps), 'steps': steps}
  _emit(out, args, obj, _du_text(obj))
  return 0


def _du_keys(item: inspect.Item) -> list[dict[str, Any]]:
  keys: dict[str, dict[str, Any]] = {}
  for l in item.arrays:
    top = l.keypath[0] if l.keypath else l.key
    chunk = l.chunk_nbytes
    basis = 'chunks' if chunk is not None else 'logical'
    e = keys.setdefault(top, {'key': top, 'bytes': 0, 'basis': basis})
    e['bytes'] += chunk if chunk is not None else (l.nbytes or 0)
    if e['basis'] != basis:
      e['basis'] = 'mixed'
  return list(keys.values())


def _du_text(obj: dict[str, Any]) -> str:
  lines = []
  for s in obj['steps']:
    lines.append(f'{_H(s["bytes"]):>10}  step {s["step"]}  {s["state"]}  ({s["name"]})')
    for i in s['items']:
      for k in i['keys']:
        lines.append(f'{_H(k["bytes"]):>10}    {i["item"]}/{k["key"]}  ({k["basis"]})')
  lines.append(f'{_H(obj["bytes"]):>10}  total on disk')
  lines.append('key sizes: "chunks" = raw bytes of the chunks recorded in orbax-pathways '
               'metadata; "logical" = dtype size x shape (stored sizes unknown).')
  return '\n'.join(lines)
