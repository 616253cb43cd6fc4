"""Orbax's ``timeout_secs`` bounds a multi-process async save with the package imported, as it
does in stock Orbax (Orbax's upstream ``async_checkpointer_test``
``test_async_save_overall_timeout`` cases ``host_long_commit`` and ``host_long_finalize``).

Two real ``jax.distributed`` processes save with ``AsyncCheckpointer(timeout_secs=T)``; process 0
is slow (far past T) in one of its writes, or in the step's finalize. Stock Orbax: every process's
``wait_until_finished`` raises ``TimeoutError`` once T has passed; the others name the barrier they
gave up in (``async_write_complete``, ``async_commit_complete``). Our liveness round (which
names a process that died) must not wait past Orbax's own timeout: process 1 raises a
``TimeoutError`` that keeps stock's phrase, names process 0, and is raised while process 0 is
still asleep; the step is not committed. No duration is asserted: "before process 0 woke" is
an order of events (its nap ends by writing a marker file).
"""

from __future__ import annotations

import pytest

from support.mp_harness import run_processes
from support.workers import orbax_timeout_worker

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 3
SLEEP_S = 10  # far past TIMEOUT_S


@pytest.mark.parametrize('stage, barrier', [('commit', 'async_write_complete'),
                                            ('finalize', 'async_commit_complete')])
def test_orbax_timeout_secs_bounds_the_save_on_every_process(tmp_path, stage, barrier):
  results = run_processes(orbax_timeout_worker.__file__, num_processes=2, devices_per_process=2,
                          args=[str(tmp_path / 'ckpt'), stage, str(TIMEOUT_S), str(SLEEP_S)],
                          shared_dir=tmp_path / 'shared', timeout=SLEEP_S + 90)
  slow, other = (r.results[0] for r in results)
  assert other['timeout_error'], other
  assert f'Timed out while waiting for {barrier} barrier' in other['text'], other['text']
  assert not other['slow_process_woke'], (
      f'process 1 waited for the slow process 0 past timeout_secs={TIMEOUT_S}: {other}')
  assert not other['step_exists']
  if stage == 'commit':  # stock's own error on the slow process (its commit futures timed out)
    assert slow['timeout_error'], slow
    assert not slow['step_exists']
