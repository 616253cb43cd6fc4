"""Log lines said once per process: which transport moves the bytes (``engine``), an Orbax
setting a front door maps differently (``frontends.orbax_v0``, ``frontends.orbax_v1``).

Called on whichever host runs the caller; what has been said is remembered per process, keyed
by the caller's ``key``.
"""

from __future__ import annotations

import logging
from typing import Hashable

log = logging.getLogger('orbax_pathways')
_said: set[Hashable] = set()


def once(level: int, key: Hashable, msg: str, *args) -> None:
  """Logs ``msg % args`` at ``level`` the first time this process passes ``key``."""
  if key not in _said:
    _said.add(key)
    log.log(level, msg, *args)
