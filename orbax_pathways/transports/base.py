"""The interface every transport implements, and how the engine picks one.

A transport moves shard bytes between devices and storage for one save or one restore call. The
engine (``orbax_pathways.engine``) creates one per call with ``registry.create()`` and drives it; a
transport never sees Orbax objects or the front door that called the engine, only the typed
values of ``orbax_pathways.transports.values`` and the caller's ``jax.Array``s.

Call order, save (all on the controller: the only process under Pathways, every process under
multi-controller JAX):

1. ``unsupported(leaves, item)`` (caller's thread): reasons this transport cannot do this save;
   the engine then uses ``fallback`` and warns, naming the reasons.
2. ``await snapshot(arrays, leaves, item, ready)`` (inside ``save()``): plans who writes what
   and takes the device-to-host (or device-to-worker) snapshot. The only part ``save()`` blocks
   on: once it returns, training may donate or overwrite its arrays. ``ready()`` resolves when
   Orbax has created the item directory (only a transport that writes synchronously awaits it).
3. ``await write(snapshot)`` (Orbax's background commit thread, after ``ready()``): every writer
   host writes its pieces and its ``_pathways/<writer>.msgpack`` record; returns one
   ``WriterOutcome`` per writer. Raises ``SaveError`` if any write failed (after all settled).

Restore:

1. ``await read(targets, item)`` (controller): each reading host reads, verifies and places the
   boxes its devices need; returns the arrays on the targets' shardings and one ``ReadOutcome``
   per reading host.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable, Protocol, Sequence

import jax

from orbax_pathways.transports import values as types  # the boundary values


@dataclasses.dataclass(frozen=True)
class SaveConfig:
  """Per-call settings a transport needs besides the leaves (from options and Orbax's handler)."""

  max_inflight_bytes: int
  plan: types.PlanSettings
  snapshot_mode: str  # 'auto', 'pinned' or 'host'
  is_primary: bool  # this process writes the zarr metadata and the shardings (in-process transport)
  ocdbt_process_id: int | str | None  # Orbax's ocdbt.process_<id> suffix for this process
  context: Any = None  # Orbax's tensorstore context for this item (in-process transport only)
  # Every host writes every shard it holds, its first replica (Orbax's ``replica_id=None`` with
  # ``primary_host=None``: each host saves into storage of its own, and its save alone is
  # complete for what it holds); False: each distinct shard once, by the planner's choice.
  every_held: bool = False
  tier: Any = None  # tier.config.TierConfig: this node's tier (None: off); set by the engine
  tier_scope: str = 'written'  # Options.tier_scope: 'written' or 'held' (every chunk it holds)
  peer_timeout_s: float = 60.0  # a wait on workers beyond their work (Options.peer_timeout_s)
  # A local-only step's second copy (Options.local_copies=2): the process that keeps it (None:
  # no copy), and each wait on it (Options.tier_peer_timeout_s). Set by the engine.
  partner: int | None = None
  tier_peer_timeout_s: float = 20.0


@dataclasses.dataclass(frozen=True)
class ReadConfig:
  verify: bool
  context: Any = None  # Orbax's tensorstore context (in-process transport only)
  max_inflight_bytes: int | None = None  # host bytes read before going to devices (None: all)
  tier: Any = None  # tier.config.TierConfig: read this node's tier first (None: storage only)
  tier_peer_timeout_s: float = 20.0  # each wait on another host's tier (Options.tier_peer_timeout_s)
  peer_timeout_s: float = 60.0  # a wait on workers beyond their work (Options.peer_timeout_s)


@dataclasses.dataclass
class Snapshot:
  """What ``snapshot`` took: enough for ``write`` to finish the save in the background.

  ``layouts`` (one per leaf) go back to the front door for Orbax's metadata (``layouts_exact``
  False: the storage layout is chosen by someone else, e.g. the persistence plugin);
  ``d2h_bytes`` and ``controller_tensor_bytes`` feed the save's stats; ``state`` is the
  transport's own.
  """

  layouts: list[types.LeafLayout]
  layouts_exact: bool = True
  snapshot_mode: str = ''
  d2h_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
  controller_tensor_bytes: int = 0
  state: Any = None


class Transport(Protocol):
  """See the module docstring for the call order and the host of each call."""

  name: str

  @property
  def fallback(self) -> 'Transport | None':  # read-only, so implementations may narrow it
    ...

  def unsupported(self, leaves: Sequence[types.SaveLeaf], item: types.Item) -> list[str]:
    ...

  async def snapshot(self, arrays: Sequence[jax.Array], leaves: Sequence[types.SaveLeaf],
                     item: types.Item, ready: Callable[[], Awaitable[None]]) -> Snapshot:
    ...

  async def write(self, snapshot: Snapshot) -> list[types.WriterOutcome]:
    ...

  async def read(self, targets: Sequence[types.ReadTarget],
                 item: types.Item) -> tuple[list[jax.Array], list[types.ReadOutcome]]:
    ...


class ConfiguredTransport:
  """What the in-process and colocated transports share: built with the call's ``save`` or
  ``read`` config (``registry.create``), every leaf supported, no fallback."""

  fallback = None

  def __init__(self, *, save: SaveConfig | None = None, read: ReadConfig | None = None):
    self._save, self._read = save, read

  def unsupported(self, leaves: Sequence[types.SaveLeaf], item: types.Item) -> list[str]:
    del leaves, item
    return []

  def save_config(self) -> SaveConfig:
    """This save's config (a transport that saves is built with one)."""
    assert self._save is not None, 'a transport that saves is created with save=SaveConfig(...)'
    return self._save

  def read_config(self) -> ReadConfig:
    """This restore's config (a transport that restores is built with one)."""
    assert self._read is not None, 'a transport that restores is created with read=ReadConfig(...)'
    return self._read
