"""Log lines the front doors say once per process (an Orbax setting they map differently).

Called by ``frontends.orbax_v0`` and ``frontends.orbax_v1`` on whichever host runs the front
door; what has been said is remembered per process, keyed by the caller's ``key``.
"""

from __future__ import annotations

import logging

log = logging.getLogger('orbax_pathways')
_said: set[str] = set()


def once(level: int, key: str, msg: str, *args) -> None:
  """Logs ``msg % args`` at ``level`` the first time this process passes ``key``."""
  if key not in _said:
    _said.add(key)
    log.log(level, msg, *args)
