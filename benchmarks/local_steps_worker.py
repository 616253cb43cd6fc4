"""One process of ``benchmarks/local_steps.py`` (its ``_run`` starts 4 of them through
``tests/support/mp_harness.run_processes``, with the arguments that function passes):
trains and saves with the mode's options, or restarts and resumes, and emits its
measurements as JSON (``mp_worker.emit``). Not run by hand."""

import json, os, resource, sys, time
from support import mp_worker
mp_worker.init()
import jax, numpy as np
import orbax.checkpoint as ocp
import orbax_pathways
from orbax_pathways import preemption, stats
from jax.experimental import multihost_utils

P = jax.sharding.PartitionSpec
mode, root, mib, steps, step_s, storage_every, layout = (
    sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]),
    int(sys.argv[6]), sys.argv[7])
train_only = sys.argv[8] == 'train_only'  # steps 1.., no storage save; the last save's stats
update = sys.argv[9]  # 'host': numpy + a transfer per step; 'device': a jitted add on the devices
n_leaves = int(sys.argv[11])  # the state's rows split into this many arrays ('w' when 1)
api = sys.argv[10]  # 'v0': an unchanged CheckpointManager; 'v1': Orbax v1's training.Checkpointer
# 'emergency': Orbax's emergency CheckpointManager built as MaxText builds it
local_every = int(sys.argv[12])
if api == 'emergency':
  from absl import flags
  from orbax.checkpoint.experimental.emergency import checkpoint_manager as em
  if not flags.FLAGS.is_parsed():  # MaxText runs under absl.app, which parses them
    flags.FLAGS.mark_as_parsed()
  flags.FLAGS.experimental_orbax_use_distributed_process_id = True  # as MaxText does
  ocp.multihost.initialize_runtime_to_distributed_ids()
  ocp.multihost.initialize_distributed_to_device_ids()
  layout = 'replicated'  # its slices are replicas (each holds the whole state)
n = jax.device_count()
unit = 24 * n_leaves
rows = max(unit, int(mib * (1 << 20) * 4 / 4 / 1024) // unit * unit)  # saved on 4 processes
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mesh = jax.sharding.Mesh(np.array(devices).reshape(n // 2, 2), ('x', 'y'))  # a slice a process
# sharded: over every device; replicated: over each slice's 2 devices, every slice holding all
sharding = jax.sharding.NamedSharding(mesh, P('x', 'y') if layout == 'sharded' else P(None, 'y'))
part = rows // n_leaves
# The state's values: element (r, c) of the whole (rows, 1024) array is r * 1024 + c (as
# float32), plus the step. Each leaf is a band of rows; a shard's values are computed from its
# index alone, so no process holds the whole array beside its shards (at 256 MiB per process
# that would be 1 GiB more on each).
bands = ({'w': 0} if n_leaves == 1 else {f'w{k:03d}': k * part for k in range(n_leaves)})
shape = (part, 1024)


noise = os.environ.get('ORBAX_PATHWAYS_BENCH_VALUES') == 'noise'


def values(row0, index):
  """The base values of the shard at ``index`` (slices) of the leaf whose rows start at
  ``row0``: r * 1024 + c, or with ``--values noise`` a float32 in [1, 2) whose 23 mantissa
  bits are a hash of r * 1024 + c (as little to compress as in trained weights: their exponents
  alike, their mantissas random)."""
  r = range(*index[0].indices(part))
  c = range(*index[1].indices(1024))
  flat = ((np.arange(r.start, r.stop, dtype=np.int64)[:, None] + row0) * 1024
          + np.arange(c.start, c.stop, dtype=np.int64)[None, :])
  if not noise:
    return flat.astype(np.float32)
  x = flat.astype(np.uint64)  # splitmix64's finalizer: every bit of the index mixed into all
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xbf58476d1ce4e5b9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94d049bb133111eb)
  x = x ^ (x >> np.uint64(31))
  return ((x >> np.uint64(41)).astype(np.uint32) | np.uint32(0x3F800000)).view(np.float32)


def state(step):
  return {name: jax.make_array_from_callback(shape, sharding,
                                             lambda i, r0=r0: values(r0, i) + np.float32(step))
          for name, r0 in bands.items()}

if update == 'device':  # the same values, computed where a training step computes: on the devices
  _base = state(0)
  _add = jax.jit(lambda b, k: b + k, out_shardings=sharding)

  def state(step):  # pylint: disable=function-redefined
    return {name: _add(b, np.float32(step)) for name, b in _base.items()}

opts = ocp.CheckpointManagerOptions(save_interval_steps=storage_every, max_to_keep=2)

def manager():
  if api == 'v0':
    return ocp.CheckpointManager(root, options=opts)
  if api == 'emergency':
    from etils import epath
    if jax.process_index() == 0 and not epath.Path(root).exists():
      # Orbax's class wants the persistent directory to exist; on GCS, one object makes it.
      (epath.Path(root) / '.created').write_text('')
    multihost_utils.sync_global_devices('persistent directory')
    abstract = {name: jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
                for name in bands}
    return em.CheckpointManager(
        os.environ['ORBAX_PATHWAYS_TIER_DIR'], root, global_mesh=mesh, abstract_state=abstract,
        options=em.CheckpointManagerOptions(
            local=em.LocalCheckpointOptions(save_interval_steps=local_every, max_to_keep=2),
            persistent=em.PersistentCheckpointOptions(save_interval_steps=storage_every,
                                                      max_to_keep=2)))
  policies = ocp.v1.training.save_decision_policies
  return ocp.v1.training.Checkpointer(
      root, save_decision_policy=policies.AnySavePolicy(
          [policies.InitialSavePolicy(), policies.FixedIntervalPolicy(storage_every)]),
      preservation_policy=ocp.v1.training.preservation_policies.LatestN(2))

def save(m, step, s):
  if api == 'emergency':  # MaxText's save_checkpoint: every step; the manager decides
    m.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(s)))
  elif api == 'v0':
    m.save(step, args=ocp.args.StandardSave(s))
  else:
    m.save(step, s)

