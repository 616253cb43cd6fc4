"""Which transport class serves which name: the engine creates one per save or restore call.

Kept apart from ``base`` (the protocol every transport imports), so that no transport imports
the module that imports it. The names are ``options.TransportName`` (the one list).
"""

from __future__ import annotations

from orbax_pathways import options as options_lib
from orbax_pathways.transports import base


def create(name: str, *, save: base.SaveConfig | None = None,
           read: base.ReadConfig | None = None) -> base.Transport:
  """A transport of kind ``name`` (an ``options.TransportName``) configured for one save
  (``save``) or restore (``read``)."""
  names = options_lib.TransportName
  if name == names.IN_PROCESS:
    from orbax_pathways.transports import in_process  # pylint: disable=g-import-not-at-top
    return in_process.InProcessTransport(save=save, read=read)
  if name == names.COLOCATED:
    from orbax_pathways.transports import colocated  # pylint: disable=g-import-not-at-top
    return colocated.ColocatedTransport(save=save, read=read)
  if name == names.PERSISTENCE:
    from orbax_pathways.transports import persistence  # pylint: disable=g-import-not-at-top
    return persistence.PersistenceTransport(save=save, read=read)
  raise ValueError(f'Unknown transport {name!r}; valid transports: {list(options_lib.TRANSPORTS)}.')
