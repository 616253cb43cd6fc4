"""One of two ``jax.distributed`` processes agreeing on the preemption step through the
coordination service's key-value store (JAX's preemption service off), for
``tests/manager/test_preemption.py`` (``test_multi_controller_kv_agreement``), through
``procs.started``.

    python -m support.workers.kv_agreement_worker PROCESS_ID PORT

Process PROCESS_ID of 2, coordinator on 127.0.0.1:PORT; ``preemption.install(agreement_interval=5,
handle_sigterm=False)``. Over 40 steps process 1 notices a preemption at step 13; each step asks
``reached_preemption`` twice (as ``should_save`` and ``save`` do; both answers must agree). Prints
one JSON line ``{"pid", "first"}``: the first step it was true for.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_enable_preemption_service', False)
  pid, port = int(sys.argv[1]), sys.argv[2]
  jax.distributed.initialize(f'127.0.0.1:{port}', num_processes=2, process_id=pid,
                             initialization_timeout=60)
  from orbax_pathways import preemption  # pylint: disable=g-import-not-at-top
  preemption.install(agreement_interval=5, handle_sigterm=False)
  first = None
  for step in range(40):
    if pid == 1 and step == 13:
      preemption.notify_preemption('test')
    # Called twice per step like CheckpointManager.should_save + save do.
    r = preemption.reached_preemption(step)
    assert r == preemption.reached_preemption(step)
    if r and first is None:
      first = step
  print(json.dumps({'pid': pid, 'first': first}), flush=True)
  jax.distributed.shutdown()


if __name__ == '__main__':
  main()
