"""A colocated worker call's deadline measures silence, not total time: a call that does not
answer raises within its deadline naming the worker that went silent; a call that is slow but
keeps making progress runs past it and succeeds.

Real Orbax CheckpointManager, real tensorstore, the colocated transport (on the CPU backend
colocated Python runs in this process), fake-gcs-server behind the project's fault proxy, which
holds one array-data request of the worker call open, or delays every one. The storage request
deadlines are set far above the peer timeout, so only the call's own deadline can end the
wait. Before (silent call): the controller waited for the call until the request's stall
timeout or forever, and no error named a worker; then it named every worker of the call.
Before (slow call): the call's deadline counted from its start, so a call longer than it
failed however steadily its workers progressed. The silent calls' state spans two disjoint
device sets (one colocated call each), so the error must name a worker of one call only.
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
from orbax_pathways.transports import colocated_worker

from support.arrays import abstract, assert_trees_equal, mesh, put, random_state
from support.ckpt import options
from support.procs import run_limited

pytestmark = pytest.mark.gcs

# The call's deadline that the held request is waited out for. A normal colocated save or restore
# of this state takes ~0.2 s here, so 3 s leaves it >10x headroom on a loaded machine, and
# tensorstore's stall timeout (20 s) is still far above it.
PEER_TIMEOUT_S = 3.0
LIMIT_S = 120.0  # far above the deadline: a hang shows as a failure, no duration is asserted
SLOW_STORAGE = dict(request_deadline_floor_s=600.0, request_deadline_cap_s=600.0)
# The slow-but-progressing calls: every array-data request answers late (per phase below), and
# the simulated hosts of a call run one at a time, so a call of 8 hosts lasts well past its
# deadline (PROGRESS_TIMEOUT_S) while each host finishes (a sign of progress) well within it.
# A restore's host makes one data request; a save's up to ~4 in a row (the first host creates
# every array: metadata, then pieces, each an OCDBT commit), hence a shorter delay.
PROGRESS_TIMEOUT_S = 4.0
DELAY_S = {'save': 0.5, 'restore': 1.0}


def _state():
  devices = jax.devices()
  left = mesh((2, 2), devices=devices[:4])
  right = mesh((2, 2), devices=devices[4:8])
  state = random_state(left)
  del state['step']
  state['right'] = put(np.arange(64 * 16, dtype=np.float32).reshape(64, 16), right, 'data')
  # The transport maps the item's devices to CPU devices all at once (on the CPU backend
  # colocated Python hands out CPU devices in order, so a subset alone would map to the first).
  cpus = colocated.cpu_map(devices)
  return state, tuple({f'w{cpus[d.id].id}' for d in group} for group in (devices[:4], devices[4:8]))


def _data(method_wanted: str, step: int):
  def match(method: str, target: str) -> bool:
    t = unquote(target)
    if method != method_wanted or f'ckpt/{step}/' not in t or '/d/' not in t:
      return False
    return 'uploadType=media' in t if method == 'POST' else 'alt=media' in t
  return match


def _check_named(err, groups, expected: set[str] | None = None):
  """``err`` names exactly one worker, of one call (``expected``: that worker), and says so."""
  assert err is not None, 'the call that never answered did not raise'
  text = f'{type(err).__name__}: {err}'
  print(f'\n[colocated deadline] {text[:900]}')
  assert isinstance(err, errors.WorkerTimeoutError), text
  named = set(err.workers)
  assert len(named) == 1 and any(named <= g for g in groups), (named, groups)
  if expected is not None:
    assert named == expected, (named, expected)
  said = re.search(r'worker\(s\) (.*?) \(CPU devices', text)
  assert said and set(said.group(1).split(', ')) == named, text  # the message names them all
  assert 'did not answer within' in text and 'no sign of progress' in text, text
  assert 'ORBAX_PATHWAYS_PEER_TIMEOUT_S' in text and 'they started their share' in text, text


def _writer_of(target: str) -> set[str]:
  """The simulated host whose upload ``target`` is: each writes its own OCDBT database."""
  found = re.search(r'ocdbt\.process_(w\d+)', unquote(target))
  assert found, target
  return {found.group(1)}


def test_save_whose_worker_call_never_answers_names_the_workers(faulty_gcs):
  state, groups = _state()
  path = faulty_gcs.path('ckpt')
  with options(transport='colocated', peer_timeout_s=PEER_TIMEOUT_S, tier_dir='off',
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
  _check_named(err, groups, _writer_of(held[0][1]))
  assert 'ckpt/1/commit_success.txt' not in faulty_gcs.objects()


def test_restore_whose_worker_call_never_answers_names_the_workers(faulty_gcs):
  state, groups = _state()
  path = faulty_gcs.path('ckpt')
  with options(transport='colocated', peer_timeout_s=PEER_TIMEOUT_S, tier_dir='off',
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
  # Which simulated host asked for the held object is not in its name (any reader may need a
  # chunk another host's database holds): exactly one worker, of one call, is named.
  _check_named(res.get('error'), groups)


def _one_call_state():
  """Arrays over all 8 devices: one colocated call of 8 simulated hosts."""
  m = mesh((4, 2))
  rng = np.random.default_rng(5)
  return {'w': put(rng.standard_normal((64, 32), dtype=np.float32), m, 'data', 'model'),
          'v': put(rng.standard_normal((64, 8), dtype=np.float32), m, 'data', None)}


def _slow_data(faulty_gcs, method: str, step: int, delay_s: float) -> None:
  faulty_gcs.proxy.delay_s = delay_s
  faulty_gcs.proxy.match = _data(method, step)
  faulty_gcs.proxy.set_rate(1.0, ['delay'])


@pytest.mark.parametrize('phase', ['save', 'restore'])
def test_slow_call_that_keeps_progressing_outlives_its_deadline(faulty_gcs, monkeypatch, phase):
  """Every array-data request of the call answers ``DELAY_S`` late and the call's 8 simulated
  hosts run one at a time (``MAX_CONCURRENT_HOSTS`` is how many run at once): the call lasts
  longer than its deadline, but its hosts keep finishing well within it. It must succeed."""
  state = _one_call_state()
  path = faulty_gcs.path('ckpt')
  monkeypatch.setattr(colocated_worker, 'MAX_CONCURRENT_HOSTS', 1)
  delay_s = DELAY_S[phase]
  with options(transport='colocated', peer_timeout_s=PROGRESS_TIMEOUT_S, tier_dir='off',
               **SLOW_STORAGE):
    with ocp.CheckpointManager(path) as mngr:
      if phase == 'save':
        _slow_data(faulty_gcs, 'POST', 0, delay_s)
      t = time.monotonic()
      mngr.save(0, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()
      if phase == 'restore':
        _slow_data(faulty_gcs, 'GET', 0, delay_s)
        t = time.monotonic()
        out = mngr.restore(0, args=ocp.args.StandardRestore(abstract(state)))
      took = time.monotonic() - t
      faulty_gcs.proxy.set_rate(0.0)
      if phase == 'save':
        out = mngr.restore(0, args=ocp.args.StandardRestore(abstract(state)))
  delayed = faulty_gcs.proxy.stats()['faults'].get('delay', 0)
  print(f'\n[colocated {phase}] {delayed} requests delayed {delay_s}s; took {took:.1f}s')
  # The premise: the call ran past its deadline (the hosts one at a time, each delayed).
  assert took > PROGRESS_TIMEOUT_S, (took, delayed)
  assert_trees_equal(out, state)
