"""The liveness round of a save (``orbax_pathways/coord/liveness.py``) against jax's real
key-value store, for ``tests/multiprocess/test_liveness_round.py``
(``test_round_names_who_is_missing_failed_or_stopped``), through ``procs.worker_json``.

    python -m support.workers.liveness_round_worker PORT

One ``jax.distributed`` process (coordinator on 127.0.0.1:PORT) plays several processes' parts
of rounds of 3 by publishing their keys itself, or not at all: a primary with a process that
never reported or one that failed its writes, a non-primary whose primary never answers, a
healthy round, a primary whose own writes failed, a primary slow but progressing in its commit,
one that stops, one whose commit failed. Prints one JSON line: for each case what was raised
(``{"type", "text", "missing"}`` of the SaveError, or null), the keys left after ``cleanup`` and
``liveness.lost_processes()``.
"""

from __future__ import annotations

import json
import sys
import threading
import time


def main() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  jax.distributed.initialize(coordinator_address=f'127.0.0.1:{int(sys.argv[1])}',
                             num_processes=1, process_id=0)
  from orbax_pathways import errors  # pylint: disable=g-import-not-at-top
  from orbax_pathways.coord import liveness  # pylint: disable=g-import-not-at-top
  from orbax_pathways._compat import jax_distributed  # pylint: disable=g-import-not-at-top
  client = jax_distributed.distributed_client()
  out = {}

  def rnd(key, me, primary=0, n=3):
    return liveness.SaveRound(client, f'test/{key}', me, list(range(n)), primary,
                              f'/ckpt/{key}', n, timeout_s=1.0)

  def caught(fn):
    try:
      fn()
      return None
    except errors.SaveError as e:
      return {'type': type(e).__name__, 'text': str(e), 'missing': list(getattr(e, 'missing', []))}

  # 1. the primary: process 1 reported, process 2 never did
  client.key_value_set(f'{rnd("a", 0).key}/1', 'ok')
  out['primary_missing'] = caught(lambda: rnd('a', 0).writes_done(None, 0.0))
  # a late process 2 follows the same verdict
  out['late'] = caught(lambda: rnd('a', 2).writes_done(None, 0.0))

  # 2. the primary: process 2 failed its writes
  client.key_value_set(f'{rnd("b", 0).key}/1', 'ok')
  client.key_value_set(f'{rnd("b", 0).key}/2', 'failed: OSError: disk full')
  out['failed'] = caught(lambda: rnd('b', 0).writes_done(None, 0.0))

  # 3. a non-primary whose primary never answers: it names the primary
  out['no_primary'] = caught(lambda: rnd('c', 1).writes_done(None, 0.0))

  # 4. all answered: nothing raised
  for p in (1, 2):
    client.key_value_set(f'{rnd("d", 0).key}/{p}', 'ok')
  out['healthy'] = caught(lambda: rnd('d', 0).writes_done(None, 0.0))
  out['healthy_other'] = caught(lambda: rnd('d', 1).writes_done(None, 0.0))

  # 4b. the primary's own writes failed: the others report its error at once
  rnd('h', 0).writes_done(OSError('no space left'), 0.0)
  out['primary_failed'] = caught(lambda: rnd('h', 1).writes_done(None, 0.0))

  # 5. the commit: a primary that shows progress for 3 windows, then commits, is waited for ...
  primary = rnd('e', 0)

  def commit():
    primary.commit_started()
    time.sleep(3.0)
    primary.commit_done(None)

  threading.Thread(target=commit).start()
  out['slow_commit'] = caught(lambda: rnd('e', 1).await_commit())
  # ... one that stops is named; one whose commit failed is reported with its error
  out['dead_commit'] = caught(lambda: rnd('f', 1).await_commit())
  client.key_value_set(f'{rnd("g", 0).key}/commit', 'failed: ValueError: merge failed')
  out['failed_commit'] = caught(lambda: rnd('g', 1).await_commit())
  primary.cleanup()
  out['left'] = [k for k, _ in client.key_value_dir_get(f'{rnd("e", 0).key}/')]
  out['lost'] = sorted(liveness.lost_processes())
  print(json.dumps(out))


if __name__ == '__main__':
  main()
