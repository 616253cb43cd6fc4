"""The fault soak's report (``integration/chaos.py``): its closing line and its table by fault
kind, from the per-fault records (also read back from ``--json-out`` files to merge runs)."""

from __future__ import annotations

import statistics
from typing import Sequence


def fmt(x) -> str:
  return '-' if x is None else f'{x:.2f}'


def summary(records: list[dict]) -> str:
  n = len(records)
  recovered = sum(1 for r in records if r.get('recovered'))
  wrong = sum(1 for r in records if r.get('wrong'))
  hangs = sum(1 for r in records if r.get('hang'))
  lost = [r['steps_lost'] for r in records if r.get('steps_lost') is not None]
  resume = [r['resume_wall_s'] for r in records if r.get('resume_wall_s') is not None]
  return (f'chaos: {recovered}/{n} recovered, {wrong} wrong values, {hangs} hangs, '
          f'steps lost mean {statistics.mean(lost) if lost else 0:.1f} max '
          f'{max(lost) if lost else 0}, resume mean '
          f'{statistics.mean(resume) if resume else 0:.1f} s')


def by_kind(records: list[dict], kinds: Sequence[str]) -> str:
  """A markdown table: per kind, faults, recovered, steps lost (mean, max), seconds from the
  restart's launch to its first trained step and of the resume call (means), storage bytes
  read by the restart (mean); the kinds in the order of ``kinds``."""
  rows = ['| fault | n | recovered | steps lost mean / max | restart to first step (s) | '
          'resume call (s) | storage read (KiB) |', '|---|---|---|---|---|---|---|']
  for kind in kinds:
    rs = [r for r in records if r['kind'] == kind]
    if not rs:
      continue
    lost = [r['steps_lost'] for r in rs if r.get('steps_lost') is not None]
    wall = [r['resume_wall_s'] for r in rs if r.get('resume_wall_s') is not None]
    call = [r['resume_call_s'] for r in rs if r.get('resume_call_s') is not None]
    read = [r.get('storage_bytes', 0) for r in rs if r.get('recovered')]
    rows.append(f'| {kind} | {len(rs)} | {sum(1 for r in rs if r.get("recovered"))} | '
                f'{statistics.mean(lost) if lost else 0:.1f} / {max(lost) if lost else "-"} | '
                f'{statistics.mean(wall) if wall else 0:.1f} | '
                f'{statistics.mean(call) if call else 0:.2f} | '
                f'{statistics.mean(read) / 1024 if read else 0:.0f} |')
  return '\n'.join(rows)
