"""A process that dies mid-save: the others raise, naming it, and exit (issue 21, item 1).

Real ``jax.distributed`` processes (``tests/support/mp_harness.py``), real Orbax
CheckpointManager, real tensorstore on a shared local directory. Every process saves step 1
(committed), then step 2; the last process's writes of step 2 never finish (its background
commit never reports), and it ``os._exit``s once the others are past ``save(2)``. Stock Orbax
(and orbax-pathways before the liveness round): the others wait in Orbax's ``async_write_complete`` barrier until jax's heartbeat timeout
(100 s), then jax aborts them with SIGABRT and no Python error. Now: each survivor's
``wait_until_finished`` raises ``PeerLostError`` (a ``SaveError``) naming the dead process
within the liveness deadline (``ORBAX_PATHWAYS_PEER_TIMEOUT_S``, small here), step 2 is never
listed, and every survivor exits 0 on its own. No test asserts a duration: a hang shows as the
harness's timeout.
"""

from __future__ import annotations

import os

import pytest

from support.mp_harness import run_processes

pytestmark = pytest.mark.multiprocess

WORKER = r'''
import os, sys, time
from support import mp_worker as w
w.init()
import faulthandler
faulthandler.dump_traceback_later(90, exit=False)  # a hang shows its stacks before jax's abort
import numpy as np
import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import orbax_pathways
from orbax_pathways import errors

directory = sys.argv[1]
me, n = w.process_id(), w.num_processes()
sh = NamedSharding(Mesh(np.array(jax.devices()), ('x',)), P('x'))
value = np.arange(4096 * n * 2, dtype=np.float32)
state = {'w': jax.make_array_from_callback(value.shape, sh, lambda idx: value[idx])}
mngr = ocp.CheckpointManager(directory)
mngr.save(1, args=ocp.args.StandardSave(state))
mngr.wait_until_finished()
if me == 0:  # a healthy save leaves no liveness key behind (the primary deletes its round's)
  from orbax_pathways._compat import jax_distributed
  w.emit({'keys_left': jax_distributed.distributed_client().key_value_dir_get('orbax_pathways/liveness/saves/')})
shared = os.path.dirname(directory)
if me == n - 1:
  # Its writes of step 2 never finish (a hung host): the background commit never reports.
  import threading
  from orbax_pathways.coord import liveness
  liveness.SaveRound.writes_done = lambda *a, **k: threading.Event().wait()
mngr.save(2, args=ocp.args.StandardSave(state))
if me == n - 1:
  # Dies once every survivor is past save(2): a process that leaves while the others are still
  # inside one of save()'s own barriers (a gloo collective) is stock jax's failure, not this one.
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
  open(os.path.join(shared, f'pid.{me}'), 'w').write(str(os.getpid()))
else:
  deadline = time.monotonic() + 120
  for p in range(1, n - 1):
    path = os.path.join(shared, f'pid.{p}')
    while not os.path.exists(path) and time.monotonic() < deadline:
      time.sleep(0.05)
    try:
      pid = int(open(path).read())
      while time.monotonic() < deadline:
        os.kill(pid, 0)  # raises once the process is gone
        time.sleep(0.05)
    except (OSError, ValueError):
      pass
'''


@pytest.mark.parametrize('num_processes', [2, 3])
def test_process_dying_mid_save_is_named_and_nobody_hangs(tmp_path, num_processes):
  ckpt = tmp_path / 'ckpt'
  results = run_processes(WORKER, num_processes, devices_per_process=2, args=[str(ckpt)],
                          shared_dir=str(tmp_path), timeout=420, check=False,
                          fail_fast_grace=400, env={'ORBAX_PATHWAYS_PEER_TIMEOUT_S': '5'})
  dead = num_processes - 1
  survivors = [r for r in results if r.process_id != dead]
  for r in survivors:
    print(f'\n[p{r.process_id}] rc={r.returncode} {r.duration_s:.1f}s {r.results}')
    stderr = '\n'.join(l for l in r.stderr_tail.splitlines() if not l.lstrip().startswith('@'))
    assert r.returncode == 0, f'rc={r.returncode} results={r.results}\n{stderr[-8000:]}'
    raised = r.results[1 if r.process_id == 0 else 0]
    assert raised['raised'] is not None, r.results
    assert raised['save_error'], raised
    assert raised['missing'] == [dead], raised
    assert f'process {dead}' in raised['raised'], raised
    assert 'Step 2' in raised['raised'] and 'not committed' in raised['raised'], raised
    assert r.results[-1] == {'steps': [1]}, r.results
  assert results[0].results[0] == {'keys_left': []}, results[0].results
  assert '2' not in os.listdir(ckpt), os.listdir(ckpt)  # never committed (only its tmp dir)
