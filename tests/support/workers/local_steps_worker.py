"""One ``jax.distributed`` process of ``tests/tier/test_local_steps.py`` (``mp_harness``): a
simulated node with its own tier directory (``ORBAX_PATHWAYS_TIER_DIR``, set by the test).

    local_steps_worker.py save|resume CKPT LAYOUT

``LAYOUT``: ``sharded`` ('w' split over every device, 'r' replicated) or ``replicated`` ('w'
split over the devices of one slice only, so every slice holds all of it). Both have the numpy
leaf 'n'. Values are a function of the step.

``save``: an unchanged ``CheckpointManager`` (``save_interval_steps=100``) saves steps 0..25
with ``ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS`` set by the test; emits Orbax's steps.
``resume``: ``preemption.resume`` onto the current processes (a mesh of however many there
are), checks every addressable shard against the step it returned, emits the step and the
bytes by source. Both end in a barrier.

``KILL_AT=S``: every process SIGKILLs itself once its share of local-only step ``S`` is in its
tier, in the middle of that step's commit (no process finishes it).
``DONATE=1``: right after each ``save()`` the step's arrays are donated to a jitted step and
its numpy leaf is overwritten in place (what a training loop does next).
``PARTNER_GONE=1`` (with ``ORBAX_PATHWAYS_LOCAL_COPIES=2``): this process's tier server is gone
before it publishes its address (a partner whose process went away): its senders' copies fail.
``BUSY_AT=S`` (with ``ORBAX_PATHWAYS_LOCAL_SAVE_WHEN_BUSY=skip``): the primary host's commit of
local-only step ``S`` (its index merge, after every process's writes) waits until its loop's
``save()`` of step ``2 S`` returned (a primary host slow to commit: storage round trips), so that
save still runs when step ``2 S`` is due (on every process: the others wait in its commit's
barriers); from step ``2 S`` on the loop waits for each save, so no other step finds one
running. Emits the local-only steps listed too.
``SLOW_RETENTION=1``: the primary host (process 0) waits 2 s before each deletion of a
local-only step (a deletion taking long on storage), and every process emits the local-only
steps it lists once its ``wait_until_finished()`` returned.
``SLOW_AFTER=S`` (with ``BUSY_AT``'s loop): process 1 only is slow to finish its background
save of local-only step ``S`` once it committed (its thread sleeps 3 s more: a loaded host), so
that save still runs there when step ``2 S`` is due, while the other processes waited for
theirs after ``save()`` of step ``S``.
"""

from __future__ import annotations

import os
import sys


def values(step: int):
  import numpy as np  # pylint: disable=g-import-not-at-top
  return {'w': np.arange(96 * 64, dtype=np.float32).reshape(96, 64) * 0.5 + step,
          'r': np.arange(40, dtype=np.float32) - step,
          'n': np.full((3,), step, np.int64)}


def shardings(layout: str) -> dict:
  """'w' and 'r' over a mesh of (devices / 2, 2) of every process's devices (``LAYOUT``)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  n = jax.device_count()
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(n // 2, 2), ('x', 'y'))
  w_spec = P('x', 'y') if layout == 'sharded' else P(None, 'y')
  return {'w': jax.sharding.NamedSharding(mesh, w_spec),
          'r': jax.sharding.NamedSharding(mesh, P())}


def state_of(step: int, shard: dict) -> dict:
  """Step ``step``'s values: 'w' and 'r' placed as ``shard`` says, 'n' a numpy leaf."""
  import jax  # pylint: disable=g-import-not-at-top
  host = values(step)
  out = {k: jax.make_array_from_callback(host[k].shape, shard[k], lambda i, k=k: host[k][i])
         for k in shard}
  out['n'] = host['n']
  return out


def target_of(shard: dict) -> dict:
  """The resume's abstract state: 'w' and 'r' placed as ``shard`` says, 'n' a numpy leaf."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  host = values(0)
  out = {k: jax.ShapeDtypeStruct(host[k].shape, host[k].dtype, sharding=shard[k]) for k in shard}
  out['n'] = np.zeros((3,), np.int64)
  return out


def assert_step(got: dict, step: int) -> None:
  """Every addressable shard of ``got`` and its numpy leaf hold step ``step``'s values."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  want = values(step)
  for k in ('w', 'r'):
    for s in got[k].addressable_shards:
      np.testing.assert_array_equal(np.asarray(s.data), want[k][s.index])
  np.testing.assert_array_equal(got['n'], want['n'])


