"""Logging is stock's: importing orbax_pathways changes no logger level and no absl verbosity, and
every record and step-statistics event Orbax's CheckpointManager emits reaches the user's root
handler and ``CheckpointManager(logger=...)``. Each case runs in a fresh interpreter (the test
process has long since imported everything) with a root handler at INFO, as a user's script has.
"""

import json

from support.procs import run_python

# Saves and restores one sharded array with a custom logger, then saves with the default
# StandardLogger; prints what the user's handler and logger received as JSON on the last line.
_PROBE = """
    import json, logging, os, sys, tempfile
    records = []
    class Collect(logging.Handler):
      def emit(self, record):
        records.append(record)
    logging.basicConfig(level=logging.INFO, handlers=[Collect()])
    import jax, numpy as np
    import orbax.checkpoint as ocp
    from absl import logging as absl_logging
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    def levels():
      return {n: l.level for n, l in logging.Logger.manager.loggerDict.items()
              if isinstance(l, logging.Logger)}

    before, verbosity_before = levels(), absl_logging.get_verbosity()
    if IMPORT_US:
      import orbax_pathways
      orbax_pathways.install(orbax_pathways.Options(max_chunk_bytes=1 << 20))  # a re-registration
    after, verbosity_after = levels(), absl_logging.get_verbosity()

    entries = []
    class UserLogger(ocp.logging.AbstractLogger):
      def log_entry(self, entry):
        entries.append(entry)

    m = Mesh(np.asarray(jax.devices()).reshape(4, 2), ('d', 'm'))
    x = jax.device_put(np.arange(64.).reshape(8, 8), NamedSharding(m, P('d', 'm')))
    root = tempfile.mkdtemp()
    with ocp.CheckpointManager(os.path.join(root, 'a'), logger=UserLogger()) as mngr:
      mngr.save(0, args=ocp.args.StandardSave({'x': x}))
      mngr.wait_until_finished()
      mngr.restore(0)
    with ocp.CheckpointManager(os.path.join(root, 'b')) as mngr:
      mngr.save(0, args=ocp.args.StandardSave({'x': x}))
      mngr.wait_until_finished()
    print(json.dumps(dict(
        changed={n: [before[n], after[n]] for n in before if before[n] != after[n]},
        absl_level=logging.getLogger('absl').level,
        verbosity=[verbosity_before, verbosity_after],
        entries=[[e.get('event_type'), e.get('step'), e.get('directory')] for e in entries],
        records=[[r.name, r.levelname, r.pathname, r.funcName, r.getMessage()] for r in records],
        root=root)))
"""


def _probe(import_us: bool) -> dict:
  proc = run_python(_PROBE.replace('IMPORT_US', str(import_us)))
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
