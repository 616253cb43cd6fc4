"""Host copies of arrays taken before the save that writes them (a local-only save run in the
background: ``multitier/local_steps.py``).

Who calls what, on which host (multi-controller JAX, every process, its own devices only):

- ``take(arrays)``: the training loop's thread, inside ``CheckpointManager.save()``: copies each
  distinct shard this process's devices hold to host memory (all copies in flight at once) and
  registers them for the arrays. This is the save's whole device-to-host snapshot: the loop
  may then donate or drop the arrays. (On the CPU backend the host copy is a view of the
  device buffer, as in every save's snapshot; jax does not donate a buffer a view holds, it
  allocates a new one.)
- ``device_data(arr)``: the in-process transport's ``snapshot`` and ``held_pieces`` (in the hidden
  manager's save, on the background thread): device -> the host copy of what it holds, or None
  when nothing was taken for ``arr`` (then they read ``arr.addressable_shards`` as usual).
- ``Taken.release()``: once the save that used them returned (its pieces keep what they need).

Only the arrays' metadata (shape, dtype, sharding) is read after ``take``: a donated array keeps
it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from orbax_pathways.sharding import layout

_lock = threading.Lock()
# id(array) -> [the array, device -> host copy, saves using it]: the array is kept so its id is
# not reused; two saves of one array (two managers) share the copy until both released it.
_taken: dict[int, list[Any]] = {}


class Taken:
  """The host copies of one save's arrays, registered until ``release``."""

  def __init__(self, ids: Sequence[int], nbytes: int, seconds: float = 0.0):
    self._ids = tuple(ids)
    self.nbytes = nbytes  # host bytes copied (each distinct shard once)
    self.seconds = seconds  # how long ``take`` ran (in the training loop's save())

  def release(self) -> None:
    with _lock:
      for i in self._ids:
        entry = _taken.get(i)
        if entry is not None:
          entry[2] -= 1
          if entry[2] <= 0:
            del _taken[i]
    self._ids = ()


def _copy(arr: jax.Array) -> dict[Any, np.ndarray]:
  """Device -> a host copy of its shard of ``arr``; devices holding the same box share one."""
  boxes = layout.device_boxes(arr.sharding, arr.shape, addressable_only=True)
  distinct: dict[Any, Any] = {}
  for s in arr.addressable_shards:
    if boxes[s.device] not in distinct:
      distinct[boxes[s.device]] = s.data
      s.data.copy_to_host_async()
  host = {box: np.asarray(data) for box, data in distinct.items()}
  return {d: host[b] for d, b in boxes.items()}


def take(arrays: Sequence[jax.Array]) -> Taken:
  """Copies ``arrays``' shards on this process's devices to host and registers them."""
  start = time.perf_counter()
  ids: list[int] = []
  nbytes = 0
  copies: list[tuple[jax.Array, dict[Any, np.ndarray]]] = []
  for arr in arrays:
    if device_data(arr) is not None or any(arr is a for a, _ in copies):
      continue
    copies.append((arr, _copy(arr)))
  with _lock:
    for arr in {id(a): a for a in arrays}.values():  # each array once per save
      entry = _taken.get(id(arr))
      if entry is not None and entry[0] is arr:
        entry[2] += 1
        ids.append(id(arr))
    for arr, host in copies:
      if id(arr) not in _taken:
        _taken[id(arr)] = [arr, host, 1]
        ids.append(id(arr))
        nbytes += sum({id(h): h.nbytes for h in host.values()}.values())
  return Taken(ids, nbytes, time.perf_counter() - start)


def device_data(arr: Any) -> dict[Any, np.ndarray] | None:
  """Device -> the host copy ``take`` made of its shard of ``arr`` (None: not taken)."""
  with _lock:
    found = _taken.get(id(arr))
  return None if found is None or found[0] is not arr else found[1]
