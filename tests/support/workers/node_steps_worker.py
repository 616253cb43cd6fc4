"""One ``jax.distributed`` process of ``tests/tier/test_node_steps.py`` (``mp_harness``): a
simulated node with its own tier directory (``ORBAX_PATHWAYS_TIER_DIR``), with
``ORBAX_PATHWAYS_LOCAL_STEPS_IN=nodes`` and a local-only save every step (set by the test).

    node_steps_worker.py save|resume CKPT LAST

``save``: an unchanged ``CheckpointManager`` (``save_interval_steps=4``) saves steps 0..LAST
of a state with a sharded ``jax.Array`` (``LAYOUT=slices``: split within each process's slice,
whole in every slice), a replicated one and a numpy leaf; emits Orbax's
storage steps and the steps this node holds, and what this process asked of jax's key-value
store (every method of its coordination-service client, counted) while local-only steps 5 to 7
saved and committed. ``resume``: ``preemption.resume`` onto the current
processes, checks every addressable shard against the step it returned, saves the next step,
emits the step, where the restore read its bytes from, the steps this node holds, and what
``preemption.resume`` asked of jax's key-value store (calls by method).
"""

from __future__ import annotations

import faulthandler
import os
import sys

faulthandler.dump_traceback_later(float(os.environ.get('DUMP_S', '150')), exit=False)

from support import mp_worker as w  # pylint: disable=g-import-not-at-top

w.init()

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

import orbax_pathways  # pylint: disable=g-import-not-at-top
from orbax_pathways import preemption  # pylint: disable=g-import-not-at-top
from orbax_pathways._compat import jax_distributed  # pylint: disable=g-import-not-at-top
from orbax_pathways.multitier import node_steps  # pylint: disable=g-import-not-at-top

P = jax.sharding.PartitionSpec
MODE, CKPT, LAST = sys.argv[1], sys.argv[2], int(sys.argv[3])


def values(step: int) -> dict:
  return {'w': np.arange(64 * 16, dtype=np.float32).reshape(64, 16) + step,
          'r': np.arange(24, dtype=np.float32) - step,
          'n': np.full((3,), step, np.int64)}


def shardings() -> dict:
  if os.environ.get('LAYOUT') == 'slices':  # a slice per process, each holding all of 'w'
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices).reshape(jax.process_count(), -1), ('s', 'y'))
    return {'w': jax.sharding.NamedSharding(mesh, P(None, 'y')),
            'r': jax.sharding.NamedSharding(mesh, P())}
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  return {'w': jax.sharding.NamedSharding(mesh, P('x', None)),
          'r': jax.sharding.NamedSharding(mesh, P())}


def state(step: int) -> dict:
  v, sh = values(step), shardings()
  out = {k: jax.make_array_from_callback(v[k].shape, sh[k], lambda i, k=k: v[k][i]) for k in sh}
  out['n'] = v['n']
  return out


def equal(restored, step: int) -> bool:
  v = values(step)
  ok = np.array_equal(np.asarray(restored['n']), v['n'])
  for k in ('w', 'r'):
    ok &= all(np.array_equal(np.asarray(s.data), v[k][s.index])
              for s in restored[k].addressable_shards)
  return bool(ok)


def node_steps_held(mngr) -> list[int]:
  found = node_steps.directory_of(mngr)
  if found is None:
    return []
  return sorted(int(n) for n in os.listdir(found) if n.isdigit())


class CountingClient:
  """jax's coordination-service client, counting every call of each method by name (Orbax and
  the package read the client from ``jax._src.distributed.global_state`` at each use)."""

  def __init__(self, client):
    self._client, self.calls = client, {}

  def __getattr__(self, name):
    target = getattr(self._client, name)
    if not callable(target):
      return target

    def counted(*args, **kwargs):
      self.calls[name] = self.calls.get(name, 0) + 1
      return target(*args, **kwargs)
    return counted


  def since(self, before: dict) -> dict:
    """The calls made since ``before`` (a copy of ``calls``), by method."""
    return {k: v - before.get(k, 0) for k, v in self.calls.items() if v != before.get(k, 0)}


def counting_client() -> CountingClient:
  """jax's client counting its calls from now on, installed where every caller finds it, for
  the whole run (the package keeps what it read once per client: one client throughout)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  counting = CountingClient(distributed.global_state.client)
  distributed.global_state.client = counting
  return counting


def main() -> None:
  counting = counting_client()
  mngr = ocp.CheckpointManager(CKPT, options=ocp.CheckpointManagerOptions(
      save_interval_steps=4, max_to_keep=3))
  out: dict = {}
  first = 0
  if MODE == 'resume':
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state(0))
    abstract['n'] = np.zeros((3,), np.int64)
    before = dict(counting.calls)
    step, restored = preemption.resume(mngr, lambda: state(0), abstract_state=abstract)
    out.update(resumed=step, equal=equal(restored, step), resume_kv_calls=counting.since(before),
               sources=orbax_pathways.stats.last_restore().bytes_by_source)
    first = step + 1
  for step in range(first, LAST + 1):
    if MODE == 'save' and step == 5:  # storage step 4 committed: count local-only steps 5-7
      mngr.wait_until_finished()
      before = dict(counting.calls)
    mngr.save(step, args=ocp.args.StandardSave(state(step)))
    if MODE == 'save' and step == 7:  # wait_until_finished joins their background saves
      mngr.wait_until_finished()
      out['kv_calls'] = counting.since(before)
  mngr.wait_until_finished()
  out.update(storage_steps=list(mngr.all_steps()), node_steps=node_steps_held(mngr),
             node_dir=node_steps.directory_of(mngr))
  mngr.close()
  w.emit(out)
  jax_distributed.distributed_client().wait_at_barrier(f'node_steps_worker_{MODE}', 10 ** 6)


main()