def _snapshot_s(st):  # the save's own part of the loop's save(): the device-to-host snapshot
  return st.blocking_s if st.loop_snapshot_s is None else st.loop_snapshot_s

def _copies_held(tier_dir):
  """The whole partner copies of node steps in this node: ``<tier>/.node-steps/<digest>.copies/
  p<process>/<step>`` (one arriving is ``<step>.incoming``)."""
  base = os.path.join(tier_dir, '.node-steps')
  if not os.path.isdir(base):
    return 0
  return sum(1 for d in os.listdir(base) if d.endswith('.copies')
             for w in os.listdir(os.path.join(base, d))
             for s in os.listdir(os.path.join(base, d, w)) if s.isdigit())


def wait(m):
  m.wait_until_finished() if api in ('v0', 'emergency') else m.wait()
if mode == 'train':
  s = state(0)
  jax.block_until_ready(s)
  multihost_utils.sync_global_devices('bare')
  t0, c0 = time.perf_counter(), time.process_time()
  for step in range(steps):  # no checkpointing: the reference step time
    time.sleep(step_s)
    s = state(step)
    jax.block_until_ready(s)
  bare = (time.perf_counter() - t0) / steps
  bare_cpu = (time.process_time() - c0) / steps  # this process's CPU per step (all threads)
  events = {}  # Orbax's own duration events during the saving loop: where save() spends time

  def on_event(name, secs, **kwargs):
    e = events.setdefault(name, [0.0, 0])
    e[0] += secs
    e[1] += 1

  with manager() as m:
    multihost_utils.sync_global_devices('train')
    jax.monitoring.register_event_duration_secs_listener(on_event)
    t0 = time.perf_counter()
    blocking = []
    last, ends, cpus = {}, [], []
    for step in range(1, steps + 1) if train_only else range(steps):
      time.sleep(step_s)
      s = state(step)  # the step's new state (its values identify the step)
      jax.block_until_ready(s)
      b0 = time.perf_counter()
      save(m, step, s)
      blocking.append(time.perf_counter() - b0)
      if train_only and step == 1:
        wait(m)  # Orbax's initial save (to storage) committed: not timed
        cpu0, wall0 = time.process_time(), time.time()
      ends.append(time.perf_counter())
      cpus.append(time.process_time())
    loop = (time.perf_counter() - t0) / steps
    if train_only:  # the steady state: every step after the first save
      loop = (ends[-1] - ends[0]) / (len(ends) - 1)
      blocking = blocking[1:]
    if train_only:  # the last local-only save's own phases, once it committed
      wait(m)
      cpu = (time.process_time() - cpu0) / (len(ends) - 1)  # the saves' background work too
      steady = (wall0, time.time(), len(ends) - 1)  # for the storage emulation's CPU
      st = stats.last_save()
      last = {'snapshot_s': _snapshot_s(st), 'write_s': st.write_s, 'commit_s': st.commit_s}
    # Killed here, inside the manager's block: no final save, no close() (which would wait for
    # the saves still committing), and whatever is still committing in the background is lost
    # (stop_all_now's os._exit waits for nothing). Every process's last save() has returned.
    multihost_utils.sync_global_devices('killed')
    mp_worker.emit({'bare_step_s': bare, 'step_s': loop, 'blocking_max_s': max(blocking),
                    # this process's peak resident memory over the training run (Linux: KiB)
                    'peak_rss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    'blocking_mean_s': sum(blocking) / len(blocking), 'last': last,
                    'blocking_s': blocking,  # each timed save()'s blocking, steps 2..
                    # per step 1..: the loop's clock and this process's CPU after the step's save
                    'ends': ends, 'cpus': cpus,
                    # per step 2..: the save's own part of the loop's save() (the snapshot) and
                    # background write (the local-only save's: the last of the step's saves)
                    'snapshot_s': [sum(_snapshot_s(x) for x in stats.saves_for_step(k))
                                   for k in range(2, steps + 1)]
                                  if train_only and steps < 64 else None,
                    'write_s': [[x.write_s for x in stats.saves_for_step(k)][-1:]
                                for k in range(2, steps + 1)] if train_only and steps < 64 else None,
                    'events': events, 'bare_cpu_s': bare_cpu,
                    'cpu_s': cpu if train_only else None,
                    # steps saved local-only after the first (with local_save_when_busy='skip'
                    # some are skipped while the previous one commits); stats keeps the last 64
                    # saves, so longer runs report none
                    'local_saves': sum(1 for k in range(2, steps + 1) if stats.saves_for_step(k))
                                   if train_only and steps < 64 else None,
                    'steady': steady if train_only else None,
                    # the partner copies of node steps this process's node keeps (once the
                    # last save and its copy are done: train_only), whole (renamed in)
                    'copies_held': _copies_held(os.environ['ORBAX_PATHWAYS_TIER_DIR'])
                                   if train_only else None})
    mp_worker.stop_all_now()
