"""Waits on other processes name who did not answer, and their deadline
measures silence, not total time.

Real ``jax.distributed`` processes (tests/support/mp_harness.py, the worker
``support/workers/gather_worker.py``): the gather of a key-value round (``coord/rounds.py``),
which every agreement uses, with one process that never publishes its key, and keys that keep
arriving, one every 1.5 s, for longer than the deadline in all.
"""

from __future__ import annotations

from support.mp_harness import run_processes
from support.workers import gather_worker


def test_gather_names_the_process_that_did_not_answer(tmp_path):
  results = run_processes(gather_worker.__file__, num_processes=3, devices_per_process=1,
                          timeout=240, shared_dir=str(tmp_path))
  first = results[0].results[0]
  assert first['raised'] is not None, first
  assert first['missing'] == [2], first
  assert 'process(es) 2 of 3 did not answer within 3s' in first['raised'], first
  assert 'test agreement' in first['raised'], first
  assert results[1].results[0] == {'values': ['a', 'b']}
  slow = results[0].results[1]
  assert slow['slow'] == ['s0', 's1', 's2'], slow  # not a PeerTimeoutError after 2.5 s
  assert slow['t'] > 2.5, slow  # the premise: the keys took longer than the deadline in all
