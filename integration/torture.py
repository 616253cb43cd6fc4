"""Kill -9 torture test for CheckpointManager + orbax_pathways retention.

Each round starts a training loop in a subprocess (8 CPU devices, ~20 MiB sharded state, async
save every step, max_to_keep=3, resuming from the latest listed step), kills it with SIGKILL at a
seeded random moment, then checks, with a fresh manager:

- every listed step restores bit-exactly (values are a deterministic function of the step);
- no committed step was lost: the latest step listed just before the kill is still listed, unless
  retention legitimately removed it, which needs max_to_keep (3) newer listed steps.

Usage::

    python integration/torture.py --rounds 20 --dir /tmp/torture [--seed 0] [--stock]

``--stock`` runs without ``orbax_pathways.manager.retention`` (stock Orbax) to show the torn-delete bug.
``--dir`` may be a gs:// path. Prints one summary line; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time

MAX_TO_KEEP = 3
N_DEVICES = 8


def _setup_env():
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  flag = f'--xla_force_host_platform_device_count={N_DEVICES}'
  if flag not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + flag).strip()


def _bases(mib: float):
  import numpy as np  # pylint: disable=g-import-not-at-top
  rows = 1024
  cols = max(N_DEVICES, int(mib * 2**20 / 4 / rows / 4) // N_DEVICES * N_DEVICES)
  rng = np.random.default_rng(1234)
  return {f'layer{i}': rng.standard_normal((rows, cols), dtype=np.float32) for i in range(4)}


def _expected(bases, step):
  import numpy as np  # pylint: disable=g-import-not-at-top
  return {k: v + np.float32(step) for k, v in bases.items()} | {'step': np.int64(step)}


def _sharding():
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()[:N_DEVICES]).reshape(4, 2), ('data', 'model'))
  return NamedSharding(mesh, P('data', 'model'))


def _install(stock: bool):
  if not stock:
    from orbax_pathways.manager import retention  # pylint: disable=g-import-not-at-top
    retention.install()


def child(directory: str, stock: bool, mib: float) -> None:
  """The training loop that gets killed."""
  _setup_env()
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  _install(stock)
  bases = _bases(mib)
  sh = _sharding()
  mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      max_to_keep=MAX_TO_KEEP))
  latest = mngr.latest_step()
  start = 0 if latest is None else latest + 1
  print('READY', start, flush=True)
  for step in range(start, 10**9):
    state = {k: jax.device_put(v, sh) for k, v in _expected(bases, step).items() if k != 'step'}
    state['step'] = step
    mngr.save(step, args=ocp.args.StandardSave(state))


def _list_steps(directory: str):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
  return mngr, list(mngr.all_steps())


def check(directory: str, bases) -> tuple[list[int], list[str]]:
  """Restores every listed step; returns (listed steps, problems)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  sh = _sharding()
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh) for k, v in bases.items()}
  abstract['step'] = 0
  mngr, steps = _list_steps(directory)
  problems = []
  for step in steps:
    try:
      got = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # pylint: disable=broad-except
      problems.append(f'step {step} listed but restore failed: {type(e).__name__}: '
                      f'{str(e).splitlines()[0][:200]}')
      continue
    want = _expected(bases, step)
    bad = [k for k in want if np.asarray(got[k]).tobytes() != np.asarray(want[k]).tobytes()]
    if bad:
      problems.append(f'step {step} restored with wrong values in {bad}')
  mngr.close()
  return steps, problems


_PARENT_ENV = 'TORTURE_PARENT_PID'


def _die_with_parent():
  """Linux, in the child: SIGKILL if the harness (``TORTURE_PARENT_PID``) dies, so no child
  outlives a crashed run; exits at once if it already has."""
  parent = os.environ.pop(_PARENT_ENV, None)
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except OSError:
    return
  if parent is not None and os.getppid() != int(parent):
    os._exit(1)  # pylint: disable=protected-access


def _popen():
  """``subprocess.Popen``, or the test suite's zygote's (``tests/support/zygote.py``: the child
  forked from a process that has imported jax and Orbax) where the tests are beside us."""
  tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'tests')
  if tests not in sys.path:
    sys.path.insert(0, tests)
  try:
    from support import zygote  # pylint: disable=g-import-not-at-top
  except ImportError:
    return subprocess.Popen
  return zygote.Popen


