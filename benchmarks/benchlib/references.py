"""Hardware floors measured in the same run, to read the handlers' times against.

Called by ``bench.py`` after the reps, in the main process:

- ``disk_reference`` (local filesystem only, cpu and gpu modes): the state's logical bytes
  written in 16 MiB blocks to one new file in the checkpoint root and fsynced, like
  ``dd conv=fsync``: the disk's limit for a commit of that size.
- ``d2h_reference`` (gpu mode, or ``--d2h-ref``): ``jax.device_put`` of every array to its
  sharding with ``memory_kind='pinned_host'``, 2nd and later transfers (the first allocates): the
  floor for any save that snapshots to host.
"""

from __future__ import annotations

import gc
import os
import time

from benchlib.workloads import jax_leaves


def disk_reference(root: str, nbytes: int, n: int = 2) -> list[float]:
  """Seconds to write ``nbytes`` sequentially in 16 MiB blocks to a new file under ``root`` and
  fsync it (like ``dd conv=fsync``): the local disk's limit for a commit of that many bytes."""
  block = os.urandom(1 << 20) * 16
  times = []
  for i in range(n):
    path = os.path.join(root, f'disk-ref-{i}')
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      left = nbytes
      while left > 0:
        left -= os.write(fd, block if left >= len(block) else block[:left])
      os.fsync(fd)
    finally:
      os.close(fd)
    times.append(time.perf_counter() - t0)
    os.remove(path)
  return times


def d2h_reference(state, n=4) -> list[float]:
  """Seconds of a pinned_host copy of every array of the state (2nd.. n-th transfer)."""
  import jax
  arrays = jax_leaves(state)
  times = []
  for i in range(n):
    gc.collect()
    t0 = time.perf_counter()
    outs = [jax.device_put(x, x.sharding.with_memory_kind('pinned_host')) for x in arrays]
    jax.block_until_ready(outs)
    dt = time.perf_counter() - t0
    del outs
    if i > 0:
      times.append(dt)
  return times
