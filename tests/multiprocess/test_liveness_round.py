"""The liveness round of a save (``orbax_pathways/coord/liveness.py``) against jax's real key-value
store: one ``jax.distributed`` process (a fresh interpreter) plays several processes' parts by
publishing their keys itself, or not at all.

What a user would see: who is named, what the error says, and that a primary still showing
progress in a long commit is waited for. ``tests/multiprocess/test_liveness.py`` runs the whole thing with
real processes, one of which dies.
"""

from __future__ import annotations

from support.procs import free_port, run_json

CODE = r'''
import json, threading, time
import jax
jax.distributed.initialize(coordinator_address='127.0.0.1:%d', num_processes=1, process_id=0)
from orbax_pathways import errors
from orbax_pathways.coord import liveness
from orbax_pathways._compat import jax_distributed
client = jax_distributed.distributed_client()
out = {}

def rnd(key, me, primary=0, n=3):
  return liveness.SaveRound(client, f'test/{key}', me, list(range(n)), primary, f'/ckpt/{key}', n,
                            timeout_s=1.0)

def caught(fn):
  try:
    fn()
    return None
  except errors.SaveError as e:
    return {'type': type(e).__name__, 'text': str(e), 'missing': list(getattr(e, 'missing', []))}

# 1. the primary: process 1 reported, process 2 never did
client.key_value_set(f'{rnd("a", 0).key}/1', 'ok')
out['primary_missing'] = caught(lambda: rnd('a', 0).writes_done(None, 0.0))
# a late process 2 follows the same verdict
out['late'] = caught(lambda: rnd('a', 2).writes_done(None, 0.0))

# 2. the primary: process 2 failed its writes
client.key_value_set(f'{rnd("b", 0).key}/1', 'ok')
client.key_value_set(f'{rnd("b", 0).key}/2', 'failed: OSError: disk full')
out['failed'] = caught(lambda: rnd('b', 0).writes_done(None, 0.0))

# 3. a non-primary whose primary never answers: it names the primary
out['no_primary'] = caught(lambda: rnd('c', 1).writes_done(None, 0.0))

# 4. all answered: nothing raised
for p in (1, 2):
  client.key_value_set(f'{rnd("d", 0).key}/{p}', 'ok')
out['healthy'] = caught(lambda: rnd('d', 0).writes_done(None, 0.0))
out['healthy_other'] = caught(lambda: rnd('d', 1).writes_done(None, 0.0))

# 4b. the primary's own writes failed: the others report its error at once
rnd('h', 0).writes_done(OSError('no space left'), 0.0)
out['primary_failed'] = caught(lambda: rnd('h', 1).writes_done(None, 0.0))

# 5. the commit: a primary that shows progress for 3 windows, then commits, is waited for ...
primary = rnd('e', 0)
def commit():
  primary.commit_started(); time.sleep(3.0); primary.commit_done(None)
threading.Thread(target=commit).start()
out['slow_commit'] = caught(lambda: rnd('e', 1).await_commit())
# ... one that stops is named; one whose commit failed is reported with its error
out['dead_commit'] = caught(lambda: rnd('f', 1).await_commit())
client.key_value_set(f'{rnd("g", 0).key}/commit', 'failed: ValueError: merge failed')
out['failed_commit'] = caught(lambda: rnd('g', 1).await_commit())
primary.cleanup()
out['left'] = [k for k, _ in client.key_value_dir_get(f'{rnd("e", 0).key}/')]
out['lost'] = sorted(liveness.lost_processes())
print(json.dumps(out))
'''


def test_round_names_who_is_missing_failed_or_stopped():
  out = run_json(CODE % free_port(), devices=None, timeout=240)
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
