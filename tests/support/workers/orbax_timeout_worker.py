"""Worker for tests/frontends/test_orbax_timeout.py: Orbax's ``AsyncCheckpointer(timeout_secs=...)`` on
two ``jax.distributed`` processes (``support.mp_harness``), with process 0 slow in the part of
the save that ``argv[2]`` names (``commit``: one of its background writes; ``finalize``: the
commit of the step after every write finished), as Orbax's own
``async_checkpointer_test::test_async_save_overall_timeout`` does.

A real ``StandardCheckpointHandler`` saves a real array; only the delay is injected (an extra
commit future that sleeps, or a sleep before the real ``finalize``), on process 0 alone. Each
process emits what ``wait_until_finished`` raised (type, TimeoutError or not, the text), whether
process 0 had woken up by then (its sleep ends with a marker file in the shared directory), and
whether the step directory exists.

    python orbax_timeout_worker.py DIRECTORY commit|finalize TIMEOUT_S SLEEP_S [stock]
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time


def main(argv: list[str]) -> None:
  directory, stage, timeout_s, sleep_s, *mode = argv
  from support import mp_worker as w  # pylint: disable=g-import-not-at-top
  w.init()
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  if mode != ['stock']:
    import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  me = w.process_id()
  woke = os.path.join(w.shared_dir(), f'woke-{stage}')
  slow = me == 0

  def nap() -> None:
    time.sleep(float(sleep_s))
    with open(woke, 'w'):
      pass

  class Slow(ocp.AsyncCheckpointHandler):
    """A real StandardCheckpointHandler's save; process 0 is slow in ``stage``."""

    def __init__(self):
      self.real = ocp.StandardCheckpointHandler()

    def save(self, directory, args):
      self.real.save(directory, args=ocp.args.StandardSave(args.item))

    def restore(self, directory, args=None):
      return self.real.restore(directory)

    async def async_save(self, directory, args):
      futures = await self.real.async_save(directory, args=ocp.args.StandardSave(args.item)) or []
      if slow and stage == 'commit':
        done = threading.Event()
        threading.Thread(target=lambda: (nap(), done.set()), daemon=True).start()

        class Napping:
          def result(self, timeout=None):
            if not done.wait(timeout):
              raise TimeoutError(f'napping for {sleep_s}s')
        futures = [*futures, Napping()]
      return futures

    def finalize(self, directory):
      if slow and stage == 'finalize':
        nap()
      self.real.finalize(directory)

    def close(self):
      self.real.close()

  @ocp.args.register_with_handler(Slow, for_save=True)
  @dataclasses.dataclass
  class SlowSave(ocp.args.CheckpointArgs):
    item: object

  @ocp.args.register_with_handler(Slow, for_restore=True)
  @dataclasses.dataclass
  class SlowRestore(ocp.args.CheckpointArgs):  # pylint: disable=unused-variable  (Orbax needs both)
    pass

  sh = NamedSharding(Mesh(np.array(jax.devices()), ('x',)), P('x'))
  value = np.arange(64 * jax.device_count(), dtype=np.float32)
  state = {'w': jax.make_array_from_callback(value.shape, sh, lambda idx: value[idx])}
  ckpt = ocp.AsyncCheckpointer(Slow(), timeout_secs=int(timeout_s))
  step = epath.Path(directory) / 'timeout'
  ckpt.save(step, args=SlowSave(state))
  error = None
  try:
    ckpt.wait_until_finished()
  except BaseException as e:  # pylint: disable=broad-except  (reported to the test)
    error = e
  w.emit({'error_type': type(error).__name__ if error else None,
          'timeout_error': isinstance(error, TimeoutError), 'text': str(error)[:2000],
          'slow_process_woke': os.path.exists(woke), 'step_exists': step.exists()})
  if slow:  # let the nap end before exit (its thread is a daemon: nothing else waits for it)
    while not os.path.exists(woke):
      time.sleep(0.1)
  ckpt.close()


if __name__ == '__main__':
  main(sys.argv[1:])
