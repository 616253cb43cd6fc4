"""The names and accepted values of the options: the transports and runtimes (``TransportName``,
``Runtime``), each choice option's values, and the former names of renamed options. No I/O;
read by ``options/variables.py`` and ``options/settings.py``, and by every module that names a
transport or runtime (``engine/runtime.py``, ``transports/registry.py``).
"""

from __future__ import annotations

import enum

MiB = 1 << 20

class TransportName(str, enum.Enum):
  """Who moves shard bytes: the names ``Options.transport`` and ``ORBAX_PATHWAYS_TRANSPORT``
  accept, ``engine/runtime.choose_transport`` picks and ``transports/registry.create`` builds."""
  # This process writes/reads the shards its own devices hold (under Pathways, the controller:
  # every device looks local to it). Its writer records keep the former name, 'local'
  # (``format/records.py``).
  IN_PROCESS = 'in_process'
  COLOCATED = 'colocated'  # colocated-Python functions on the worker hosts do the I/O
  PERSISTENCE = 'persistence'  # Pathways' server-side persistence plugin program


class Runtime(str, enum.Enum):
  """Which JAX runtime this is (``ORBAX_PATHWAYS_RUNTIME``; ``engine/runtime.detect_runtime``)."""
  SINGLE = 'single'  # one process owns every device
  MULTI_CONTROLLER = 'multi_controller'  # jax.distributed, one process per host
  PATHWAYS = 'pathways'  # single controller over the IFRT proxy; devices live on worker hosts


TRANSPORTS = tuple(t.value for t in TransportName)
RUNTIMES = tuple(r.value for r in Runtime)
SNAPSHOTS = ('auto', 'pinned', 'host')
DIVISIBILITIES = ('replicate', 'strict')
COMPRESSIONS = ('auto', 'zstd', 'none')
TIER_SCOPES = ('written', 'held')
LOCAL_WHEN_BUSY = ('wait', 'skip')
LOCAL_STEPS_IN = ('storage', 'nodes')
TIER_MAX_AGE_S = 24 * 3600.0  # Options.tier_max_age_s

# Renamed options: the former name -> the current one. A former name still works (one
# ``DeprecationWarning``): as an ``Options`` keyword and attribute, as a variable where the
# current one is unset (``env_raw``; ``_install.py`` warns at install), and the former
# transport name as a value of ``Options.transport`` / ``ORBAX_PATHWAYS_TRANSPORT``.
FORMER_FIELDS = {'local_dir': 'tier_dir', 'local_keep': 'tier_keep', 'local_scope': 'tier_scope',
                 'local_max_age_s': 'tier_max_age_s', 'local_max_bytes': 'tier_max_bytes'}
FORMER_ENV = {f'ORBAX_PATHWAYS_{old.upper()}': f'ORBAX_PATHWAYS_{new.upper()}'
              for old, new in FORMER_FIELDS.items()}
FORMER_TRANSPORTS = {'local': TransportName.IN_PROCESS.value}
