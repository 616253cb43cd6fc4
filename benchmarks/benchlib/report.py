"""What ``bench.py`` prints and writes: progress lines, the summary, the table, the JSON document.

``summarize`` turns the samples of both handlers into the median, min and count of every metric
in ``METRICS`` and the ratios ours/stock (< 1: ours faster or smaller); ``table`` renders it as
the Markdown table of benchmarks/RESULTS.md; ``print_report`` prints the table, the reference
lines, the profile and the notes, then the JSON document (also written to ``--json-out``).
"""

from __future__ import annotations

import json
import platform
import statistics

from benchlib import GiB, IMPLS, MiB

METRICS = (  # key, label, unit
    ('save_blocking_s', 'save() blocking', 's'),
    ('commit_s', 'save start -> committed', 's'),
    ('commit_cpu_s', 'CPU time, save+commit', 's'),
    ('restore_s', 'restore, same mesh', 's'),
    ('restore_cpu_s', 'CPU time, restore same mesh', 's'),
    ('restore_fewer_s', 'restore, half the devices', 's'),
    ('restore_fewer_cpu_s', 'CPU time, restore half', 's'),
    ('reshard_bytes_read', 'bytes read/host, reshard', 'B'),
    ('peak_rss_delta_bytes', 'peak RSS - before, save', 'B'),
    ('peak_rss_over_state', 'peak RSS / state dev bytes', 'x'),
    ('cold_save_blocking_s', 'save() blocking, 1st in process', 's'),
    ('cold_commit_s', 'save -> committed, 1st in process', 's'),
    ('cold_restore_s', 'restore, 1st in a fresh process', 's'),
    ('tiny_save_commit_s', 'tiny ckpt save+commit', 's'),
    ('tiny_restore_s', 'tiny ckpt restore', 's'),
    ('tiny_floor_save_commit_s', 'no-array ckpt save+commit (floor)', 's'),
)


def summarize(samples: dict) -> dict:
  out = {}
  for key, label, unit in METRICS:
    row = {'label': label, 'unit': unit}
    ok = True
    for impl in IMPLS:
      v = samples[impl].get(key, [])
      if not v:
        ok = False
        continue
      row[impl] = {'median': statistics.median(v), 'min': min(v), 'n': len(v)}
    if ok:
      for stat in ('median', 'min'):
        s = row['stock'][stat]
        row[f'ratio_{stat}'] = row['ours'][stat] / s if s else None
    out[key] = row
  return out


def fmt(v, unit):
  if v is None:
    return '-'
  if unit == 's':
    return f'{v * 1e3:.1f} ms' if v < 1 else f'{v:.3f} s'
  if unit == 'B':
    return f'{v / MiB:.1f} MiB'
  return f'{v:.3f}'


def table(summary: dict) -> str:
  hdr = ('metric', 'stock median', 'stock min', 'ours median', 'ours min', 'ours/stock med',
         'ours/stock min')
  rows = [hdr]
  for row in summary.values():
    u = row['unit']
    g = lambda impl, st: fmt(row[impl][st], u) if impl in row else 'n/a'
    r = lambda st: f"{row[f'ratio_{st}']:.2f}" if row.get(f'ratio_{st}') is not None else 'n/a'
    rows.append((row['label'], g('stock', 'median'), g('stock', 'min'), g('ours', 'median'),
                 g('ours', 'min'), r('median'), r('min')))
  w = [max(len(r[i]) for r in rows) for i in range(len(hdr))]
  line = lambda r: '| ' + ' | '.join(c.ljust(w[i]) if i == 0 else c.rjust(w[i])
                                     for i, c in enumerate(r)) + ' |'
  sep = '|' + '|'.join('-' * (x + 2) if i == 0 else '-' * (x + 1) + ':' for i, x in enumerate(w)) + '|'
  return '\n'.join([line(rows[0]), sep] + [line(r) for r in rows[1:]])


