"""A restore that fails leaves nothing running behind it.

Orbax restores an item's jax.Array, np.ndarray and scalar leaves through three handlers at once
(ours, all three) and gathers them without ``return_exceptions``. When one fails (here: a
damaged chunk of a jax.Array), Orbax 0.12.8 (and 0.12.4, through ``asyncio.run``, whose
teardown cancels the tasks but closes the loop at once) closed its event loop while the other handlers'
reads were still in flight: their tasks were destroyed pending, and their tensorstore reads
answered into the closed loop, which the suite saw as "Event loop is closed" unraisable
exceptions and "coroutine ... was never awaited" from ``storage/reader.py``
(``_compat/orbax_loop.py`` cancels and ends them first).

Real Orbax, real tensorstore on local disk; the numpy leaves are large enough (4 x 8 MiB) that
their reads are still running when the damaged chunk, read first, fails the restore.
"""

from __future__ import annotations

import gc
import logging
import sys
import warnings

import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways

from support import damage
from support.arrays import abstract, mesh, put

# An exception nobody could raise (a callback into a closed event loop) or a coroutine never
# awaited fails the test.
pytestmark = [pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning'),
              pytest.mark.filterwarnings('error:coroutine .* was never awaited:RuntimeWarning')]


def _state():
  rng = np.random.default_rng(0)
  state = {'w': put(rng.standard_normal((256, 64), dtype=np.float32), mesh(), 'data', 'model')}
  state.update({f'n{i}': rng.standard_normal((2048, 1024), dtype=np.float32) for i in range(4)})
  state['step'] = 7
  return state


def test_a_failed_restore_leaves_no_task_request_or_unraisable_error(tmp_path, caplog):
  state = _state()
  with ocp.CheckpointManager(tmp_path) as mngr:
    mngr.save(1, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
  item = tmp_path / '1' / 'default'
  damage.flip_bit_in(sorted(item.glob('ocdbt.process_0/d/*')),
                     np.asarray(state['w'])[:8, :8].tobytes()[:32], what="w's first chunk")
  unraisable: list = []
  previous, sys.unraisablehook = sys.unraisablehook, unraisable.append
  caplog.set_level(logging.ERROR, logger='asyncio')
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      for _ in range(3):  # each a fresh chance for a read to outlive its loop
        with ocp.CheckpointManager(tmp_path) as mngr:
          with pytest.raises(orbax_pathways.ChecksumMismatchError, match="array 'w'"):
            mngr.restore(1, args=ocp.args.StandardRestore(abstract(state)))
        gc.collect()
  finally:
    sys.unraisablehook = previous
  texts = [f'{type(u.exc_value).__name__}: {u.exc_value} ({u.err_msg})' for u in unraisable]
  assert not texts, texts
  never_awaited = [str(w.message) for w in caught if 'never awaited' in str(w.message)]
  assert not never_awaited, never_awaited
  destroyed = [r.getMessage() for r in caplog.records if 'destroyed but it is pending' in r.getMessage()]
  assert not destroyed, destroyed[:3]