else:
  target = {name: jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
              for name in bands}
  from etils import epath
  # The storage steps committed when the job was killed (Orbax's own test of a finished step).
  committed = sorted(int(p.name) for p in epath.Path(root).iterdir()
                     if p.name.isdigit() and ocp.step.is_checkpoint_finalized(p))
  with manager() as m:
    multihost_utils.sync_global_devices('before')
    t0 = time.perf_counter()
    if api == 'emergency':  # MaxText's restore: the manager's latest step, then restore
      step = m.latest_step()
      got = m.restore(step)['state']
    else:
      step, got = preemption.resume(m, lambda: state(0), abstract_state=target)
    jax.block_until_ready(got)
    restore_s = time.perf_counter() - t0  # this process's latest_step() and restore()
    time.sleep(step_s)  # the first training step after it
    multihost_utils.sync_global_devices('after')
    wall = time.perf_counter() - t0
  for name, r0 in bands.items():
    for sh in got[name].addressable_shards:
      np.testing.assert_array_equal(np.asarray(sh.data), values(r0, sh.index) + np.float32(step))
  st = stats.last_restore()  # None where Orbax's own handlers restored (stock's emergency manager)
  mp_worker.emit({'step': step, 'resume_s': wall, 'restore_s': restore_s,
                  'storage_steps': committed,
                  'bytes_by_source': st.bytes_by_source if st is not None else None})