def _one_round(args, rnd: int, delay: float, directory: str, bases) -> tuple[list[str], int]:
  """Start a child, kill it after ``delay``, check the directory. Returns (problems, restored)."""
  proc = _popen()(
      [sys.executable, os.path.abspath(__file__), '--child', '--dir', directory, '--mib',
       str(args.mib)] + (['--stock'] if args.stock else []),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      # JAX_PLATFORMS before the child's jax is imported (a zygote's import reads it).
      env={'JAX_PLATFORMS': 'cpu', **os.environ, _PARENT_ENV: str(os.getpid())})
  try:
    ready = proc.stdout.readline()
    if not ready.startswith('READY'):
      proc.kill()
      _, err = proc.communicate()
      return [f'round {rnd}: child did not start: {err.strip().splitlines()[-1:]}'], 0
    time.sleep(delay)
    _, before = _list_steps(directory)  # a reader listing while the child saves
  finally:
    proc.send_signal(signal.SIGKILL)  # also when the listing above raised
    _, err = proc.communicate()
  problems = []
  if proc.returncode != -signal.SIGKILL:
    problems.append(f'child exited by itself (rc={proc.returncode}): '
                    f'{err.strip().splitlines()[-1:]}')
  steps, check_problems = check(directory, bases)
  problems += check_problems
  restored = len(steps) - len([p for p in check_problems if 'restore failed' in p])
  if before:
    last = before[-1]
    newer = [s for s in steps if s > last]
    if last not in steps and len(newer) < MAX_TO_KEEP:
      problems.append(f'committed step {last} (listed before the kill) is gone; listed now: '
                      f'{steps}')
  if args.verbose:
    print(f'round {rnd}: delay={delay:.2f}s before={before} after={steps} '
          f'problems={problems}', flush=True)
  return [f'round {rnd} (kill after {delay:.2f}s): {p}' for p in problems], restored


def run(args) -> int:
  _setup_env()
  _install(args.stock)
  bases = _bases(args.mib)
  rng = random.Random(args.seed)
  directory = args.dir
  if args.fresh and not directory.startswith('gs://') and os.path.exists(directory):
    shutil.rmtree(directory)
  failures = []
  restored = 0
  t0 = time.time()
  for rnd in range(args.rounds):
    delay = rng.uniform(args.min_delay, args.max_delay)
    try:
      problems, n = _one_round(args, rnd, delay, directory, bases)
    except Exception as e:  # pylint: disable=broad-except  (a harness error is a failure too)
      import traceback  # pylint: disable=g-import-not-at-top
      problems, n = [f'round {rnd}: {type(e).__name__}: {e}\n{traceback.format_exc()}'], 0
    failures += problems
    restored += n
  elapsed = time.time() - t0
  mode = 'stock' if args.stock else 'orbax_pathways'
  for f in failures:
    print('FAIL', f)
  print(f'torture: mode={mode} rounds={args.rounds} failures={len(failures)} '
        f'restored_steps={restored} seed={args.seed} dir={directory} elapsed={elapsed:.1f}s',
        flush=True)
  return 1 if failures else 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--rounds', type=int, default=20)
  p.add_argument('--dir', required=True, help='checkpoint directory (local path or gs://)')
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--mib', type=float, default=20.0, help='approximate state size')
  p.add_argument('--min-delay', type=float, default=0.3, help='seconds after READY')
  p.add_argument('--max-delay', type=float, default=2.5)
  p.add_argument('--stock', action='store_true', help='without orbax_pathways.manager.retention')
  p.add_argument('--fresh', action='store_true', help='remove a local --dir first')
  p.add_argument('--verbose', action='store_true')
  p.add_argument('--fake-gcs', action='store_true',
                 help='start fake-gcs-server (tests/support/gcs_server.py) on loopback and use '
                      'gs://<new bucket>/ckpt as --dir (give --dir -)')
  p.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    _die_with_parent()
    child(args.dir, args.stock, args.mib)
    return 0
  if args.fake_gcs:
    return _run_on_fake_gcs(args)
  return run(args)


def _run_on_fake_gcs(args) -> int:
  """Starts fake-gcs-server on loopback, points every GCS client (children inherit the
  environment) at it, and runs the rounds against a fresh bucket."""
  # tests/ on sys.path: its support package has the fake-gcs-server launcher.
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  'tests'))
  from support import gcs_server  # pylint: disable=g-import-not-at-top
  with gcs_server.serving_bucket('torture') as url:
    args.dir = url
    return run(args)


if __name__ == '__main__':
  sys.exit(main())
