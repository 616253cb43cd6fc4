"""Routes a save or restore to the transport that moves the bytes (see ``runtime.Transport``).

Called by ``ProxyArrayHandler`` on the controller for every transport but ``local``, which the
handler runs inline.
"""

from __future__ import annotations

from typing import Any

from orbax_pathways import runtime


async def serialize(handler, transport: runtime.Transport, values, infos, args) -> list[Any]:
  if transport is runtime.Transport.COLOCATED:
    from orbax_pathways.transports import colocated  # pylint: disable=g-import-not-at-top
    return await colocated.serialize(handler, values, infos, args)
  if transport is runtime.Transport.PERSISTENCE:
    from orbax_pathways.transports import persistence  # pylint: disable=g-import-not-at-top
    return await persistence.serialize(handler, values, infos, args)
  raise ValueError(f'unknown transport {transport!r}')
