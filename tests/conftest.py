"""Test setup: 8 virtual CPU devices in this process, set before anything imports jax."""

import os
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ['NO_GCE_CHECK'] = 'true'  # google-auth and gcsfs compare with exactly 'true'
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_default_install():
  """Tests may uninstall parts of orbax_pathways to compare with stock Orbax; every test starts
  from what ``import orbax_pathways`` sets up."""
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  orbax_pathways.install(orbax_pathways.Options.from_env())
  yield
  orbax_pathways.install(orbax_pathways.Options.from_env())

# GCS fixtures (fake-gcs-server started by the tests; importing sets loopback-only env vars).
from conftest_gcs import fake_gcs, faulty_gcs, gcs_bucket  # noqa: E402,F401
