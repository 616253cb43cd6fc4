"""Worker for tests/transports/test_fleet.py: one of N jax.distributed processes (one device each) saving
and restoring with a stock ``ocp.CheckpointManager`` after ``import orbax_pathways``, reporting
how many ``_pathways/`` objects it read in each phase (``meta_io.read_counts()``).

Usage (started by ``support.mp_harness.run_processes``)::

    fleet_worker.py CKPT_DIR

Emits one dict: per phase (``save``, ``restore``, ``restore_no_target``, ``restore_legacy``) the
objects read by kind, plus the restored values' checksums.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

ROWS_PER_PROCESS = 16


def main() -> None:
  from support import mp_worker as w  # pylint: disable=g-import-not-at-top

  w.init()

  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top  (installs the handler)
  from orbax_pathways.storage import meta_io  # pylint: disable=g-import-not-at-top

  ckpt = sys.argv[1]
  n = jax.process_count()
  mesh = Mesh(np.asarray(jax.devices()), ('proc',))
  values = {f'a{i}': np.arange(n * ROWS_PER_PROCESS * 8, dtype=np.float32).reshape(-1, 8) + i
            for i in range(4)}
  state = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, P('proc')),
                                           lambda idx, v=v: v[idx])
           for k, v in values.items()}
  abstract = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for k, a in state.items()}
  out: dict = {'process_index': jax.process_index()}

  def delta(before):
    after = meta_io.read_counts()
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)
            if after.get(k, 0) != before.get(k, 0)}

  def checksum(tree):
    h = hashlib.sha256()
    for k in sorted(tree):
      for s in sorted(tree[k].addressable_shards, key=lambda s: s.device.id):
        h.update(np.asarray(s.data).tobytes())
    return h.hexdigest()

  before = meta_io.read_counts()
  with ocp.CheckpointManager(ckpt) as mngr:
    mngr.save(0, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
  out['save'] = delta(before)
  expected = checksum(state)

  for phase, args in (('restore', ocp.args.StandardRestore(abstract)), ('restore_no_target', None)):
    meta_io.clear_cache()  # each restore as in a fresh process
    before = meta_io.read_counts()
    with ocp.CheckpointManager(ckpt) as mngr:
      restored = mngr.restore(0, args=args)
    out[phase] = delta(before)
    out[phase + '_ok'] = checksum(restored) == expected
    out[phase + '_verified'] = orbax_pathways.stats.last_restore().chunks_verified

  # The same step as written before schema 2 (records only): every process reads every record.
  multihost_utils.sync_global_devices('before_legacy')
  if jax.process_index() == 0:
    (epath.Path(ckpt) / '0' / 'default' / '_pathways' / 'index.msgpack').unlink()
  multihost_utils.sync_global_devices('legacy')
  meta_io.clear_cache()
  before = meta_io.read_counts()
  with ocp.CheckpointManager(ckpt) as mngr:
    restored = mngr.restore(0, args=ocp.args.StandardRestore(abstract))
  out['restore_legacy'] = delta(before)
  out['restore_legacy_ok'] = checksum(restored) == expected
  w.emit(out)


if __name__ == '__main__':
  main()
