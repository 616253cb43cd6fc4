"""A colocated worker call that does not answer: the controller raises within its deadline,
naming the workers (issue 21, item 1: "every wait on ... the colocated calls has a deadline whose
error names the ... worker that did not answer").

Real Orbax CheckpointManager, real tensorstore, the colocated transport (on the CPU backend
colocated Python runs in this process), fake-gcs-server behind the project's fault proxy, which
holds one array-data request of the worker call open. The storage request deadlines are set
far above the peer timeout, so only the call's own deadline can end the wait. Before: the
controller waited for the call until the request's stall timeout or forever, and no error named
a worker. The state spans two disjoint device sets (one colocated call each), so the error
must name the workers of one call, not the other's.
"""

from __future__ import annotations

import re
import time
from urllib.parse import unquote

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from orbax_pathways import errors
from orbax_pathways.transports import colocated

from support.arrays import abstract, mesh, put, random_state
from support.ckpt import options
from support.procs import run_limited

pytestmark = pytest.mark.gcs

# The call's deadline that the held request is waited out for. A normal colocated save or restore
# of this state takes ~0.2 s here, so 3 s leaves it >10x headroom on a loaded machine, and
# tensorstore's stall timeout (20 s) is still far above it.
PEER_TIMEOUT_S = 3.0
LIMIT_S = 120.0  # far above the deadline: a hang shows as a failure, no duration is asserted
SLOW_STORAGE = dict(request_deadline_floor_s=600.0, request_deadline_cap_s=600.0)


def _state():
  devices = jax.devices()
  left = mesh((2, 2), devices=devices[:4])
  right = mesh((2, 2), devices=devices[4:8])
  state = random_state(left)
  del state['step']
  state['right'] = put(np.arange(64 * 16, dtype=np.float32).reshape(64, 16), right, 'data')
  return state, ({f'w{c.id}' for c in colocated.cpu_map(devices[:4]).values()},
                 {f'w{c.id}' for c in colocated.cpu_map(devices[4:8]).values()})



def _data(method_wanted: str, step: int):
  def match(method: str, target: str) -> bool:
    t = unquote(target)
    if method != method_wanted or f'ckpt/{step}/' not in t or '/d/' not in t:
      return False
    return 'uploadType=media' in t if method == 'POST' else 'alt=media' in t
  return match


def _check_named(err, groups):
  assert err is not None, 'the call that never answered did not raise'
  text = f'{type(err).__name__}: {err}'
  print(f'\n[colocated deadline] {text[:700]}')
  assert isinstance(err, errors.WorkerTimeoutError), text
  named = set(err.workers)
  assert named in groups, (named, groups)
  said = re.search(r'worker\(s\) (.*?) \(CPU devices', text)
  assert said and set(said.group(1).split(', ')) == named, text  # the message names them all
  assert 'did not answer within' in text and 'ORBAX_PATHWAYS_PEER_TIMEOUT_S' in text, text


def test_save_whose_worker_call_never_answers_names_the_workers(faulty_gcs):
  state, groups = _state()
  path = faulty_gcs.path('ckpt')
  with options(transport='colocated', peer_timeout_s=PEER_TIMEOUT_S, local_dir='off',
               **SLOW_STORAGE):
    mngr = ocp.CheckpointManager(path)
    mngr.save(0, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    faulty_gcs.proxy.hold(_data('POST', 1))

    def save():
      mngr.save(1, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()

    th, res = run_limited(save, LIMIT_S)
    held = faulty_gcs.proxy.held()
    faulty_gcs.proxy.release()
    assert not th.is_alive(), f'save(1) still waits for the held upload {held}'
    try:
      mngr.close()  # Orbax raises the step's error again here
    except errors.SaveError:
      pass
  assert len(held) == 1, held
  err = res.get('error')
  assert isinstance(err, errors.SaveError), err
  assert 'Step 1' in str(err) and 'not committed' in str(err), err
  _check_named(err, groups)
  assert 'ckpt/1/commit_success.txt' not in faulty_gcs.objects()


def test_restore_whose_worker_call_never_answers_names_the_workers(faulty_gcs):
  state, groups = _state()
  path = faulty_gcs.path('ckpt')
  with options(transport='colocated', peer_timeout_s=PEER_TIMEOUT_S, local_dir='off',
               **SLOW_STORAGE):
    with ocp.CheckpointManager(path) as mngr:
      mngr.save(0, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()
    faulty_gcs.proxy.hold(_data('GET', 0))

    def restore():
      with ocp.CheckpointManager(path) as mngr:
        return mngr.restore(0, args=ocp.args.StandardRestore(abstract(state)))

    t = time.monotonic()
    th, res = run_limited(restore, LIMIT_S)
    held = faulty_gcs.proxy.held()
    faulty_gcs.proxy.release()
    assert not th.is_alive(), f'the restore still waits for the held read {held}'
  print(f'\n[colocated restore] raised after {time.monotonic() - t:.1f}s')
  assert len(held) == 1, held
  _check_named(res.get('error'), groups)
