"""The liveness round of a save (``orbax_pathways/coord/liveness.py``) against jax's real key-value
store: one ``jax.distributed`` process (a fresh interpreter) plays several processes' parts by
publishing their keys itself, or not at all (``support/workers/liveness_round_worker.py``).

What a user would see: who is named, what the error says, and that a primary still showing
progress in a long commit is waited for. ``tests/multiprocess/test_liveness.py`` runs the whole thing with
real processes, one of which dies.
"""

from __future__ import annotations

from support.procs import free_port, worker_json
from support.workers import liveness_round_worker


def test_round_names_who_is_missing_failed_or_stopped():
  out = worker_json(liveness_round_worker, free_port(), devices=None, timeout=240)
  pm = out['primary_missing']
  assert pm['type'] == 'PeerLostError' and pm['missing'] == [2], pm
  assert 'process 2' in pm['text'] and 'of 3 did not report that its writes finished' in pm['text']
  assert '/ckpt/a' in pm['text'] and 'not committed' in pm['text'], pm
  assert out['late']['missing'] == [2] and 'answered too late' in out['late']['text'], out['late']
  f = out['failed']
  assert f['type'] == 'SaveError' and 'process 2 failed its writes: OSError: disk full' in f['text']
  np_ = out['no_primary']
  assert np_['type'] == 'PeerLostError' and np_['missing'] == [0], np_
  assert out['healthy'] is None and out['healthy_other'] is None, out
  pf = out['primary_failed']
  assert pf['type'] == 'SaveError' and 'process 0 failed its writes: OSError: no space left' in \
      pf['text'], pf
  assert out['slow_commit'] is None, out['slow_commit']
  dc = out['dead_commit']
  assert dc['missing'] == [0] and 'show progress in its commit' in dc['text'], dc
  assert 'merge failed' in out['failed_commit']['text'], out['failed_commit']
  assert 'process 0' in out['failed_commit']['text'], out['failed_commit']
  assert out['left'] == [], out['left']
  assert out['lost'] == [0, 2], out['lost']


def test_uninstall_puts_orbax_back_exactly():
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.checkpointers import async_checkpointer as ac  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.multihost import multihost  # pylint: disable=g-import-not-at-top
  from orbax_pathways._compat import orbax_liveness  # pylint: disable=g-import-not-at-top
  owners = {'__init__': ac.AsyncCheckpointer, 'start_async_commit': ac._AsyncManager,  # pylint: disable=protected-access
            'sync_global_processes': multihost, 'get_barrier_sync_fn': multihost}
  originals = orbax_liveness.originals()
  assert set(originals) == set(owners)
  assert all(vars(o)[name] is not originals[name] for name, o in owners.items())
  orbax_pathways.uninstall()
  try:
    assert all(vars(o)[name] is originals[name] for name, o in owners.items())
    assert not orbax_liveness.installed()
  finally:
    orbax_pathways.install()
  orbax_pathways.install()  # idempotent: Orbax's own functions wrapped once
  assert orbax_liveness.originals() == originals
