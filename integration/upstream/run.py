"""Orbax's own upstream test suites, with and without ``import orbax_pathways``.

    python integration/upstream/run.py [--suite NAME ...] [--modes stock,pkg] [--work DIR]
                                       [--mirror GIT_DIR]

Who runs what: this script (one process, no jax) copies each upstream test file from the mirror's
HEAD into ``--work`` (never into this repository), writes ``harness_conftest.py`` there as
``conftest.py``, and runs the file with pytest in as many ``jax.distributed`` processes as
Orbax's OSS CI runs it (``_src/testing/oss/tagged_tests_whole_suite.yaml``: 2 or 4 processes,
8 CPU devices in all), once with stock Orbax (``STOCK=1``: the package never imported) and once
with the package imported first (this checkout on ``PYTHONPATH``). It prints per suite the counts
of each mode and every test whose result differs, and writes ``<work>/table.tsv`` (suite, test,
stock, package, the error's first line) and ``<work>/counts.tsv``. A test fails if it fails in
any process. ``docs/upstream_tests.md`` has the last run's triage.

chex (used by Orbax's test utilities) and grain (the emergency p2p tests), not dependencies of
this project, are installed into ``<work>/site`` with ``pip --target`` when the interpreter has
none.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = 'checkpoint/orbax/checkpoint/'


@dataclasses.dataclass(frozen=True)
class Suite:
  name: str  # the file's name in the work directory
  path: str  # under SRC in the mirror
  processes: int  # as Orbax's OSS CI runs it
  deselect: str = ''  # a pytest -k expression of tests left out (reason in `why`)
  why: str = ''


_LIMITER = ('its limiter assertion runs on process 0 only; failing there (our handlers never call '
            "Orbax's limiter object: docs/format.md) skips the restore's collectives, which "
            'deadlocks the other process; the same assertion is compared in the pytree suites')
SUITES = [
    Suite('v0_type_handlers_test', '_src/serialization/type_handlers_test.py', 2),
    Suite('v0_local_type_handlers_test', '_src/serialization/local_type_handlers_test.py', 2),
    Suite('v0_pytree_checkpoint_handler_test', '_src/handlers/pytree_checkpoint_handler_test.py', 2),
    Suite('v0_standard_checkpoint_handler_test',
          '_src/handlers/standard_checkpoint_handler_test.py', 2),
    Suite('v0_array_checkpoint_handler_test', '_src/handlers/array_checkpoint_handler_test.py', 2),
    Suite('v0_checkpointer_test', '_src/checkpointers/checkpointer_test.py', 2,
          'not test_memory_limiting', _LIMITER),
    Suite('v0_async_checkpointer_test', '_src/checkpointers/async_checkpointer_test.py', 2,
          'not test_memory_limiting', _LIMITER),
    Suite('v0_checkpoint_manager_test', 'checkpoint_manager_test.py', 4),
    Suite('v0_checkpoint_manager_slice_test', 'checkpoint_manager_slice_test.py', 4),
    Suite('em_single_slice_checkpoint_manager_test',
          'experimental/emergency/single_slice_checkpoint_manager_test.py', 4),
    Suite('em_checkpoint_manager_test', 'experimental/emergency/checkpoint_manager_test.py', 4),
    # The emergency manager's peers: Orbax's other multi-tier managers and their helpers, run
    # with the package imported to show that its drop-in leaves them Orbax's.
    Suite('em_mesh_consistency_test', 'experimental/emergency/mesh_consistency_test.py', 1),
    Suite('em_replicator_checkpoint_manager_test',
          'experimental/emergency/multi_tier_checkpointing/replicator_checkpoint_manager_test.py',
          4, 'not test_save_restore_single_slice',
          'fails alike in both modes against Orbax 0.12.8 (a missing chunk in a process\'s local '
          'directory), then stock hangs in its later tests\' barriers'),
    Suite('em_p2p_checkpoint_manager_multiprocess_test',
          'experimental/emergency/p2p/checkpoint_manager_multiprocess_test.py', 2),
    Suite('em_p2p_local_multiprocess_test', 'experimental/emergency/p2p/local_multiprocess_test.py',
          2),
    Suite('em_p2p_persistent_multiprocess_test',
          'experimental/emergency/p2p/persistent_multiprocess_test.py', 2),
    Suite('v1_pytree_handler_test', 'experimental/v1/_src/handlers/pytree_handler_test.py', 2),
    Suite('v1_pytree_handler_partial_save_test',
          'experimental/v1/_src/handlers/pytree_handler_partial_save_test.py', 2),
    Suite('v1_saving_multihost_test', 'experimental/v1/_src/partial/saving_multihost_test.py', 2),
    Suite('v1_array_leaf_handler_test',
          'experimental/v1/_src/serialization/array_leaf_handler_test.py', 2),
    Suite('v1_numpy_leaf_handler_test',
          'experimental/v1/_src/serialization/numpy_leaf_handler_test.py', 2),
    Suite('v1_scalar_leaf_handler_test',
          'experimental/v1/_src/serialization/scalar_leaf_handler_test.py', 2),
    Suite('v1_save_load_test', 'experimental/v1/_src/testing/save_load_test.py', 2),
    # Upstream's OSS tree has the base class only; v1_checkpointer_test.py instantiates it.
    Suite('v1_checkpointer_test', 'experimental/v1/_src/training/checkpointer_test_base.py', 2),
]
# Files other suites import, copied beside them.
HELPERS = {'v1_saving_test': 'experimental/v1/_src/partial/saving_test.py'}
V1_CHECKPOINTER = '''"""v1 training.Checkpointer: upstream's checkpointer_test_base.py, instantiated."""
from absl.testing import absltest
from v1_checkpointer_test_base import CheckpointerTestBase


