"""One process of ``integration/chaos.py``'s training job (``Job`` starts it, one per node):
resume through ``preemption.resume``, check the restored values against the step, train and
save with an unchanged ``CheckpointManager``; the fault's plan says where it dies.

    chaos_worker.py ROOT STORAGE_EVERY LOCAL_EVERY ROWS PLAN_JSON

Runs under ``tests/support/mp_worker.py`` (its environment says the process, the job and the
result files); writes ``progress_<pid>`` lines (event, step, time) into the shared directory and
emits its resume as a result line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

DEVICES = 2  # per process
STEP_S = 0.2  # one training step (a sleep: the CPU stays free for the saves)


def worker(argv) -> None:
  from support import mp_worker as w  # pylint: disable=g-import-not-at-top
  w.init()
  import threading  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from orbax_pathways import preemption, stats  # pylint: disable=g-import-not-at-top
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name

  root, storage_every, local_every, rows = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
  plan = json.loads(argv[4])
  me, n = w.process_id(), w.num_processes()
  progress = open(os.path.join(w.shared_dir(), f'progress_{me}'), 'a', encoding='ascii')

  def note(event: str, step) -> None:
    progress.write(f'{event} {step} {time.time():.3f}\n')
    progress.flush()

  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(n, DEVICES), ('x', 'y'))
  shardings = {'w': jax.sharding.NamedSharding(mesh, P('x', 'y')),
               'r': jax.sharding.NamedSharding(mesh, P())}
  bases = {'w': np.arange(rows * 256, dtype=np.float32).reshape(rows, 256),
           'r': np.arange(1024, dtype=np.float32)}
  start_arrays = {k: jax.make_array_from_callback(b.shape, shardings[k], lambda i, b=b: b[i])
                  for k, b in bases.items()}
  add = jax.jit(lambda a, k: a + k)
  # A training step is collective (a gradient all-reduce): no process trains a step before every
  # process has reached it, so the processes' loops run in step, as a training job's do. The
  # sum over the state sharded across every process is that all-reduce here.
  reduce_all = jax.jit(lambda a: a.sum())

  def state(step: int):
    return {k: add(a, np.float32(step)) for k, a in start_arrays.items()}

  abstract = {k: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=shardings[k])
              for k, b in bases.items()}
  mine = me in plan.get('who', ())

  def kill_after(delay: float) -> None:
    t = threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL))
    t.daemon = True
    t.start()

  mngr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(
      save_interval_steps=storage_every, max_to_keep=2))
  if plan.get('when') == 'resume' and mine:
    kill_after(plan['delay'])
  t0 = time.time()
  step, got = preemption.resume(mngr, lambda: state(0), abstract_state=abstract)
  resume_s = time.time() - t0
  ok = True
  if step is not None:
    for k, b in bases.items():
      for shard in got[k].addressable_shards:
        ok &= np.asarray(shard.data).tobytes() == (b[shard.index] + np.float32(step)).tobytes()
  restore = stats.last_restore()
  w.emit({'event': 'resumed', 'step': step, 'ok': bool(ok), 'resume_s': resume_s,
          'bytes': dict(restore.bytes_by_source) if (restore and step is not None) else {}})
  note('resumed', step)
  first = 0 if step is None else step + 1
  # A planned kill strikes at the first step of its sort at or after ``target`` and after the
  # step the harness writes into the 'go' file once it has seen every process train a step
  # after the resume (so that the kill never hides whether that restart recovered; one step
  # for every process, as the processes' loops run in step).
  target, armed, gate = first + plan.get('offset', 0), None, None
  go = os.path.join(w.shared_dir(), 'go')

  def due(k: int) -> bool:
    nonlocal gate
    if gate is None:
      try:
        with open(go, encoding='ascii') as f:
          gate = int(f.read())
      except (OSError, ValueError):
        return False
    if k < max(target, gate):
      return False
    if plan.get('at') == 'storage':  # a storage step: the kill lands in its commit
      return k % storage_every == 0
    if plan.get('at') == 'local':  # a local-only step: in its write or its partner copy
      return k % local_every == 0 and k % storage_every != 0
    return True

  until = first + plan['steps'] if plan.get('steps') else 10**9
  for k in range(first, until):
    time.sleep(STEP_S)
    s = state(k)
    jax.block_until_ready((s, reduce_all(s['w'])))
    if armed is None and mine and plan.get('when') in ('in_save', 'after_save') and due(k):
      armed = k
    if k == armed and plan['when'] == 'in_save':
      kill_after(plan['delay'])
    mngr.save(k, args=ocp.args.StandardSave(s))
    if k == armed and plan['when'] == 'after_save':
      kill_after(plan['delay'])
    note('trained', k)
    if mngr.reached_preemption(k):
      w.emit({'event': 'preempted', 'step': k})
      note('preempted', k)
      preemption.exit_after_commit(mngr)
  mngr.wait_until_finished()
  mngr.close()
  note('done', until)
  w.stop_all_now()


if __name__ == '__main__':
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  'tests'))
  worker(sys.argv[1:])
