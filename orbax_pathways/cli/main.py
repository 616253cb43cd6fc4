"""``orbax-pathways``: inspect Orbax checkpoints (with or without orbax-pathways metadata).

This module parses arguments, runs one command and prints its result (``main(argv) -> exit
code``); the work is in ``steps``, ``arrays``, ``verify``, ``diff``, ``du``, the output in
``render``.

Commands (every one takes ``--json``; tables otherwise):
  ls DIR                     every step: state, commit time, size, arrays, saved slices/devices.
  show DIR/STEP | DIR --step N
                             per item the tree: key, dtype, shape, bytes, chunk, sharding; totals;
                             the transport that wrote it ("stock orbax" without our metadata).
  verify DIR/STEP | DIR --step N
                             reads every chunk from storage (never a node-local tier: a
                             restore the tier serves does not check storage; this does);
                             crc32c against our metadata, else decode-only.
  diff DIR/A DIR/B [--values]
                             added / removed / changed leaves (shape, dtype, sharding); values by
                             recorded crc32c, or read with --values; says what was compared.
  du DIR | DIR/STEP          bytes on disk per step; per top-level key: recorded chunk bytes
                             (basis "chunks", from our metadata) or dtype x shape ("logical").
  tier [TIER_DIR]           the steps this node's tier holds (default: ORBAX_PATHWAYS_TIER_DIR,
                             else /dev/shm), each checked against the committed step on storage:
                             ok, stale, damaged or incomplete (exit 1 unless all ok).
  tier [TIER_DIR] --gc [--dry-run] [--max-age-s S] [--max-bytes N]
                             drops entries (tier/gc.py): gone from storage or stale, idle
                             longer than the max age, incomplete, then the oldest while over
                             the size cap; lists them. Refuses (exit 2) a tier directory that
                             is not this user's or that other users can write into.

Exit codes: 0 ok; 1 verify found problems / diff found differences; 2 user error (bad path,
missing step, no credentials: one line on stderr, no traceback; with --json also
{command, error, exit_code} on stdout); 3 verify found no damage but some values carry no
checksum and were only decoded (stock Orbax items, string leaves, ...); 130 interrupted.

JSON output (top-level keys; ``bytes`` are integers, times ISO-8601 UTC):
  ls      {path, steps: [{step, name, path, state, problems, commit_time, commit_timestamp_nsecs,
           bytes, arrays, slices, devices, items, transports}]}
  show    {path, step, name, state, commit_time, problems, items: [{name, path, kind, handler,
           ocdbt, zarr3, writer, pathways_metadata, transports, leaves: [{key, value_type,
           dtype, shape, bytes, chunk_shape, sharding, pathways, error}], totals}], totals}
  verify  {path, step, state, ok, verdict (ok | unchecked | failed), modes, arrays, chunks,
           chunks_checksummed, bytes_read, seconds, problems: [{kind, path, item, array,
           origin, expected_crc32c, found_crc32c, error}], unchecked: [{item, key, reason}]}
  diff    {a, b, values_compared, identical, added, removed, changed: [{item, key, changes,
           max_abs_diff, values_basis, chunks_differing}], unchanged, compared: {structure,
           values, values_by_crc32c, values_read, values_not_compared}}
  du      {path, bytes, steps: [{step, name, state, bytes, items: [{item, keys: [{key, bytes,
           basis}]}]}]}
  tier    {tier_dir, ok, entries: [{root, step, step_name, item, writer, save_id,
           committed_marker, chunks, bytes, status, problems, path}]}
  tier --gc {tier_dir, dry_run, max_age_s (null: none), max_bytes (null: none), entries,
           bytes_before, bytes_after, removed: [{root, step, step_name, item, writer, save_id,
           complete, bytes, idle_s, reason (gone | stale | age | incomplete | cap), path}]}
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Sequence, TextIO

from orbax_pathways.cli import diff as diff_lib
from orbax_pathways.cli import du as du_lib
from orbax_pathways.cli import paths
from orbax_pathways.cli import render
from orbax_pathways.cli import steps as steps_lib
from orbax_pathways.cli import tier as tier_lib
from orbax_pathways.cli import verify as verify_lib

PROG = 'orbax-pathways'
VERIFY_EXIT_CODES = """exit status:
  0  every value was checked against its recorded crc32c and matched
  1  a problem: damaged bytes, a missing checksum record, unreadable metadata
  2  user error (bad path, missing step)
  3  no damage found, but some values carry no checksum and were only decoded
     (stock Orbax items, persistence-transport arrays, string leaves): not verified

