"""Saves whose old-step garbage collection cannot delete anything, for
``tests/manager/test_retention.py`` (``test_failing_garbage_collection_never_fails_a_save``),
run through ``procs.run`` under ``strace``, which makes every ``unlinkat`` fail with EACCES.

    python -m support.workers.retention_gc_worker DIR

Imports orbax_pathways; an ordinary ``CheckpointManager`` on ``DIR`` with ``max_to_keep=1`` saves
steps 0-3 (each save's exception, if any, collected rather than raised), lists its steps, then
deletes step 3 itself. Prints one JSON line ``{"errors", "listed", "explicit"}``: the save
errors, ``all_steps()``, and the error of the explicit ``delete(3)`` (None if it raised none).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import

  m = ocp.CheckpointManager(sys.argv[1], options=ocp.CheckpointManagerOptions(max_to_keep=1))
  errors = []
  for s in range(4):
    try:
      m.save(s, args=ocp.args.StandardSave({'w': jnp.full(64, s)}))
    except Exception as e:  # pylint: disable=broad-except  (reported to the test)
      errors.append(f'save({s}): {type(e).__name__}: {e}')
  m.wait_until_finished()
  listed = m.all_steps()
  try:
    m.delete(3)
    explicit = None
  except Exception as e:  # pylint: disable=broad-except  (reported to the test)
    explicit = f'{type(e).__name__}: {e}'
  print(json.dumps({'errors': errors, 'listed': listed, 'explicit': explicit}), flush=True)


if __name__ == '__main__':
  main()
