"""Storage requests with deadlines on gs://: one request that the server
accepts and never answers must not hang a save or a restore.

Real Orbax CheckpointManager, real tensorstore, fake-gcs-server behind the project's fault proxy
(``tests/support/fault_proxy.py``), which holds one chosen request open: it reads the request and
answers nothing until the test ends. Without deadlines a held read blocks the restore until the
process is killed, and a held upload stalls the save until curl's low-speed timeout (~69 s).
"""

from __future__ import annotations

import time
from urllib.parse import unquote

import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways.storage import hedge

from support.arrays import abstract, assert_bit_identical, mesh, random_state
from support.ckpt import options
from support.procs import run_limited

# An exception nobody could raise (a callback into a closed event loop) or a coroutine never
# awaited fails the test.
pytestmark = [pytest.mark.gcs, pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning'),
              pytest.mark.filterwarnings('error:coroutine .* was never awaited:RuntimeWarning')]

# A save or restore with one hung request finishes within its normal time plus this (the goal).
SLACK_S = 30.0
# The read tests wait out one request deadline, max(floor, 4 x the expected time) (deadline.py):
# with the floor at this (Options, per test) instead of the default 10 s, a held read is hedged
# after ~2 s against fake-gcs-server: the same policy and hedging code, a shorter wait. A normal
# read that passes it on a loaded machine is hedged too, which no assertion minds (the hold
# catches exactly one request). The save test uses it too: the numpy leaf 'step', which waits
# behind the held upload in the same OCDBT database, is hedged like the array pieces.
READ_FLOOR_S = 2.0



def _array_data_upload(step: int):
  """A tensorstore upload of array data (an OCDBT data file) of ``step``."""
  def match(method: str, target: str) -> bool:
    t = unquote(target)
    return (method == 'POST' and 'uploadType=media' in t and f'ckpt/{step}/' in t
            and '/d/' in t)
  return match


def _array_data_read(step: int):
  """A tensorstore read of array data (an OCDBT data file) of ``step``."""
  def match(method: str, target: str) -> bool:
    t = unquote(target)
    return method == 'GET' and 'alt=media' in t and f'ckpt/{step}/' in t and '/d/' in t
  return match


