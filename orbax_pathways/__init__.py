"""orbax-pathways: a proxy-aware Orbax ArrayHandler.

``import orbax_pathways`` installs :class:`ProxyArrayHandler` for ``jax.Array`` in Orbax's global
type-handler registry (and Orbax v1's array-handler seam), so unchanged Orbax code writes each
shard from the host that owns it, verifies chunks on restore, and restores onto another slice
count. Set ``ORBAX_PATHWAYS_DISABLE=1`` to import without installing: then nothing heavy (jax,
Orbax) is imported until one of the names below is used. No devices are touched at import.
"""

import importlib

from orbax_pathways import errors
from orbax_pathways import options as _options
from orbax_pathways.errors import (ChecksumMismatchError, OrbaxPathwaysError, RestoreError,
                                   SaveError, TopologyError)
from orbax_pathways.options import Options
from orbax_pathways.version import VERSION as __version__

__all__ = [
    'ChecksumMismatchError', 'Options', 'OrbaxPathwaysError', 'ProxyArrayHandler', 'RestoreError',
    'SaveError', 'TopologyError', 'check_installed', 'errors', 'install', 'installed', 'stats',
    'uninstall',
]

# Names that need jax and Orbax, imported on first use (at once when installing at import).
_LAZY = {
    'ProxyArrayHandler': ('orbax_pathways.frontends.orbax_v0', 'ProxyArrayHandler'),
    'install': ('orbax_pathways._install', 'install'),
    'uninstall': ('orbax_pathways._install', 'uninstall'),
    'installed': ('orbax_pathways._install', 'installed'),
    'check_installed': ('orbax_pathways._install', 'check_installed'),
    'stats': ('orbax_pathways.stats', None),
}


def __getattr__(name):
  if name not in _LAZY:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  module, attr = _LAZY[name]
  value = importlib.import_module(module)
  value = getattr(value, attr) if attr else value
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_LAZY))


if not _options.env_value('ORBAX_PATHWAYS_DISABLE'):
  __getattr__('install')()
