"""A ``jax.distributed`` process of a job in which one process dies mid-save, for
``tests/multiprocess/test_liveness.py`` (``support.mp_harness``, 2 or 3 processes, the
checkpoint directory inside the shared directory).

    python liveness_worker.py DIRECTORY

Every process saves step 1 (committed), then step 2 with a real CheckpointManager; the last
process's writes of step 2 never finish (its ``SaveRound.writes_done`` never returns), and it
``os._exit(0)``s once every survivor has written ``saved2.<id>`` next to DIRECTORY (is past
``save(2)``). Process 0 first emits ``{"keys_left"}``: the liveness keys left after the healthy
save of step 1. Each survivor emits what its ``wait_until_finished`` raised (``{"raised": null}``
or ``{"raised", "save_error", "missing", "waited_s"}``), then ``{"steps"}``, the steps in
DIRECTORY after ``close()``. Process 0 (the coordination service's host) exits only once the
other survivors have. Stacks are dumped to stderr at 90 s (a hang shows them before jax's abort).
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
  from support import mp_worker as w  # pylint: disable=g-import-not-at-top
  w.init()
  import faulthandler  # pylint: disable=g-import-not-at-top
  faulthandler.dump_traceback_later(90, exit=False)  # a hang shows its stacks before jax's abort
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from orbax_pathways import errors  # pylint: disable=g-import-not-at-top

  directory = sys.argv[1]
  me, n = w.process_id(), w.num_processes()
  sh = NamedSharding(Mesh(np.array(jax.devices()), ('x',)), P('x'))
  value = np.arange(4096 * n * 2, dtype=np.float32)
  state = {'w': jax.make_array_from_callback(value.shape, sh, lambda idx: value[idx])}
  mngr = ocp.CheckpointManager(directory)
  mngr.save(1, args=ocp.args.StandardSave(state))
  mngr.wait_until_finished()
  if me == 0:  # a healthy save leaves no liveness key behind (the primary deletes its round's)
    from orbax_pathways._compat import jax_distributed  # pylint: disable=g-import-not-at-top
    w.emit({'keys_left': jax_distributed.distributed_client().key_value_dir_get(
        'orbax_pathways/liveness/saves/')})
  shared = os.path.dirname(directory)
  if me == n - 1:
    # Its writes of step 2 never finish (a hung host): the background commit never reports.
    import threading  # pylint: disable=g-import-not-at-top
    from orbax_pathways.coord import liveness  # pylint: disable=g-import-not-at-top
    liveness.SaveRound.writes_done = lambda *a, **k: threading.Event().wait()
  mngr.save(2, args=ocp.args.StandardSave(state))
  if me == n - 1:
    # Dies once every survivor is past save(2): a process that leaves while the others are still
    # inside one of save()'s own barriers (a gloo collective) is stock jax's failure, not this
    # one.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
        os.path.exists(os.path.join(shared, f'saved2.{p}')) for p in range(n - 1)):
      time.sleep(0.02)
    os._exit(0)  # dies with its background writes of step 2 in flight
  open(os.path.join(shared, f'saved2.{me}'), 'w').close()
  t = time.monotonic()
  try:
    mngr.wait_until_finished()
    w.emit({'raised': None})
  except Exception as e:  # pylint: disable=broad-except
    w.emit({'raised': f'{type(e).__name__}: {e}', 'save_error': isinstance(e, errors.SaveError),
            'missing': list(getattr(e, 'missing', ())), 'waited_s': time.monotonic() - t})
  try:
    mngr.close()  # what leaving a `with CheckpointManager(...)` block does: must not wait either
  except Exception as e:  # pylint: disable=broad-except
    w.log('close raised', type(e).__name__)
  w.emit({'steps': sorted(int(s) for s in os.listdir(directory) if s.isdigit())})
  w.log('main done')
  # Process 0 hosts jax's coordination service: it leaves only after the other survivors have
  # exited (no barrier is possible with a dead process), or jax's error poll in a survivor still
  # shutting down sees the service gone and ends that process with an error (seen in CI).
  if me != 0:
    # Written whole then renamed: process 0 must never read the file half-written (an empty
    # pid would end its wait at once, which is the very race this wait exists to prevent).
    path = os.path.join(shared, f'pid.{me}')
    with open(path + '.tmp', 'w') as f:
      f.write(str(os.getpid()))
    os.replace(path + '.tmp', path)
  else:
    deadline = time.monotonic() + 120
    for p in range(1, n - 1):
      path = os.path.join(shared, f'pid.{p}')
      while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
      try:
        with open(path) as f:
          pid = int(f.read())
        while time.monotonic() < deadline:
          os.kill(pid, 0)  # raises once the process is gone
          time.sleep(0.05)
      except (OSError, ValueError):
        pass


if __name__ == '__main__':
  main()
