"""orbax-pathways: a proxy-aware Orbax ArrayHandler.

``import orbax_pathways`` installs :class:`ProxyArrayHandler` for ``jax.Array`` in Orbax's global
type-handler registry, so unchanged ``ocp.CheckpointManager`` code writes each shard from the host
that owns it, verifies chunks on restore, and restores onto another slice count. Set
``ORBAX_PATHWAYS_DISABLE=1`` to import without installing. No devices are touched at import.
"""

from orbax_pathways import errors
from orbax_pathways import stats
from orbax_pathways._registration import check_installed, install, installed, uninstall
from orbax_pathways.errors import (ChecksumMismatchError, OrbaxPathwaysError, RestoreError,
                                   SaveError, TopologyError)
from orbax_pathways.frontends.orbax_v0 import ProxyArrayHandler
from orbax_pathways.options import Options
from orbax_pathways.version import VERSION as __version__

__all__ = [
    'ChecksumMismatchError', 'Options', 'OrbaxPathwaysError', 'ProxyArrayHandler', 'RestoreError',
    'SaveError', 'TopologyError', 'check_installed', 'errors', 'install', 'installed', 'stats',
    'uninstall',
]

from orbax_pathways import _registration as _reg

if not _reg.disabled_by_env():
  install()