def versions() -> dict:
  import importlib.metadata as md
  out = {'python': platform.python_version()}
  for pkg in ('jax', 'jaxlib', 'orbax-checkpoint', 'tensorstore', 'numpy', 'orbax-pathways'):
    try:
      out[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
      out[pkg] = None
  return out


# --- progress lines, printed while the benchmark runs -------------------------------------------

def state_line(meta: dict) -> str:
  return (f"# state: {meta['logical_bytes'] / GiB:.3f} GiB logical, "
          f"{meta['device_bytes'] / GiB:.3f} GiB on devices, {meta['n_arrays']} arrays, "
          f"built in {meta['state_build_s']:.1f} s; mesh {meta['mesh']}, half {meta['half_mesh']}; "
          f"root {meta['root']}")


def warmup_line(impl: str, res: dict, dt: float) -> str:
  return (f'# warm-up {impl:5s}: save_blocking {fmt(res["save_blocking_s"], "s")}, commit '
          f'{fmt(res["commit_s"], "s")} (discarded; {dt:.1f} s)')


def rep_line(rep: int, impl: str, res: dict, dt: float) -> str:
  return f'# rep {rep} {impl:5s}: ' + ', '.join(
      f'{k}={fmt(statistics.median(v) if isinstance(v, list) else v, "B" if "bytes" in k else "s")}'
      for k, v in res.items()) + f'  ({dt:.1f} s)'


def rss_line(rep: int, impl: str, r: dict) -> str:
  return (f"# rep {rep} {impl:5s} rss: before {r['rss_before'] / GiB:.2f} GiB, "
          f"peak {r['rss_peak'] / GiB:.2f} GiB, delta {r['peak_rss_delta_bytes'] / MiB:.0f} MiB "
          f"(VmHWM delta {(r['vm_hwm_delta_bytes'] or 0) / MiB:.0f} MiB), "
          f"{r['samples']} samples; restore in a fresh process {r['cold_restore_s']:.3f} s")


# --- the result -----------------------------------------------------------------------------------

def _stat(xs):
  return {'median': statistics.median(xs), 'min': min(xs), 'samples': xs} if xs else None


def build_result(meta, samples, extras, rss_raw, d2h, disk, profile) -> dict:
  """The JSON document: meta, summary, raw samples, per-rep extras, RSS records, references."""
  samples = {impl: dict(v) for impl, v in samples.items()}
  return {'meta': meta, 'summary': summarize(samples), 'samples': samples,
          'extras': extras, 'rss_runs': rss_raw,
          'd2h_pinned_host_s': _stat(d2h), 'disk_write_fsync_s': _stat(disk),
          'profile': profile}


def print_report(result: dict, json_out: str | None) -> None:
  summary = result['summary']
  disk, d2h = result['disk_write_fsync_s'], result['d2h_pinned_host_s']
  print()
  print(table(summary))
  if disk:
    commit = summary['commit_s']['ours']['median']
    print(f"\ndisk write+fsync of the state's logical bytes: median {fmt(disk['median'], 's')}, "
          f"min {fmt(disk['min'], 's')}; ours commit / disk median = "
          f"{commit / disk['median']:.2f}")
  if d2h:
    print(f"\npinned_host device-to-host copy of the state: median {fmt(d2h['median'], 's')}, "
          f"min {fmt(d2h['min'], 's')} (compare with save() blocking)")
  ex = [e for e in result['extras']['ours'] if 'ours_stats_bytes_read' in e]
  if ex:
    print(f"\nours, reshard restore (orbax_pathways.stats): bytes_read (decoded) "
          f"{ex[-1]['ours_stats_bytes_read'] / MiB:.1f} MiB, bytes_needed "
          f"{ex[-1]['ours_stats_bytes_needed'] / MiB:.1f} MiB; tensorstore counters "
          f"{ex[-1].get('bytes_read_counters')}")
  if result['profile']:
    print_profile(result['profile'])
  for n in result['meta']['notes']:
    print(f'note: {n}')
  text = json.dumps(result, indent=1, default=str)
  print('\nJSON:')
  print(text)
  if json_out:
    with open(json_out, 'w') as f:
      f.write(text + '\n')


def print_profile(p: dict) -> None:
  if 'error' in p:
    print(f"\nprofile failed: {p['error']}")
    return
  print(f"\npy-spy profile of {p['impl']} / {p['metric']} (wall {fmt(p['wall_s'], 's')}, "
        f"{p['total_samples']} samples, native={p['native']}; raw: {p['raw']})")
  for kind in ('self', 'inclusive'):
    print(f'  top-15 by {kind} samples:')
    for f, c, frac in p[kind]:
      print(f'    {frac * 100:5.1f}%  {c:6d}  {f}')
