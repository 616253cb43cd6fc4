"""Test setup in the pytest process: 8 virtual CPU devices (set before anything imports jax), the
GCS fixtures, and the library's default install around every test.

Support code lives in ``tests/support`` (``from support import ...``; ``tests/`` is on sys.path
through ``pythonpath`` in pyproject.toml).
"""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ['NO_GCE_CHECK'] = 'true'  # google-auth and gcsfs compare with exactly 'true'
# The node-local tier (on by default under /dev/shm) is off for the suite: most tests check what
# storage holds (damaged chunks, faults, request counts), which a restore from an intact tier
# would hide. The tier's own tests turn it on with a directory of their own (tests/tier/).
os.environ.setdefault('ORBAX_PATHWAYS_TIER_DIR', 'off')

import pytest  # noqa: E402

# fake-gcs-server fixtures (importing sets loopback-only GCS environment variables).
from support.gcs_fixtures import (  # noqa: E402,F401
    fake_gcs, fast_gcsfs_backoff, faulty_gcs, gcs_bucket)


@pytest.fixture(autouse=True)
def _restore_default_install():
  """Tests may uninstall parts of orbax_pathways to compare with stock Orbax; every test starts
  from what ``import orbax_pathways`` sets up."""
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  orbax_pathways.install(orbax_pathways.Options.from_env())
  yield
  orbax_pathways.install(orbax_pathways.Options.from_env())


@pytest.fixture(autouse=True, scope='module')
def _collect_what_earlier_modules_left():
  """Objects an earlier test file left in reference cycles are collected before this file runs,
  with their warnings ignored: files that fail on "coroutine ... was never awaited" (a leak of
  ours) must see their own coroutines only, not one of Orbax's left by another file that ran
  before them in the same pytest-xdist worker."""
  import gc  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    gc.collect()
  yield
