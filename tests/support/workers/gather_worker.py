"""A ``jax.distributed`` process (``support.mp_harness``, 3 processes) gathering key-value rounds
(``orbax_pathways/coord/rounds.py``), for ``tests/coord/test_waits.py``.

    python gather_worker.py

Process 2 never publishes its key of the first round: process 0 gathers it with a 3 s deadline
and emits ``{"raised", "missing", "t"}`` (the PeerTimeoutError's text and missing processes,
or ``{"raised": null}``). Process 1 then gathers a round of 2 whose keys are all present and
emits ``{"values"}``. Last, process 1 publishes the keys of a round of 3, one every 1.5 s (the
one gather waits on first comes last), while process 0 gathers it with a 2.5 s deadline and
emits ``{"slow", "t"}`` (the values, or the PeerTimeoutError's text, and the time it took).
"""

from __future__ import annotations

import time


def main() -> None:
  from support import mp_worker  # pylint: disable=g-import-not-at-top
  mp_worker.init()
  import jax  # pylint: disable=g-import-not-at-top
  from orbax_pathways.coord import rounds  # pylint: disable=g-import-not-at-top
  from orbax_pathways._compat import jax_distributed  # pylint: disable=g-import-not-at-top
  client = jax_distributed.distributed_client()
  me, n = jax.process_index(), jax.process_count()

  def gather(key, count, timeout_s, what):
    rnd = rounds.Round(client, key, me=me, members=range(count), count=count, what=what)
    return list(rnd.gather(timeout_s).values())

  if me != 2:  # process 2 is "stuck": it never publishes
    client.key_value_set(f'test/agree/{me}', str(me * 10))
  if me == 0:
    t = time.monotonic()
    try:
      gather('test/agree', n, 3.0, 'test agreement')
      mp_worker.emit({'raised': None})
    except rounds.PeerTimeoutError as e:
      mp_worker.emit({'raised': str(e), 'missing': list(e.missing), 't': time.monotonic() - t})
    client.key_value_set('test/done', '1')
  else:
    client.blocking_key_value_get('test/done', 120_000)
  if me == 1:  # all present: values in process order
    client.key_value_set('test/all/0', 'a')
    client.key_value_set('test/all/1', 'b')
    mp_worker.emit({'values': gather('test/all', 2, 30.0, 'x')})
  # Slow but progressing: process 1 publishes the keys of 3 processes, the last one first (the
  # one gather waits on first comes last), one every 1.5 s after process 0 starts waiting with a
  # 2.5 s deadline: 4.5 s in all, never 2.5 s without a new key.
  if me == 0:
    client.key_value_set('test/go', '1')
    t = time.monotonic()
    try:
      got = gather('test/slow', 3, 2.5, 'slow agreement')
      mp_worker.emit({'slow': got, 't': time.monotonic() - t})
    except rounds.PeerTimeoutError as e:
      mp_worker.emit({'slow': str(e), 't': time.monotonic() - t})
  elif me == 1:
    client.blocking_key_value_get('test/go', 120_000)
    for p in (2, 1, 0):
      time.sleep(1.5)
      client.key_value_set(f'test/slow/{p}', f's{p}')


if __name__ == '__main__':
  main()