def main() -> None:
  from support import mp_worker  # pylint: disable=g-import-not-at-top

  mp_worker.init()
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from orbax_pathways import preemption  # pylint: disable=g-import-not-at-top
  from orbax_pathways import stats  # pylint: disable=g-import-not-at-top

  if os.environ.get('KILL_AT'):
    from orbax_pathways.tier import store as tier_store  # pylint: disable=g-import-not-at-top
    write_entry, kill_at = tier_store.write_entry, os.environ['KILL_AT']

    def write_then_die(cfg, item_dir, *a, **k):
      out = write_entry(cfg, item_dir, *a, **k)
      if '.orbax-pathways-local' in str(item_dir) and tier_store.manifest_lib.split_item_dir(
          item_dir)[1] == kill_at:
        from support import mp_worker  # pylint: disable=g-import-not-at-top
        mp_worker.stop_all_now(120, kill=True)  # process 0 last (CI: a peer aborted by jax)
      return out

    tier_store.write_entry = write_then_die
  if os.environ.get('PARTNER_GONE'):
    from orbax_pathways.peer import server as peer_server  # pylint: disable=g-import-not-at-top
    serve = peer_server.serve

    def serve_then_gone(*a, **k):
      # Closed before its address is published: a sender that reads the address at once never
      # finds the server still listening.
      address = serve(*a, **k)
      peer_server.stop_serving()
      return address

    peer_server.serve = serve_then_gone

  busy_at = int(os.environ.get('BUSY_AT') or os.environ.get('SLOW_AFTER') or '0')
  released = None
  if busy_at:
    import threading  # pylint: disable=g-import-not-at-top
    from orbax_pathways.storage import index  # pylint: disable=g-import-not-at-top
    from orbax_pathways.tier import manifest  # pylint: disable=g-import-not-at-top
    merge_item, released = index.merge_item, threading.Event()

    def merge_when_released(item_dir, *a, **k):
      if (os.environ.get('BUSY_AT') and '.orbax-pathways-local' in str(item_dir)
          and manifest.split_item_dir(item_dir)[1] == str(busy_at)):
        assert released.wait(300), 'step 2 S was never saved'
      return merge_item(item_dir, *a, **k)

    index.merge_item = merge_when_released
  slow_after = int(os.environ.get('SLOW_AFTER', '0'))
  if slow_after and jax.process_index() == 1:
    import time  # pylint: disable=g-import-not-at-top
    from orbax_pathways.multitier import local_steps  # pylint: disable=g-import-not-at-top
    run = local_steps.LocalStepHooks._run  # pylint: disable=protected-access

    def slow_run(mngr, inner, step, *a, **k):
      run(mngr, inner, step, *a, **k)
      if step == slow_after:
        time.sleep(3)  # far longer than this loop takes to reach step 2 S

    local_steps.LocalStepHooks._run = staticmethod(slow_run)  # pylint: disable=protected-access

  slow_retention = bool(os.environ.get('SLOW_RETENTION'))
  if slow_retention and jax.process_index() == 0:
    import time  # pylint: disable=g-import-not-at-top
    from orbax.checkpoint._src.path import deleter  # pylint: disable=g-import-not-at-top
    delete = deleter.StandardCheckpointDeleter.delete

    def slow_delete(self, step):
      if '.orbax-pathways-local' in str(self._directory):  # pylint: disable=protected-access
        time.sleep(2)
      return delete(self, step)

    deleter.StandardCheckpointDeleter.delete = slow_delete

  mode, root, layout = sys.argv[1], sys.argv[2], sys.argv[3]
  shard = shardings(layout)

  def state(step):
    return state_of(step, shard)

  options = ocp.CheckpointManagerOptions(save_interval_steps=100)
  with ocp.CheckpointManager(root, options=options) as m:
    if mode == 'save':
      own = jax.jit(lambda t: jax.tree.map(lambda x: x + 0, t))  # buffers jax owns
      spoil = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 1, t), donate_argnums=0)
      for step in range(26):
        st = state(step)
        if os.environ.get('DONATE'):
          st = {**own({k: st[k] for k in shard}), 'n': st['n']}
        m.save(step, args=ocp.args.StandardSave(st))
        if os.environ.get('DONATE'):
          # The loop goes on at once: the arrays donated to the next step, the numpy leaf
          # overwritten in place, while the local-only save runs in the background.
          # (On CPU jax declines to donate a buffer that a host view holds: the save's
          # snapshot. Without one, the arrays are deleted here.)
          spoil({k: st[k] for k in shard})
          st['n'][...] = -1
        if slow_after and step == slow_after and jax.process_index() != 1:
          m.wait_until_finished()  # here the save of S is done by step 2 S; process 1's is not
        if busy_at and step == 2 * busy_at:
          released.set()
        if busy_at and step >= 2 * busy_at:
          m.wait_until_finished()
      m.wait_until_finished()
      out = {'steps': m.all_steps()}
      if busy_at or slow_retention:
        out['local_steps'] = sorted(int(p) for p in os.listdir(os.path.join(
            root, '.orbax-pathways-local')) if p.isdigit())
      mp_worker.emit(out)
    else:
      step, got = preemption.resume(m, lambda: None, abstract_state=target_of(shard))
      assert_step(got, step)
      st = stats.last_restore()
      mp_worker.emit({'step': step, 'exact': True, 'bytes_by_source': st.bytes_by_source,
                      'storage_steps': m.all_steps()})
    multihost_utils.sync_global_devices('done')


if __name__ == '__main__':
  main()
