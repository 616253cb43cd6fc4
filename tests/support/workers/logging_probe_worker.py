"""What a user's logging sees of a save and a restore, in a fresh interpreter with a root handler
at INFO (as a user's script has), for ``tests/install/test_logging.py`` (``procs.run_worker``).

    python -m support.workers.logging_probe_worker ours|stock

Records every logger's level and absl's verbosity, then (``ours``) imports orbax_pathways and
installs it again (a re-registration), records them again; saves and restores one sharded
array with a custom ``CheckpointManager(logger=...)``, then saves with the default
StandardLogger. Prints as JSON: the levels that changed, absl's level, the verbosities, the
custom logger's entries, every record the root handler received and the temporary root.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile


def main() -> None:
  import_us = sys.argv[1] == 'ours'
  records = []

  class Collect(logging.Handler):
    def emit(self, record):
      records.append(record)

  logging.basicConfig(level=logging.INFO, handlers=[Collect()])
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  def levels():
    return {n: l.level for n, l in logging.Logger.manager.loggerDict.items()
            if isinstance(l, logging.Logger)}

  before, verbosity_before = levels(), absl_logging.get_verbosity()
  if import_us:
    import orbax_pathways  # pylint: disable=g-import-not-at-top
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


if __name__ == '__main__':
  main()
