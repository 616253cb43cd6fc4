"""Waits on other processes name who did not answer (issue 21 item 1), and their deadline
measures silence, not total time (issue 26 item 7).

Real ``jax.distributed`` processes (tests/support/mp_harness.py): the gather of a key-value
round (``coord/rounds.py``), which every agreement uses, with one process that never publishes
its key, and keys that keep arriving, one every 1.5 s, for longer than the deadline in all.
"""

from __future__ import annotations

from support.mp_harness import run_processes

WORKER = r'''
import time
from support import mp_worker
mp_worker.init()
import jax
from orbax_pathways.coord import rounds
from orbax_pathways._compat import jax_distributed
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
  client.key_value_set('test/all/0', 'a'); client.key_value_set('test/all/1', 'b')
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
'''


def test_gather_names_the_process_that_did_not_answer(tmp_path):
  results = run_processes(WORKER, num_processes=3, devices_per_process=1, timeout=240,
                          shared_dir=str(tmp_path))
  first = results[0].results[0]
  assert first['raised'] is not None, first
  assert first['missing'] == [2], first
  assert 'process(es) 2 of 3 did not answer within 3s' in first['raised'], first
  assert 'test agreement' in first['raised'], first
  assert results[1].results[0] == {'values': ['a', 'b']}
  slow = results[0].results[1]
  assert slow['slow'] == ['s0', 's1', 's2'], slow  # not a PeerTimeoutError after 2.5 s
  assert slow['t'] > 2.5, slow  # the premise: the keys took longer than the deadline in all
