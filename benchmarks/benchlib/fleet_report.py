"""What ``benchmarks/fleet.py`` prints: one table per device count (stock and each of our
transports side by side, with ours/stock ratios) and the colocated rows across device counts
(what grows with the fleet at a fixed state size). Pure formatting of the children's results."""

from __future__ import annotations


ROWS = (
    ('save1_blocking_s', 'first save(): blocking', 's'),
    ('save1_commit_s', 'first save, start -> committed', 's'),
    ('save2_blocking_s', 'second save(): blocking', 's'),
    ('save2_commit_s', 'second save, start -> committed', 's'),
    ('restore_s', 'restore (fresh manager, with target)', 's'),
    ('restore_notarget_s', 'restore (fresh manager, no target)', 's'),
    ('restore_fresh_s', 'restore in a fresh process (with target)', 's'),
    ('plan_s', 'save planning, 20 arrays, cold cache', 's'),
    ('files', 'files in one step', 'n'),
    ('pathways_files_written', '`_pathways` files in one step', 'n'),
    ('pathways_reads_restore', '`_pathways` files opened by one restore (with target)', 'n'),
    ('pathways_reads_notarget', '`_pathways` files opened by one restore (no target)', 'n'),
    ('save_requests', 'requests: second save, start -> committed', 'n'),
    ('save_gets', '  object reads (GET)', 'n'),
    ('save_puts', '  object writes (uploads)', 'n'),
    ('save_lists', '  listings', 'n'),
    ('save_stats', '  metadata gets', 'n'),
    ('restore_requests', 'requests: restore with target (fresh process)', 'n'),
    ('restore_gets', '  object reads (GET)', 'n'),
    ('restore_lists', '  listings', 'n'),
    ('restore_stats', '  metadata gets', 'n'),
    ('restore_pathways_requests', '  of which name `_pathways/`', 'n'),
    ('save_worker_fn_bytes', 'colocated save: function bytes per worker call', 'n'),
    ('restore_worker_fn_bytes', 'colocated restore: function bytes per worker call', 'n'),
    ('restore_payload_row_bytes', 'colocated restore: payload row bytes per device (max)', 'n'),
    ('save_calls', 'colocated second save: worker calls', 'n'),
    ('save_call_s', '  their seconds (sum)', 's'),
    ('save_call_per_host_ms', '  per simulated host', 'ms'),
    ('restore_calls', 'colocated fresh restore: worker calls', 'n'),
    ('restore_call_s', '  their seconds (sum)', 's'),
    ('restore_call_per_host_ms', '  per simulated host', 'ms'),
    ('restore_tier_manifests', '  tier manifests opened', 'n'),
    ('restore_tier_entries', '  tier entries on the node', 'n'),
)


def fmt(v, unit):
  if v is None:
    return '-'
  if unit == 's':
    return f'{v:.2f} s' if v >= 0.1 else f'{v * 1e3:.0f} ms'
  if unit == 'ms':
    return f'{v:.2f} ms'
  return f'{int(v):,}'


def print_tables(results: list, storage: str, impls_order: tuple) -> None:
  """One table per device count: each implementation's value of every row, and ours/stock."""
  by_n: dict[int, dict[str, dict]] = {}
  for r in results:
    by_n.setdefault(r['devices'], {})[r['impl']] = r
  for n, impls in sorted(by_n.items()):
    names = [i for i in impls_order if i in impls]
    print(f'\n### {n} devices, {storage}\n')
    head = ['metric'] + [('stock' if i == 'stock' else f'ours, {i}') for i in names]
    if 'stock' in impls:
      head += [f'{i}/stock' for i in names if i != 'stock']
    print('| ' + ' | '.join(head) + ' |')
    print('|' + '---|' + '---:|' * (len(head) - 1))
    for key, label, unit in ROWS:
      vals = [impls[i].get(key) for i in names]
      if all(v is None for v in vals):
        continue
      cells = [fmt(v, unit) for v in vals]
      if 'stock' in impls:
        s = impls['stock'].get(key)
        for i in names:
          if i == 'stock':
            continue
          v = impls[i].get(key)
          cells.append(f'{v / s:.2f}' if unit == 's' and v is not None and s else '')
      print(f'| {label} | ' + ' | '.join(cells) + ' |')


SCALING = ('save2_commit_s', 'save_call_s', 'save_call_per_host_ms', 'restore_fresh_s',
           'restore_s', 'restore_call_s', 'restore_call_per_host_ms', 'restore_tier_manifests',
           'restore_tier_entries', 'restore_worker_fn_bytes', 'restore_payload_row_bytes')


def print_scaling(results: list, storage: str) -> None:
  """The colocated rows across device counts (one column per count): the record of what grows
  with the fleet at a fixed state size."""
  labels = {k: (label.strip(), unit) for k, label, unit in ROWS}
  for impl in ('colocated', 'colocated_notier'):
    rows = {r['devices']: r for r in results if r['impl'] == impl}
    if len(rows) < 2:
      continue
    ns = sorted(rows)
    print(f'\n### {impl} across device counts, {storage} ({rows[ns[0]]["mib"]:.0f} MiB state)\n')
    print('| metric | ' + ' | '.join(f'{n} devices' for n in ns) + ' |')
    print('|---|' + '---:|' * len(ns))
    for key in SCALING:
      if key not in labels or all(rows[n].get(key) is None for n in ns):
        continue
      label, unit = labels[key]
      if key.startswith('save_call'):
        label = 'second save: ' + label
      elif key.startswith('restore_call') or key.startswith('restore_tier'):
        label = 'fresh restore: ' + label
      print(f'| {label} | ' + ' | '.join(fmt(rows[n].get(key), unit) for n in ns) + ' |')
