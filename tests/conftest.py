"""Test setup: 8 virtual CPU devices in this process, set before anything imports jax."""

import os
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('NO_GCE_CHECK', 'True')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
