"""Which transport class serves which name: the engine creates one per save or restore call.

Kept apart from ``base`` (the protocol every transport imports), so that no transport imports
the module that imports it.
"""

from __future__ import annotations

from orbax_pathways.transports import base

NAMES = ('local', 'colocated', 'persistence')


def create(name: str, *, save: base.SaveConfig | None = None,
           read: base.ReadConfig | None = None) -> base.Transport:
  """A transport of kind ``name`` configured for one save (``save``) or restore (``read``)."""
  if name == 'local':
    from orbax_pathways.transports import local  # pylint: disable=g-import-not-at-top
    return local.LocalTransport(save=save, read=read)
  if name == 'colocated':
    from orbax_pathways.transports import colocated  # pylint: disable=g-import-not-at-top
    return colocated.ColocatedTransport(save=save, read=read)
  if name == 'persistence':
    from orbax_pathways.transports import persistence  # pylint: disable=g-import-not-at-top
    return persistence.PersistenceTransport(save=save, read=read)
  raise ValueError(f'Unknown transport {name!r}; valid transports: {list(NAMES)}.')