verify reads storage, never a node-local tier. A restore that the tier serves
(bytes from 'local' or 'peer' in its log line) does not read those chunks' copies
on storage, so it cannot see damage there: run verify to check storage."""


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
  except paths.CliError as e:
    return _fatal(args, str(e))
  except PermissionError as e:
    return _fatal(args, f'permission denied: {e.filename or e}')
  except KeyboardInterrupt:
    print(f'{PROG}: interrupted', file=sys.stderr)
    return 130
  except BrokenPipeError:
    return 1


def _fatal(args, message: str, code: int = 2) -> int:
  """A user error: one line on stderr; with ``--json`` also a JSON object on stdout, so that a
  script reading stdout gets a document, not nothing."""
  print(f'{PROG}: error: {message}', file=sys.stderr)
  if getattr(args, 'json', False):
    json.dump({'command': args.command, 'error': message, 'exit_code': code}, sys.stdout, indent=2)
    sys.stdout.write('\n')
  return code


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
    if name == 'verify':
      s.epilog = VERIFY_EXIT_CODES
      s.formatter_class = argparse.RawDescriptionHelpFormatter
    s.add_argument('path', help='DIR/STEP, or DIR with --step N')
    s.add_argument('--step', type=int, help='step number inside DIR')
  s.add_argument('--progress', action=argparse.BooleanOptionalAction, default=None,
                 help='progress bar on stderr (default: when stderr is a terminal)')
  s = cmd('diff', cmd_diff, 'compare two steps: tree, dtypes, shapes, shardings, values')
  s.add_argument('a', help='first step: DIR/STEP')
  s.add_argument('b', help='second step: DIR/STEP')
  s.add_argument('--values', action='store_true',
                 help='read both and compare values (default: by recorded crc32c where present)')
  s = cmd('du', cmd_du, 'bytes per step and per top-level key')
  s.add_argument('path', help='checkpoint directory, or one step DIR/STEP')
  s = cmd('tier', cmd_tier, 'list and verify the steps this node\'s local tier holds; with '
          '--gc, drop stale entries instead')
  s.add_argument('tier_dir', nargs='?', default=None,
                 help='the tier directory (default: ORBAX_PATHWAYS_TIER_DIR, else /dev/shm)')
  s.add_argument('--gc', action='store_true',
                 help='drop entries whose step is gone from storage or stale, entries idle '
                      'longer than --max-age-s, incomplete ones, then the oldest while over '
                      '--max-bytes; entries touched in the last 5 minutes are kept')
  s.add_argument('--dry-run', action='store_true', help='with --gc: list, remove nothing')
  s.add_argument('--max-age-s', type=float, default=None,
                 help='with --gc (default: ORBAX_PATHWAYS_TIER_MAX_AGE_S, else 86400)')
  s.add_argument('--max-bytes', type=int, default=None,
                 help='with --gc (default: ORBAX_PATHWAYS_TIER_MAX_BYTES, else half the size '
                      'of the tier\'s filesystem)')
  return p


def _emit(out: TextIO, args, obj: dict[str, Any], text: str) -> None:
  if args.json:
    json.dump(obj, out, indent=2, sort_keys=False)
    out.write('\n')
  else:
    out.write(text if text.endswith('\n') else text + '\n')


def cmd_ls(args, out: TextIO) -> int:
  root = paths.to_path(args.dir)
  steps = [steps_lib.read_step(d) for d in steps_lib.list_step_dirs(root)]
  for s in steps:
    s.bytes = paths.dir_size(s.path)
  local = steps_lib.local_only_steps(root)
  _emit(out, args, {'path': str(root), 'steps': [render.ls_json(s) for s in steps],
                    'local_only_steps': local},
        render.ls_text(steps, local, root))
  return 0


def cmd_show(args, out: TextIO) -> int:
  step = steps_lib.read_step(steps_lib.resolve_step(args.path, args.step), open_arrays=True)
  obj, text = render.show(step, paths.dir_size(step.path))
  _emit(out, args, obj, text)
  return 0


def cmd_verify(args, out: TextIO) -> int:
  enabled = sys.stderr.isatty() if args.progress is None else args.progress
  report = verify_lib.verify_step(steps_lib.resolve_step(args.path, args.step),
                                  progress=render.Progress(stream=sys.stderr, enabled=enabled))
  _emit(out, args, report.to_json(), render.verify_text(report))
  return report.exit_code


def cmd_diff(args, out: TextIO) -> int:
  a = steps_lib.read_step(steps_lib.resolve_step(args.a), open_arrays=True)
  b = steps_lib.read_step(steps_lib.resolve_step(args.b), open_arrays=True)
  obj = diff_lib.diff_steps(a, b, values=args.values)
  _emit(out, args, obj, render.diff_text(obj))
  return 0 if obj['identical'] else 1


def cmd_tier(args, out: TextIO) -> int:
  tier_dir = args.tier_dir or tier_lib.default_dir()
  if tier_dir is None:
    raise paths.CliError('no node-local tier here: ORBAX_PATHWAYS_TIER_DIR is "off", or unset '
                         'and /dev/shm is not a tmpfs; pass the tier directory')
  if not os.path.isdir(tier_dir):
    raise paths.CliError(f'{tier_dir}: no such tier directory')
  if args.gc:
    obj = tier_lib.gc(tier_dir, args.max_age_s, args.max_bytes, dry_run=args.dry_run)
    _emit(out, args, obj, tier_lib.gc_text(obj))
    return 0
  if args.dry_run or args.max_age_s is not None or args.max_bytes is not None:
    raise paths.CliError('--dry-run, --max-age-s and --max-bytes go with --gc')
  obj = tier_lib.report(tier_dir)
  _emit(out, args, obj, tier_lib.text(obj))
  return 0 if obj['ok'] else 1


def cmd_du(args, out: TextIO) -> int:
  dirs = steps_lib.resolve_root_or_step(args.path)
  usage = [du_lib.step_usage(steps_lib.read_step(d, open_arrays=True)) for d in dirs]
  obj = {'path': str(paths.to_path(args.path)), 'bytes': sum(s['bytes'] for s in usage),
         'steps': usage}
  _emit(out, args, obj, render.du_text(obj))
  return 0
