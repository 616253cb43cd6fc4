"""Elastic restore: map a saved layout onto the current devices (placeholder: same topology).

Called by the handler on the controller at restore time.
"""

from __future__ import annotations

from typing import Any, Sequence

from orbax_pathways._compat import orbax as compat


async def remap_value_metadata(handler: Any, infos: Sequence[Any], metas: list[Any]) -> list[Any]:
  return metas


async def restore_shardings(handler: Any, infos: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  return await compat.shardings_from_args_or_file(infos, args)