class CheckpointerTest(CheckpointerTestBase.Test):
  pass


class DeprecationsTest(CheckpointerTestBase.DeprecationsTest):
  pass


if __name__ == '__main__':
  absltest.main()
'''


def _show(mirror: str, path: str) -> str:
  return subprocess.run(['git', f'--git-dir={mirror}', 'show', f'HEAD:{SRC}{path}'], check=True,
                        capture_output=True, text=True).stdout


def prepare(work: str, mirror: str, suites: list[Suite]) -> None:
  """The work directory: tests/, conftest.py, pytest.ini, site/ (chex if needed)."""
  tests = os.path.join(work, 'tests')
  os.makedirs(tests, exist_ok=True)
  for s in suites:
    if s.name == 'v1_checkpointer_test':
      with open(os.path.join(tests, 'v1_checkpointer_test_base.py'), 'w') as f:
        f.write(_show(mirror, s.path))
      with open(os.path.join(tests, 'v1_checkpointer_test.py'), 'w') as f:
        f.write(V1_CHECKPOINTER)
    else:
      with open(os.path.join(tests, s.name + '.py'), 'w') as f:
        f.write(_show(mirror, s.path))
  for name, path in HELPERS.items():
    with open(os.path.join(tests, name + '.py'), 'w') as f:
      f.write(_show(mirror, path))
  shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'harness_conftest.py'),
              os.path.join(work, 'conftest.py'))
  with open(os.path.join(work, 'pytest.ini'), 'w') as f:
    f.write('[pytest]\npython_files = *_test.py\naddopts = -p no:cacheprovider -q -rfE\n'
            'timeout = 300\ntimeout_method = thread\n')
  site = os.path.join(work, 'site')
  has_chex = subprocess.run([sys.executable, '-c', 'import chex'], capture_output=True).returncode == 0
  if not has_chex and not os.path.isdir(os.path.join(site, 'chex')):
    subprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet', '--no-deps', '--target',
                    site, 'chex', 'toolz'], check=True)
  # grain (the emergency p2p tests save a data iterator with it), with what it imports that the
  # project's venv lacks; not a dependency of this project.
  has_grain = subprocess.run([sys.executable, '-c', 'import grain.python'],
                             capture_output=True).returncode == 0
  if not has_grain and not os.path.isdir(os.path.join(site, 'grain')):
    subprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet', '--no-deps', '--target',
                    site, 'grain', 'dm-tree', 'more-itertools', 'array-record', 'portpicker'],
                   check=True)


def _port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def run_suite(work: str, s: Suite, mode: str, timeout_s: float) -> list[str]:
  """Runs one suite in one mode; returns its processes' junit XML paths."""
  n = s.processes
  port = _port()
  tmp = tempfile.mkdtemp(prefix=f'{mode}.{s.name}.', dir=os.path.join(work, 'tmp'))
  procs, xmls = [], []
  for i in range(n):
    env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}',
               JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i), UP_DEVICES=str(8 // n),
               TEST_TMPDIR=tmp, UP_SUITE=s.name, JAX_CPU_COLLECTIVES_IMPLEMENTATION='gloo')
    env.pop('STOCK', None)
    if mode == 'stock':
      env['STOCK'] = '1'
      env.pop('PYTHONPATH', None)
    else:
      env['PYTHONPATH'] = REPO
    xml = os.path.join(work, 'results', f'{mode}.{s.name}.p{i}.xml')
    xmls.append(xml)
    args = [sys.executable, '-m', 'pytest', f'tests/{s.name}.py', f'--junitxml={xml}']
    if s.deselect:
      args += ['-k', s.deselect]
    log = open(os.path.join(work, 'logs', f'{mode}.{s.name}.p{i}.log'), 'w')
    procs.append(subprocess.Popen(args, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT))
  for p in procs:
    try:
      p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
  return [x for x in xmls if os.path.exists(x)]


def results(xmls: list[str]) -> dict[str, tuple[str, str]]:
  """test id -> (pass|FAIL|ERROR|skip, first line of the message); failed if failed anywhere."""
  out: dict[str, tuple[str, str]] = {}
  for path in xmls:
    for tc in ET.parse(path).getroot().iter('testcase'):
      tid = f"{tc.get('classname', '').split('.')[-1]}::{tc.get('name')}"
      status, msg = 'pass', ''
      for kind, label in (('failure', 'FAIL'), ('error', 'ERROR'), ('skipped', 'skip')):
        e = tc.find(kind)
        if e is not None:
          status = label
          msg = ((e.get('message') or e.text or '').strip().splitlines() or [''])[0][:300]
          break
      prev = out.get(tid)
      if prev is None or (prev[0] in ('pass', 'skip') and status in ('FAIL', 'ERROR')):
        out[tid] = (status, msg)
  return out


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--mirror', default='/work/.mirror/google+orbax/repo')
  ap.add_argument('--work', default=os.path.join(tempfile.gettempdir(), 'orbax-upstream'))
  ap.add_argument('--suite', action='append', help='suite name (default: all)')
  ap.add_argument('--modes', default='stock,pkg')
  ap.add_argument('--timeout-s', type=float, default=3000)
  a = ap.parse_args(argv)
  suites = [s for s in SUITES if not a.suite or s.name in a.suite]
  for sub in ('results', 'logs', 'tmp'):
    os.makedirs(os.path.join(a.work, sub), exist_ok=True)
  prepare(a.work, a.mirror, suites)
  modes = a.modes.split(',')
  rows, counts = [], []
  for s in suites:
    got = {m: results(run_suite(a.work, s, m, a.timeout_s)) for m in modes}
    tally = {m: collections.Counter(v[0] for v in got[m].values()) for m in modes}
    print(f'== {s.name} ({s.processes} processes)' + (f'; left out: {s.deselect}' if s.deselect else ''))
    for m in modes:
      print(f'   {m}: {dict(tally[m])}')
      counts.append((s.name, m, tally[m]['pass'], tally[m]['FAIL'] + tally[m]['ERROR'],
                     tally[m]['skip']))
    ids = sorted(set().union(*(got[m] for m in modes)))
    for tid in ids:
      r = [got[m].get(tid, ('-', '')) for m in modes]
      if len({x[0] for x in r}) > 1 or any(x[0] in ('FAIL', 'ERROR') for x in r):
        msg = next((x[1] for x in reversed(r) if x[0] in ('FAIL', 'ERROR')), '')
        rows.append((s.name, tid, *(x[0] for x in r), msg))
        if len({x[0] for x in r}) > 1:
          print(f'   {tid}: ' + ' -> '.join(x[0] for x in r) + f'  {msg[:160]}')
  with open(os.path.join(a.work, 'table.tsv'), 'w') as f:
    f.write('\t'.join(['suite', 'test', *modes, 'error']) + '\n')
    f.writelines('\t'.join(r) + '\n' for r in rows)
  with open(os.path.join(a.work, 'counts.tsv'), 'w') as f:
    f.write('suite\tmode\tpassed\tfailed\tskipped\n')
    f.writelines('\t'.join(map(str, c)) + '\n' for c in counts)
  print(f'table: {os.path.join(a.work, "table.tsv")}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
