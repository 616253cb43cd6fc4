"""Every kind of storage request a restore (and a save) makes on gs:// has a deadline:
one request that the server accepts and never answers, of each kind in turn,
costs a bounded wait, never a hang.

A restore reaches storage through three clients: etils.epath -> gcsfs (aiohttp) for Orbax's step
protocol (the listing of steps, existence checks, ``_CHECKPOINT_METADATA``, ``_METADATA``,
``array_metadatas``), google-cloud-storage for Orbax's bucket lookup, and tensorstore for our
``_pathways`` objects, Orbax's ``_sharding`` file and the arrays (OCDBT manifest, B-tree nodes
with the zarr metadata, chunk data). ``tests/support/workers/request_kinds_worker.py`` lists the
cases: real Orbax (v0 ``CheckpointManager`` and ``ocp.v1``), real tensorstore and gcsfs,
fake-gcs-server behind the project's fault proxy, which holds the case's request (the first of
its kind for that checkpoint; in the first case, the third object GET of a fresh
process) and answers nothing.

The steps are saved by one fresh process and restored by another (as a restarted job restores),
with the node-local tier on (its chunks then come from the tier: only metadata reaches storage)
except where a case needs the array data read from storage. The deadline floor is
``FLOOR_S`` (the option's default is 10 s), so a stall deadline is ``2 x FLOOR_S``: the same
code, a shorter wait. Before the fix every gcsfs case hung (aiohttp waits 300 s for an answer,
then gcsfs gives up) and the bucket lookup waited 60 s.
"""

from __future__ import annotations

import json
import uuid

import pytest

from orbax_pathways.storage import hedge

from support import procs
from support.workers import request_kinds_worker as worker

# An exception nobody could raise (a callback into a closed event loop) or a coroutine never
# awaited fails the test.
pytestmark = [pytest.mark.gcs, pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning'),
              pytest.mark.filterwarnings('error:coroutine .* was never awaited:RuntimeWarning')]

FLOOR_S = 1.0
# A save or restore with one hung request finishes within this (normally: 1-3 s in a warm
# process, plus one stall deadline of 2 x FLOOR_S and the client's retry backoff, which the
# worker shortens as the gcs fixtures do).
BOUND_S = 30.0


def _run(args: list[str], env: dict, timeout: float):
  return procs.run_worker(worker, *args, env=env, timeout=timeout)


@pytest.fixture(scope='module')
def results(fake_gcs, tmp_path_factory) -> dict[str, dict]:
  run_id = uuid.uuid4().hex[:8]
  for case in worker.CASES:
    fake_gcs.create_bucket(worker.case_bucket(case, run_id))
  env = {
      'ORBAX_PATHWAYS_TIER_DIR': str(tmp_path_factory.mktemp('tier')),
      'ORBAX_PATHWAYS_REQUEST_DEADLINE_FLOOR_S': FLOOR_S,
      # what hedge.py sets at import from that floor (this process already set its own)
      hedge.STALL_ENV: hedge.stall_timeout_s(FLOOR_S),
  }
  saved = _run(['save', fake_gcs.url, run_id], env, timeout=300)
  proc = _run(['run', fake_gcs.url, run_id], env, timeout=560)
  print(f'\n[request kinds] save phase {saved.stderr.strip().splitlines()[-1]}, run phase '
        f'{proc.stderr.strip().splitlines()[-1]}')
  out = {}
  for line in proc.stdout.splitlines():
    if line.startswith('{"name"'):
      r = json.loads(line)
      out[r['name']] = r
  return out


@pytest.mark.parametrize('name', [c.name for c in worker.CASES])
def test_one_hung_request_of_each_kind_costs_a_bounded_wait(results, name):
  case = worker.BY_NAME[name]
  r = results[name]
  summary = (f'{case.phase} with {case.what} ({case.client}) held: held {r["held"]}, '
             f'{r["elapsed"]:.1f}s, error {r["error"]}')
  print(f'\n[{name}] {summary}')
  assert len(r['held']) == 1, f'the request was never made: {summary}'
  assert not r['hung'], f'still waiting after {worker.LIMIT_S:.0f}s: {summary}'
  assert r['error'] is None, summary
  assert r['ok'], summary
  assert r['elapsed'] < BOUND_S, summary


def test_every_request_of_a_restore_is_of_a_kind_held_here(results):
  """The cases cover the restore's request kinds: every request a restore made (any case's) is,
  by client and operation, one that some restore case held. A kind a new Orbax or client adds
  fails here until it gets a deadline and a case."""
  held = {(k['client'], k['op']) for r in results.values() if r.get('requests') is not None
          for k in r['held_kind']}
  made: dict[tuple[str, str], set[str]] = {}
  for r in results.values():
    for req in r.get('requests') or ():
      made.setdefault((req['client'], req['op']), set()).add(req['object'])
  for kind, objects in sorted(made.items()):
    print(f'[restore requests] {kind[0]:14s} {kind[1]:7s} {sorted(objects)[:6]}')
  assert set(made) <= held, {k: sorted(v)[:6] for k, v in made.items() if k not in held}


def test_gcsfs_and_the_bucket_lookup_get_the_stall_deadline_and_uninstall_puts_them_back():
  """What ``_compat/storage_clients`` sets in this process (the behaviour is the tests above):
  gcsfs's per-request timeout is silence only (no total limit, so a long transfer that keeps
  moving is never cut), a ``requests_timeout`` the user chose stays, and ``uninstall()`` leaves
  the clients as stock Orbax has them."""
  import fsspec.config  # pylint: disable=g-import-not-at-top
  import gcsfs  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax_pathways._compat import src, storage_clients  # pylint: disable=g-import-not-at-top

  gcs_utils = src.orbax('path.gcs_utils')
  stall = hedge.stall_timeout_s(orbax_pathways.installed().options.request_deadline_floor_s)
  fs = gcsfs.GCSFileSystem()
  timeout = storage_clients.gcsfs_requests_timeout()
  assert (timeout.total, timeout.sock_read, timeout.sock_connect) == (None, stall, stall)
  assert fs.requests_timeout is timeout
  assert gcs_utils.get_bucket is storage_clients._get_bucket  # pylint: disable=protected-access
  mine = object()
  users = gcsfs.GCSFileSystem(requests_timeout=mine, project='mine')
  try:
    orbax_pathways.install(orbax_pathways.Options(request_deadline_floor_s=3.0))
    assert users.requests_timeout is mine
    assert fs.requests_timeout.sock_read == hedge.stall_timeout_s(3.0)
    orbax_pathways.uninstall()
    assert fs.requests_timeout is None and users.requests_timeout is mine
    assert 'requests_timeout' not in fsspec.config.conf.get('gs', {})
    assert gcs_utils.get_bucket is not storage_clients._get_bucket  # pylint: disable=protected-access
  finally:
    orbax_pathways.install(orbax_pathways.Options.from_env())
  assert fs.requests_timeout.sock_read == stall