def _save(path, step, state):
  with ocp.CheckpointManager(path) as mngr:
    assert mngr.save(step, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()


def _restore(path, step, state):
  with ocp.CheckpointManager(path) as mngr:
    return mngr.restore(step, args=ocp.args.StandardRestore(abstract(state)))


def _timed(fn) -> float:
  t = time.monotonic()
  fn()
  return time.monotonic() - t


def test_save_with_one_hung_upload_finishes_with_exact_values(faulty_gcs):
  m = mesh()
  state = random_state(m)
  path = faulty_gcs.path('ckpt')
  normal = _timed(lambda: _save(path, 0, state))  # also: what this process observes
  before = hedge.counts().get('write_hedged', 0)
  faulty_gcs.proxy.hold(_array_data_upload(1))
  limit = normal + SLACK_S
  with options(request_deadline_floor_s=READ_FLOOR_S):
    th, res = run_limited(lambda: _save(path, 1, state), limit)
    held = faulty_gcs.proxy.held()
    faulty_gcs.proxy.release()
  if th.is_alive():
    th.join(120)
    pytest.fail(f'save(1) with one hung upload did not finish within normal {normal:.1f}s + '
                f'{SLACK_S:.0f}s (held {held}; finished after {res.get("elapsed")}s)')
  print(f'\n[hung upload] normal save {normal:.1f}s, with one held upload '
        f'{res["elapsed"]:.1f}s; held {held}; {hedge.counts()}')
  assert 'error' not in res, res['error']
  assert len(held) == 1, held
  assert hedge.counts().get('write_hedged', 0) > before
  objects = faulty_gcs.objects()
  assert 'ckpt/1/commit_success.txt' in objects
  # The retried pieces went to a database of their own, with its own manifest (the original's
  # manifest keeps one writer, and may never be written: its upload is the one held); Orbax's
  # finalize merged it.
  databases = {o.split('/')[3] for o in objects if o.startswith('ckpt/1/default/ocdbt.process_')}
  retries = sorted(d for d in databases if 'retry' in d)
  assert retries, sorted(databases)
  for d in retries:
    assert f'ckpt/1/default/{d}/manifest.ocdbt' in objects, (d, sorted(objects))
  assert_bit_identical(_restore(path, 1, state), state)


def test_restore_with_one_hung_read_finishes_with_exact_values(faulty_gcs):
  m = mesh()
  state = random_state(m)
  path = faulty_gcs.path('ckpt')
  _save(path, 1, state)
  normal = _timed(lambda: assert_bit_identical(_restore(path, 1, state), state))
  before = hedge.counts().get('read_hedged', 0)
  verified_before = orbax_pathways.stats.last_restore().chunks_verified
  faulty_gcs.proxy.hold(_array_data_read(1))
  limit = normal + SLACK_S
  with options(request_deadline_floor_s=READ_FLOOR_S):
    th, res = run_limited(lambda: _restore(path, 1, state), limit)
    held = faulty_gcs.proxy.held()
    faulty_gcs.proxy.release()
  if th.is_alive():
    th.join(120)
    pytest.fail(f'restore with one hung read did not finish within normal {normal:.1f}s + '
                f'{SLACK_S:.0f}s (held {held}; finished after {res.get("elapsed")}s)')
  print(f'\n[hung read] normal restore {normal:.1f}s, with one held read '
        f'{res["elapsed"]:.1f}s; held {held}; {hedge.counts()}')
  assert 'error' not in res, res['error']
  assert len(held) == 1, held
  assert hedge.counts().get('read_hedged', 0) > before
  assert_bit_identical(res['value'], state)
  # The answer that won was checked against the checksums recorded at save, like any other.
  assert orbax_pathways.stats.last_restore().chunks_verified == verified_before > 0


def test_restore_with_the_index_read_hung_finishes(faulty_gcs):
  """Our own metadata (``_pathways/index.msgpack``) is read with a deadline too."""
  m = mesh()
  state = random_state(m)
  path = faulty_gcs.path('ckpt')
  _save(path, 1, state)
  before = hedge.counts().get('read_hedged', 0)
  faulty_gcs.proxy.hold(
      lambda method, target: method == 'GET' and '_pathways/index.msgpack' in unquote(target))
  with options(request_deadline_floor_s=READ_FLOOR_S):
    th, res = run_limited(lambda: _restore(path, 1, state), SLACK_S + 10)
    held = faulty_gcs.proxy.held()
    faulty_gcs.proxy.release()
    th.join(120)
  assert not th.is_alive() and res['elapsed'] < SLACK_S + 10, (res, held)
  assert 'error' not in res, res['error']
  assert len(held) == 1, held
  assert hedge.counts().get('read_hedged', 0) > before
  assert_bit_identical(res['value'], state)


def test_restore_whose_every_request_hangs_fails_naming_the_array(faulty_gcs):
  """Storage that accepts and never answers: the restore fails, naming the array and the
  path, once every attempt passed its deadline; it does not hang."""
  m = mesh()
  state = random_state(m)
  del state['step']  # only our arrays: Orbax's own scalar read would wait on its own timeout
  path = faulty_gcs.path('ckpt')
  _save(path, 1, state)
  with options(request_deadline_floor_s=1.0, request_deadline_cap_s=1.0):
    faulty_gcs.proxy.hold(_array_data_read(1), count=1000)
    th, res = run_limited(lambda: _restore(path, 1, state), SLACK_S + 10)
    faulty_gcs.proxy.release()
    th.join(120)
  assert not th.is_alive()
  err = res.get('error')
  assert err is not None, 'the restore succeeded although no data read was ever answered'
  text = f'{type(err).__name__}: {err}'
  print(f'\n[all hung] failed after {res["elapsed"]:.1f}s: {text[:600]}')
  assert 'no answer from storage' in text and f'{path}/1/default/' in text, text
  assert any(f"'{n}'" in text for n in ('params.w', 'params.b', 'params.e', 'opt.mu')), text
