"""conftest.py of the work directory ``run.py`` prepares (copied there; never collected here).

Runs one of Orbax's upstream test files as Orbax's OSS CI does: in several ``jax.distributed``
processes on CPU (``JAX_PROCESS_ID`` etc. set by ``run.py``; gloo collectives), or in one. With
``STOCK=1`` the package is never imported (checked at the end); otherwise ``import orbax_pathways``
runs first, as a user's program does, with the node-local tier off (as ``tests/conftest.py``).

Shims for what Orbax's OSS tree does not ship as a module: ``multiprocess_test`` (upstream's
``_src/testing/multiprocess_test.py`` + ``oss/multiprocess_test.py`` at HEAD, inlined: a barrier
and an operation-id sync per test, process 0 creates the temporary directory), ``grain`` (not
installed: a stand-in module, where one v1 test fails alike in both modes; ``run.py`` installs
the real one into ``site/`` for the emergency p2p tests), v1 ``partial/saving_test`` under its
package name (imported by ``saving_multihost_test``). Harness-only adjustments: the aggregate tests
read Orbax's test data relative to the installed package; assertion messages are not shortened.
"""
import os
import sys
import types

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ['XLA_FLAGS'] = (
    f'--xla_force_host_platform_device_count={int(os.environ.get("UP_DEVICES", "8"))}')
os.environ.setdefault('ORBAX_PATHWAYS_TIER_DIR', 'off')
HERE = os.path.dirname(os.path.abspath(__file__))
if 'TEST_TMPDIR' not in os.environ:  # run.py sets one, shared by a suite's processes
  import tempfile
  os.environ['TEST_TMPDIR'] = tempfile.mkdtemp(prefix='single.', dir=HERE)
sys.path.insert(0, os.path.join(HERE, 'tests'))
sys.path.insert(0, os.path.join(HERE, 'site'))  # chex (pip --target): not in the project's venv

import jax  # noqa: E402

if 'JAX_PROCESS_ID' in os.environ:
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator_address=os.environ['JAX_COORDINATOR_ADDRESS'],
                             num_processes=int(os.environ['JAX_NUM_PROCESSES']),
                             process_id=int(os.environ['JAX_PROCESS_ID']))

from absl import flags  # noqa: E402
from absl.testing import absltest  # noqa: E402
flags.FLAGS.mark_as_parsed()

from orbax.checkpoint._src.futures import synchronization  # noqa: E402
from orbax.checkpoint._src.multihost import multihost  # noqa: E402
import orbax.checkpoint._src.testing as _testing  # noqa: E402
import orbax.checkpoint._src.testing.oss as _testing_oss  # noqa: E402


def _sync_operation_id(client, sync_key):
  if jax.process_index() == 0:
    client.key_value_set(sync_key, synchronization.OperationIdGenerator.get_current_operation_id(),
                         allow_overwrite=True)
  target = int(client.blocking_key_value_get(sync_key, 10000))
  while int(synchronization.OperationIdGenerator.get_current_operation_id()) < target:
    synchronization.OperationIdGenerator.next_operation_id()


class MultiProcessTest(absltest.TestCase):
  """Upstream's MultiProcessTest. The barrier is named by class and method (not by ``id()``,
  whose parameter reprs may differ between processes)."""

  def setUp(self):
    super().setUp()
    if jax.process_count() > 1:
      name = f'{type(self).__name__}.{self._testMethodName}'
      client = multihost.get_jax_distributed_client()
      client.wait_at_barrier(
          f'multiprocess_test_ensure_all_processes_arrive_at_test_case_{name}', 60000)
      _sync_operation_id(client, f'sync_op_id_{name}')

  def multiprocess_create_tempdir(self, name=None):
    d = self._get_tempdir_path_test()
    if name is not None:
      d = os.path.join(d, name)
    if jax.process_index() == 0:
      os.makedirs(d, exist_ok=False)
    if jax.process_count() > 1:
      jax.experimental.multihost_utils.sync_global_devices('multiprocess_create_tempdir')
    return d


_mpt = types.ModuleType('orbax.checkpoint._src.testing.multiprocess_test')
_mpt.MultiProcessTest = MultiProcessTest
_mpt.main = absltest.main
for _name, _parent in (('orbax.checkpoint._src.testing.multiprocess_test', _testing),
                       ('orbax.checkpoint._src.testing.oss.multiprocess_test', _testing_oss)):
  sys.modules[_name] = _mpt
  setattr(_parent, 'multiprocess_test', _mpt)

import chex  # noqa: E402,F401  (the real one, in site/)

try:
  import grain.python  # noqa: E402,F401  (the real one, in site/: the p2p tests save its state)
except ImportError:
  _grain = types.ModuleType('grain')
  _grain.python = types.ModuleType('grain.python')
  sys.modules['grain'], sys.modules['grain.python'] = _grain, _grain.python

if os.environ.get('UP_SUITE') == 'v1_saving_multihost_test':
  import importlib.util  # noqa: E402
  _spec = importlib.util.spec_from_file_location(
      'orbax.checkpoint.experimental.v1._src.partial.saving_test',
      os.path.join(HERE, 'tests', 'v1_saving_test.py'))
  _module = importlib.util.module_from_spec(_spec)
  sys.modules[_spec.name] = _module
  _spec.loader.exec_module(_module)

if not os.environ.get('STOCK'):
  import orbax_pathways  # noqa: E402,F401
  print('orbax_pathways from', orbax_pathways.__file__, file=sys.stderr)

import unittest.case as _uc  # noqa: E402
_uc._common_shorten_repr = lambda *args: tuple(_uc.safe_repr(a) for a in args)  # messages only
_uc.TestCase.maxDiff = None

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _cwd_for_orbax_testdata(request, monkeypatch):
  """The aggregate tests read 'orbax/checkpoint/testing/<x>.checkpoint' relative to Orbax's source
  root; the installed package ships those files."""
  if 'aggregate' in request.node.name:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(ocp.__file__))))


def pytest_sessionfinish(session, exitstatus):
  imported = 'orbax_pathways' in sys.modules
  assert imported != bool(os.environ.get('STOCK')), (
      f'STOCK={os.environ.get("STOCK")!r} but orbax_pathways imported={imported}')
