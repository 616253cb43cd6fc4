"""The main job: train, checkpoint, get preempted, lose a slice, resume on fewer slices.

    python examples/train.py                      # local directory ./ckpt-demo
    python examples/train.py --dir gs://bucket/x  # any path Orbax accepts

What happens (each phase is a separate process, as a restarted job would be):
1. Phase 1 trains a small flax/optax MLP on 8 CPU devices seen as 4 slices (mesh data=4 x model=2),
   checkpointing every 10 steps with unchanged ``ocp.CheckpointManager`` code. The driver sends
   SIGTERM (a preemption notice) mid-run: the next ``save`` is taken at the notice, committed, and
   the process exits 0.
2. Phase 2 restarts on 6 devices seen as 3 slices (one slice was lost). ``resume`` finds the latest
   complete step and restores it onto the smaller mesh (data=3 x model=2) with no hand-built
   shardings, then training continues to the end.
The only orbax-pathways lines in the training code are ``import orbax_pathways`` and ``resume``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

BATCH = 48  # divisible by every data-axis size used here (4 and 3)
SAVE_EVERY = 10


def train(args) -> None:
  """One job attempt on ``args.devices`` CPU devices grouped into ``args.slices`` slices."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from flax import linen as nn  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(256)(x))
      x = nn.relu(nn.Dense(256)(x))
      return nn.Dense(1)(x)

  devices = np.asarray(jax.devices()).reshape(args.slices, -1)  # one row per slice
  mesh = Mesh(devices, ('data', 'model'))
  model, tx = MLP(), optax.adam(1e-3)
  rng = np.random.default_rng(0)
  true_w = rng.standard_normal((64, 1)).astype(np.float32)

  def shard_params(tree):
    # Kernels split over 'model' on their output dimension when it divides, else replicated.
    def spec(x):
      return P(None, 'model') if x.ndim == 2 and x.shape[1] % 2 == 0 else P()
    return jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), tree)

  def init_state():
    params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
    params = jax.device_put(params, shard_params(params))
    opt_state = jax.jit(tx.init)(params)
    return {'params': params, 'opt_state': opt_state, 'rng': jax.random.key(1)}

  @jax.jit
  def step_fn(state, x, y):
    def loss_fn(p):
      return jnp.mean((model.apply(p, x) - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state['params'])
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    return {'params': params, 'opt_state': opt_state, 'rng': jax.random.split(state['rng'])[0]}, loss

  mngr = ocp.CheckpointManager(
      args.dir, options=ocp.CheckpointManagerOptions(save_interval_steps=SAVE_EVERY, max_to_keep=3))
  # The restore target is the state's structure with no shardings: orbax-pathways lays the saved
  # layout over whatever slices this attempt has.
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), jax.eval_shape(init_state))
  t0 = time.perf_counter()
  step, state = orbax_pathways.preemption.resume(mngr, init_state, abstract_state=abstract)
  if step is None:
    print(f'[{args.slices} slices] no checkpoint in {args.dir}: starting from scratch', flush=True)
    start = 0
  else:
    w = state['params']['params']['Dense_0']['kernel']
    print(f'[{args.slices} slices] resumed step {step} from {args.dir} in {time.perf_counter() - t0:.2f} s; '
          f'kernel sharded as {w.sharding.spec} over mesh {dict(w.sharding.mesh.shape)}', flush=True)
    by_source = orbax_pathways.stats.last_restore().bytes_by_source
    print(f'[{args.slices} slices] bytes read by source (node-local tier first, then storage): '
          + ', '.join(f'{k} {v}' for k, v in sorted(by_source.items())), flush=True)
    start = step + 1

  batch_sharding = NamedSharding(mesh, P('data'))
  for step in range(start, args.steps):
    x = rng.standard_normal((BATCH, 64)).astype(np.float32)
    x = jax.device_put(x, batch_sharding)
    y = jax.device_put(np.asarray(x) @ true_w, batch_sharding)
    state, loss = step_fn(state, x, y)
    t = time.perf_counter()
    if mngr.save(step, args=ocp.args.StandardSave(state)):
      st = orbax_pathways.stats.last_save()
      print(f'[{args.slices} slices] step {step:3d} loss {float(loss):.4f}  checkpoint: '
            f'{sum(st.d2h_bytes.values())} bytes snapshotted ({st.transport} transport), save() '
            f'blocked {(time.perf_counter() - t) * 1e3:.0f} ms, commit continues in background',
            flush=True)
    elif step % 5 == 0:
      print(f'[{args.slices} slices] step {step:3d} loss {float(loss):.4f}', flush=True)
    if mngr.reached_preemption(step):
      print(f'[{args.slices} slices] preemption notice: checkpoint of step {step} taken; '
            'waiting for its commit, then exiting', flush=True)
      orbax_pathways.preemption.exit_after_commit(mngr)
    time.sleep(args.step_sleep)
  mngr.wait_until_finished()
  print(f'[{args.slices} slices] finished {args.steps} steps; latest checkpoint {mngr.latest_step()}',
        flush=True)
  mngr.close()


def _child(args, slices: int, devices: int) -> subprocess.Popen:
  env = dict(os.environ)
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={devices}'
  env['JAX_PLATFORMS'] = 'cpu'
  env['ORBAX_PATHWAYS_NUM_SLICES'] = str(slices)  # CPU devices carry no slice_index
  cmd = [sys.executable, os.path.abspath(__file__), '--phase', 'train', '--dir', args.dir,
         '--slices', str(slices), '--steps', str(args.steps), '--step-sleep', str(args.step_sleep)]
  return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)


def drive(args) -> int:
  """Runs phase 1, preempts it, runs phase 2 on fewer slices; returns the exit code."""
  print(f'== phase 1: 8 devices as 4 slices, checkpoints in {args.dir}', flush=True)
  p = _child(args, slices=4, devices=8)
  preempted = False
  for line in p.stdout:
    print(line, end='', flush=True)
    words = line.split()
    if not preempted and words[2:3] == ['step'] and int(words[3]) >= args.preempt_at:
      print(f'== driver: sending SIGTERM (preemption notice) after step {words[3]}', flush=True)
      p.send_signal(signal.SIGTERM)
      preempted = True
  if p.wait() != 0:
    print(f'phase 1 exited with {p.returncode}', file=sys.stderr)
    return 1
  print('== phase 2: one slice lost; restart on 6 devices as 3 slices', flush=True)
  p = _child(args, slices=3, devices=6)
  for line in p.stdout:
    print(line, end='', flush=True)
  if p.wait() != 0:
    print(f'phase 2 exited with {p.returncode}', file=sys.stderr)
    return 1
  print(f'== done. Inspect the checkpoints with:\n   orbax-pathways ls {args.dir}\n'
        f'   orbax-pathways show {args.dir} --step {(args.steps - 1) // SAVE_EVERY * SAVE_EVERY}\n'
        f'   orbax-pathways verify {args.dir}/<step>', flush=True)
  return 0


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--dir', default=os.path.abspath('ckpt-demo'))
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--preempt-at', type=int, default=25)
  parser.add_argument('--step-sleep', type=float, default=0.02)
  parser.add_argument('--phase', choices=['drive', 'train'], default='drive')
  parser.add_argument('--slices', type=int, default=4)
  args = parser.parse_args()
  if args.phase == 'train':
    train(args)
    return 0
  if not args.dir.startswith('gs://') and os.path.exists(args.dir):
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(args.dir)  # a fresh demo each run
  return drive(args)


if __name__ == '__main__':
  sys.exit(main())
