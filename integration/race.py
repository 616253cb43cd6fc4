"""A trainer and evaluators racing on one checkpoint directory.

The trainer saves every step with unchanged ``CheckpointManager`` code (``max_to_keep`` 1 by
default, so every save also deletes the previous step) for ``--seconds``. Meanwhile each evaluator
process, in a loop, constructs an ordinary (not read-only) ``CheckpointManager`` on the same
directory, restores its latest step and compares the bytes with what the trainer saved there
(``--evaluator resume`` uses ``orbax_pathways.preemption.resume`` instead, as a restarted job
would; ``--evaluator both`` alternates the two kinds over the evaluator processes). At the end
the harness checks, with a fresh manager:

- **lost saves**: saves that raised in the trainer, or a final ``wait_until_finished`` that
  raised (0 expected);
- **stranded**: anything in the directory besides the trainer's last ``max_to_keep`` steps
  (unlisted step directories, ``*.orbax-pathways-deleting-*`` leftovers, temporary steps), and
  any of those last steps that is not listed or does not restore bit-exactly (0 expected);
- **wrong values**: an evaluator restore that returned other bytes than the trainer saved at that
  step (0 expected); **unexplained failures**: a failed evaluator restore of a step that is still
  listed afterwards, so that retention deleting it mid-read does not explain the failure
  (0 expected). Restores of a step deleted mid-read may fail (with max_to_keep=1 they often do).

Usage::

    python integration/race.py --seconds 20 --dir /tmp/race [--evaluators 1]
        [--evaluator manager|resume|both] [--max-to-keep 1] [--fake-gcs --dir -] [--stock]

``--stock`` runs both sides without importing orbax_pathways (stock Orbax). Prints one summary
line ``race: ...``; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

N_DEVICES = 8
ROWS, COLS = 64, 256


def _setup_env():
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  flag = f'--xla_force_host_platform_device_count={N_DEVICES}'
  if flag not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + flag).strip()


def _expected(step: int) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top
  base = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
  return {'w': base + np.float32(step), 'b': np.full((COLS,), step, np.int32)}


def _sharding():
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()[:N_DEVICES]).reshape(4, 2), ('data', 'model'))
  return NamedSharding(mesh, P('data', 'model')), NamedSharding(mesh, P('model'))


def _abstract():
  import jax  # pylint: disable=g-import-not-at-top
  sw, sb = _sharding()
  want = _expected(0)
  return {'w': jax.ShapeDtypeStruct(want['w'].shape, want['w'].dtype, sharding=sw),
          'b': jax.ShapeDtypeStruct(want['b'].shape, want['b'].dtype, sharding=sb)}


def _matches(state, step: int) -> bool:
  import numpy as np  # pylint: disable=g-import-not-at-top
  want = _expected(step)
  return set(state) == set(want) and all(
      np.asarray(state[k]).tobytes() == want[k].tobytes() for k in want)


def _short(e: BaseException) -> str:
  return f'{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ""}'


def _options(args):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp.CheckpointManagerOptions(max_to_keep=args.max_to_keep)


def trainer(args) -> dict:
  _setup_env()
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  if not args.stock:
    import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  sw, sb = _sharding()
  mngr = ocp.CheckpointManager(args.dir, options=_options(args))
  saved, lost = [], []
  deadline = time.time() + args.seconds
  step = 0
  while time.time() < deadline and step < args.max_steps:
    want = _expected(step)
    state = {'w': jax.device_put(want['w'], sw), 'b': jax.device_put(want['b'], sb)}
    try:
      if mngr.save(step, args=ocp.args.StandardSave(state)):
        saved.append(step)
    except Exception as e:  # pylint: disable=broad-except
      lost.append({'at_save': step, 'error': _short(e), 'trace': traceback.format_exc()[-2000:]})
    step += 1
  try:
    mngr.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    lost.append({'at_save': 'wait_until_finished', 'error': _short(e),
                 'trace': traceback.format_exc()[-2000:]})
  listed = list(mngr.all_steps())
  mngr.close()
  return {'saved': saved, 'lost': lost, 'listed': listed}


def evaluator(args) -> dict:
  _setup_env()
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  if not args.stock:
    from orbax_pathways import preemption  # pylint: disable=g-import-not-at-top
  abstract = _abstract()
  ok, wrong, failed_deleted, unexplained, constructed = 0, [], 0, [], 0
  deleted_errors = set()  # what a reader is told when a step is deleted under it
  while not os.path.exists(args.stop_file):
    try:
      mngr = ocp.CheckpointManager(args.dir, options=_options(args))
      constructed += 1
    except Exception as e:  # pylint: disable=broad-except
      unexplained.append({'step': None, 'error': 'constructing the manager: ' + _short(e),
                          'trace': traceback.format_exc()[-3000:]})
      time.sleep(0.05)
      continue
    step = None
    try:
      if args.kind == 'resume':
        step, state = preemption.resume(mngr, lambda: None, abstract_state=abstract)
      else:
        step = mngr.latest_step()
        state = None if step is None else mngr.restore(
            step, args=ocp.args.StandardRestore(abstract))
      if step is not None:
        if _matches(state, step):
          ok += 1
        else:
          wrong.append(step)
    except Exception as e:  # pylint: disable=broad-except
      # Acceptable only if the step was deleted (retention of a newer save) meanwhile.
      still = step is not None and step in ocp.CheckpointManager(
          args.dir, options=ocp.CheckpointManagerOptions(read_only=True)).all_steps()
      if still or step is None:
        unexplained.append({'step': step, 'error': _short(e),
                            'trace': traceback.format_exc()[-2000:]})
      else:
        failed_deleted += 1
        if len(deleted_errors) < 5:
          deleted_errors.add(_short(e)[:200])
    finally:
      try:
        mngr.close()
      except Exception:  # pylint: disable=broad-except
        pass
    time.sleep(args.eval_sleep)
  return {'ok': ok, 'wrong': wrong, 'failed_deleted': failed_deleted,
          'unexplained': unexplained, 'constructed': constructed,
          'deleted_errors': sorted(deleted_errors)}


def _final_check(args, trainer_result) -> tuple[list[str], dict]:
  """Problems found in the directory after both sides stopped."""
  _setup_env()
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  if not args.stock:
    import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  problems = []
  saved = trainer_result['saved']
  keep = saved[-args.max_to_keep:] if args.max_to_keep else saved
  directory = epath.Path(args.dir)
  names = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
  steps_on_disk = sorted(int(n) for n in names if n.isdigit())
  others = [n for n in names if not n.isdigit()]
  stranded = [s for s in steps_on_disk if s not in keep] + others
  if stranded:
    problems.append(f'stranded in {args.dir}: {stranded} (expected only steps {keep})')
  mngr = ocp.CheckpointManager(args.dir, options=ocp.CheckpointManagerOptions(read_only=True))
  listed = list(mngr.all_steps())
  if listed != keep:
    problems.append(f'a fresh manager lists {listed}, expected {keep}')
  for step in keep:
    try:
      state = mngr.restore(step, args=ocp.args.StandardRestore(_abstract()))
      if not _matches(state, step):
        problems.append(f'step {step} restores with wrong values')
    except Exception as e:  # pylint: disable=broad-except
      problems.append(f'step {step} does not restore: {_short(e)}')
  mngr.close()
  return problems, {'stranded': len(stranded), 'on_disk': names[:20]}


def _spawn(args, role: str, extra=()) -> subprocess.Popen:
  cmd = [sys.executable, os.path.abspath(__file__), '--role', role, '--dir', args.dir,
         '--seconds', str(args.seconds), '--max-to-keep', str(args.max_to_keep),
         '--max-steps', str(args.max_steps), '--evaluator', args.evaluator,
         '--eval-sleep', str(args.eval_sleep), '--stop-file', args.stop_file, *extra]
  if args.stock:
    cmd.append('--stock')
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=_die_with_parent)


def _die_with_parent():
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except OSError:
    pass


def _result(proc: subprocess.Popen, name: str, timeout: float) -> dict:
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    return {'error': f'{name} did not finish in {timeout:.0f} s', 'stderr': err[-3000:]}
  lines = [l for l in out.splitlines() if l.startswith('RESULT ')]
  if proc.returncode != 0 or not lines:
    return {'error': f'{name} exited with {proc.returncode}', 'stderr': err[-3000:]}
  return json.loads(lines[-1][len('RESULT '):])


def run(args) -> int:
  _setup_env()
  if not args.dir.startswith('gs://') and os.path.exists(args.dir):
    shutil.rmtree(args.dir)
  tmp = tempfile.mkdtemp(prefix='race-')
  args.stop_file = os.path.join(tmp, 'stop')
  t0 = time.time()
  kinds = (['manager', 'resume'] if args.evaluator == 'both' else [args.evaluator])
  evals = [_spawn(args, 'evaluator', ['--kind', kinds[i % len(kinds)]])
           for i in range(args.evaluators)]
  train = _spawn(args, 'trainer')
  limit = args.seconds + 300
  tr = _result(train, 'trainer', limit)
  open(args.stop_file, 'w').close()
  ev = [_result(p, f'evaluator {i}', 300) for i, p in enumerate(evals)]
  shutil.rmtree(tmp, ignore_errors=True)
  problems = []
  for name, r in [('trainer', tr)] + [(f'evaluator {i}', r) for i, r in enumerate(ev)]:
    if 'error' in r:
      problems.append(f'{name}: {r["error"]}\n{r.get("stderr", "")}')
  stranded = 0
  if 'error' not in tr:
    for lost in tr['lost']:
      problems.append(f'trainer lost a save at step {lost["at_save"]}: {lost["error"]}\n'
                      f'{lost["trace"] if args.verbose else ""}')
    final_problems, info = _final_check(args, tr)
    problems += final_problems
    stranded = info['stranded']
  wrong = sum(len(r.get('wrong', [])) for r in ev)
  unexplained = sum(len(r.get('unexplained', [])) for r in ev)
  for i, r in enumerate(ev):
    for s in r.get('wrong', []):
      problems.append(f'evaluator {i} restored step {s} with wrong values')
    for u in r.get('unexplained', []):
      problems.append(f'evaluator {i}: restore of step {u["step"]} failed although the step is '
                      f'still listed: {u["error"]}\n{u.get("trace", "") if args.verbose else ""}')
  mode = 'stock' if args.stock else 'orbax_pathways'
  samples = sorted({m for r in ev for m in r.get('deleted_errors', [])})
  if samples:
    print('DELETED_MID_READ', json.dumps(samples))
  for p in problems:
    print('FAIL', p)
  saves = len(tr.get('saved', []))
  lost = len(tr.get('lost', []))
  print(f'race: mode={mode} evaluator={args.evaluator}x{args.evaluators} seconds={args.seconds} '
        f'saves={saves} lost={lost} stranded={stranded} '
        f'eval_ok={sum(r.get("ok", 0) for r in ev)} '
        f'eval_failed_deleted={sum(r.get("failed_deleted", 0) for r in ev)} '
        f'eval_managers={sum(r.get("constructed", 0) for r in ev)} wrong={wrong} '
        f'unexplained={unexplained} failures={len(problems)} dir={args.dir} '
        f'elapsed={time.time() - t0:.1f}s', flush=True)
  return 1 if problems else 0


def _run_on_fake_gcs(args) -> int:
  # tests/ on sys.path: its support package has the fake-gcs-server launcher.
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  'tests'))
  from support import gcs_server  # pylint: disable=g-import-not-at-top
  with gcs_server.serving_bucket('race') as url:
    args.dir = url
    return run(args)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--seconds', type=float, default=20.0, help='how long the trainer saves')
  p.add_argument('--dir', required=True, help='checkpoint directory (local path or gs://)')
  p.add_argument('--evaluators', type=int, default=1)
  p.add_argument('--evaluator', choices=['manager', 'resume', 'both'], default='manager')
  p.add_argument('--max-to-keep', type=int, default=1)
  p.add_argument('--max-steps', type=int, default=10**9)
  p.add_argument('--eval-sleep', type=float, default=0.0)
  p.add_argument('--stock', action='store_true', help='without orbax_pathways (stock Orbax)')
  p.add_argument('--verbose', action='store_true')
  p.add_argument('--fake-gcs', action='store_true',
                 help='start fake-gcs-server on loopback and use gs://<new bucket>/ckpt')
  p.add_argument('--role', choices=['trainer', 'evaluator'], help=argparse.SUPPRESS)
  p.add_argument('--stop-file', help=argparse.SUPPRESS)
  p.add_argument('--kind', choices=['manager', 'resume'], help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.role:
    result = trainer(args) if args.role == 'trainer' else evaluator(args)
    print('RESULT ' + json.dumps(result), flush=True)
    return 0
  if args.fake_gcs:
    return _run_on_fake_gcs(args)
  return run(args)


if __name__ == '__main__':
  sys.exit(main())
