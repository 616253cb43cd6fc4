"""Logging is stock's: importing orbax_pathways changes no logger level and no absl verbosity, and
every record and step-statistics event Orbax's CheckpointManager emits reaches the user's root
handler and ``CheckpointManager(logger=...)``. Each case runs in a fresh interpreter (the test
process has long since imported everything) with a root handler at INFO, as a user's script has
(``support/workers/logging_probe_worker.py``).
"""

import json

from support import procs
from support.workers import logging_probe_worker


def _probe(import_us: bool) -> dict:
  proc = procs.run_worker(logging_probe_worker, 'ours' if import_us else 'stock', fresh=True)
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _orbax_sites(records, *, skip_files=()) -> set:
  """(file, function, level) of every record Orbax's own modules logged."""
  return {(path.rsplit('/orbax/checkpoint/', 1)[1], func, level)
          for _, level, path, func, _ in records
          if '/orbax/checkpoint/' in path and path.rsplit('/', 1)[1] not in skip_files}


def test_import_keeps_levels_and_orbax_logs_reach_the_users_handlers():
  ours = _probe(True)
  assert ours['changed'] == {}, f'import orbax_pathways changed logger levels: {ours["changed"]}'
  assert ours['absl_level'] == 0  # NOTSET: absl's records inherit the root's INFO
  assert ours['verbosity'][0] == ours['verbosity'][1]

  # CheckpointManager(logger=...) gets the step statistics of the save and of the restore.
  root = ours['root']
  assert ours['entries'] == [['save', 0, f'{root}/a'], ['restore', 0, f'{root}/a']]
  # The default StandardLogger's step statistics reach the root handler (absl, INFO).
  stats = [r for r in ours['records'] if r[0] == 'absl' and "'event_type': 'save'" in r[4]]
  assert len(stats) == 1 and stats[0][1] == 'INFO' and f"'directory': '{root}/b'" in stats[0][4]
  # Our intended override is not announced as Orbax's 'overriding jax.Array' warning.
  assert not [r for r in ours['records'] if 'overriding' in r[4]], ours['records']

  # Every place stock Orbax logs from during the same run still logs with us, except the modules
  # of the jax.Array handler we replace (our handler logs its own line per save and restore).
  stock = _probe(False)
  replaced = ('jax_array_handlers.py', 'replica_slices.py')
  missing = _orbax_sites(stock['records'], skip_files=replaced) - _orbax_sites(ours['records'])
  assert not missing, f'Orbax records lost with orbax_pathways imported: {sorted(missing)}'
  assert ('checkpoint_manager.py', 'save', 'INFO') in _orbax_sites(ours['records'])
