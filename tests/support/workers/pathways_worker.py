"""Worker for tests/multiprocess/test_multiprocess.py: one jax.distributed process saving / restoring with a
stock ``ocp.CheckpointManager`` after ``import orbax_pathways``.

Usage (started by ``support.mp_harness.run_processes``)::

    pathways_worker.py MODE CKPT_DIR [key=value ...]

The top of this file is numpy-only (no jax import): the parent test imports it by path to build
the very same global values and array specs the workers use.
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np

# ---- shared with the parent (numpy only) ----------------------------------------------------

AXES = ('proc', 'local')  # mesh (num_processes, devices_per_process): 'proc' crosses processes

# name -> (shape, dtype, partition spec over AXES)
STATE_SPECS = {
    # Sharded over every global device (both mesh axes).
    'global': ((48, 32), 'float32', ('proc', 'local')),
    # Sharded only along the within-process axis, replicated across processes: every process
    # holds a full replica. 8 MiB so that a replica-split piece is >= 1 MiB (the plan's minimum)
    # with 2 and with 4 processes.
    'local_rep': ((2048, 1024), 'float32', ('local', None)),
    # Replicated on every device.
    'replicated': ((7, 5), 'int32', ()),
    # A 0-d jax.Array, replicated.
    'scalar': ((), 'float32', ()),
}
STEP_VALUE = 1234  # a plain Python int leaf of the state (Orbax's scalar handler, not ours)

BYTES_SHAPE = (1024, 1024)  # test 3


def value(name: str, shape, dtype) -> np.ndarray:
  """Deterministic global value of an array (identical in every process and in the parent)."""
  seed = sum(map(ord, name))
  n = int(np.prod(shape, dtype=np.int64)) if shape else 1
  base = (np.arange(n, dtype=np.int64) * 7919 + seed) % 100003
  if np.dtype(dtype).kind == 'f':
    out = (base.astype(np.float64) * 0.125 - 3.5).astype(dtype)
  else:
    out = (base - 50000).astype(dtype)
  return out.reshape(shape)


def state_values() -> dict[str, np.ndarray]:
  return {k: value(k, s, d) for k, (s, d, _) in STATE_SPECS.items()}


def sha(a: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


# ---- worker side --------------------------------------------------------------------------

def main() -> None:
  from support import mp_worker as w  # pylint: disable=g-import-not-at-top

  w.init()

  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top  (installs the handler)

  mode, ckpt_dir = sys.argv[1], sys.argv[2]
  kw = dict(a.split('=', 1) for a in sys.argv[3:])
  n, d = jax.process_count(), jax.local_device_count()
  assert orbax_pathways.installed() is not None

  def make(val, sharding):
    return jax.make_array_from_callback(val.shape, sharding, lambda idx: val[idx])

  shards = w.shard_digests

  def describe(tree):
    out = {}
    for k, v in tree.items():
      if isinstance(v, jax.Array):
        s = v.sharding
        out[k] = {'shards': shards(v), 'shape': list(v.shape), 'dtype': str(v.dtype),
                  'mesh': {str(a): int(x) for a, x in s.mesh.shape.items()}
                          if isinstance(s, NamedSharding) else None,
                  'spec': [list(e) if isinstance(e, tuple) else e for e in s.spec]
                          if isinstance(s, NamedSharding) else None,
                  'num_devices': len(s.device_set)}
      else:
        out[k] = {'value': v.item() if hasattr(v, 'item') else v, 'type': type(v).__name__}
    return out

  def save_stats():
    st = orbax_pathways.stats.last_save()
    return {'written_bytes': dict(st.written_bytes), 'd2h_bytes': dict(st.d2h_bytes),
            'controller_tensor_bytes': st.controller_tensor_bytes,
            'chunks_written': dict(st.chunks_written), 'transport': st.transport,
            'arrays': st.arrays}

  def restore_stats():
    st = orbax_pathways.stats.last_restore()
    return {'bytes_read': dict(st.bytes_read), 'bytes_needed': dict(st.bytes_needed),
            'chunks_verified': st.chunks_verified}

  mesh = Mesh(np.asarray(jax.devices()).reshape(n, d), AXES)

  def build_state():
    vals = state_values()
    st = {k: make(vals[k], NamedSharding(mesh, P(*spec))) for k, (_, _, spec) in STATE_SPECS.items()}
    st['step'] = STEP_VALUE
    for k in STATE_SPECS:
      assert not st[k].is_fully_addressable, k
    return st

  def abstract(with_sharding):
    out = {}
    for k, (shape, dtype, spec) in STATE_SPECS.items():
      sh = NamedSharding(mesh, P(*spec)) if with_sharding else None
      out[k] = jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=sh)
    out['step'] = 0
    return out

  base = {'process_index': jax.process_index(), 'process_count': n,
          'local_devices': [x.id for x in jax.local_devices()]}

  if mode == 'save_restore':
    step = int(kw.get('step', 1))
    state = build_state()
    mngr = ocp.CheckpointManager(ckpt_dir)
    mngr.save(step, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    saved = save_stats()
    no_target = mngr.restore(step)
    r1 = restore_stats()
    targeted = mngr.restore(step, args=ocp.args.StandardRestore(abstract(True)))
    r2 = restore_stats()
    mngr.close()
    w.emit({**base, 'save': saved, 'saved': describe(state),
            'restored_no_target': describe(no_target), 'restore_no_target_stats': r1,
            'restored_target': describe(targeted), 'restore_target_stats': r2})

  elif mode == 'restore':
    step = int(kw['step'])
    mngr = ocp.CheckpointManager(ckpt_dir)
    no_target = mngr.restore(step)
    r1 = restore_stats()
    unsharded = mngr.restore(step, args=ocp.args.StandardRestore(abstract(False)))
    r2 = restore_stats()
    out = {**base, 'restored_no_target': describe(no_target), 'restore_no_target_stats': r1,
           'restored_unsharded_target': describe(unsharded), 'restore_unsharded_stats': r2}
    if 'save_next' in kw:
      nxt = int(kw['save_next'])
      mngr.save(nxt, args=ocp.args.StandardSave(no_target))
      mngr.wait_until_finished()
      out['save'] = save_stats()
    mngr.close()
    w.emit(out)

  elif mode == 'bytes':
    # Saved by rows over all devices, restored by column halves over processes.
    val = value('big', BYTES_SHAPE, 'float32')
    row_mesh = Mesh(np.asarray(jax.devices()), ('x',))
    arr = make(val, NamedSharding(row_mesh, P('x', None)))
    col_mesh = Mesh(np.asarray(jax.devices()).reshape(n, d), ('a', 'b'))
    target = {'big': jax.ShapeDtypeStruct(BYTES_SHAPE, np.float32,
                                          sharding=NamedSharding(col_mesh, P(None, 'a')))}
    out = dict(base)
    for label, chunk_bytes in (('default', None), ('small', kw.get('small_chunk_bytes'))):
      if chunk_bytes is None and label != 'default':
        continue
      if chunk_bytes is not None:
        orbax_pathways.install(orbax_pathways.Options(max_chunk_bytes=int(chunk_bytes)))
      mngr = ocp.CheckpointManager(os.path.join(ckpt_dir, label))
      mngr.save(0, args=ocp.args.StandardSave({'big': arr}))
      mngr.wait_until_finished()
      s = save_stats()
      restored = mngr.restore(0, args=ocp.args.StandardRestore(target))
      mngr.close()
      out[label] = {'save': s, 'restore': restore_stats(), 'restored': describe(restored)}
    w.emit(out)

  elif mode == 'submesh':
    # Restore onto a target that lives on process 0's devices only (a legal jax.Array: the
    # other processes hold no shard of it).
    val = value('sub', (16, 8), 'float32')
    state = {'sub': make(val, NamedSharding(mesh, P('proc', 'local')))}
    mngr = ocp.CheckpointManager(ckpt_dir)
    mngr.save(0, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    sub_mesh = Mesh(np.asarray(jax.devices()[:d]), ('x',))
    target = {'sub': jax.ShapeDtypeStruct((16, 8), np.float32,
                                          sharding=NamedSharding(sub_mesh, P('x')))}
    restored = mngr.restore(0, args=ocp.args.StandardRestore(target))
    mngr.close()
    w.emit({**base, 'restored': {'shards': shards(restored['sub']),
                                 'num_devices': len(restored['sub'].sharding.device_set)}})

  elif mode == 'local_array':
    state = build_state()
    local = jax.device_put(np.arange(6, dtype=np.float32), jax.local_devices()[0])
    assert local.is_fully_addressable
    state['host_local'] = local
    mngr = ocp.CheckpointManager(ckpt_dir)
    try:
      mngr.save(1, args=ocp.args.StandardSave(state))
      mngr.wait_until_finished()
      w.emit({**base, 'raised': None})
    except BaseException as e:  # pylint: disable=broad-except
      chain, cur = [], e
      while cur is not None and len(chain) < 10:
        chain.append({'type': type(cur).__name__, 'module': type(cur).__module__,
                      'is_save_error': isinstance(cur, orbax_pathways.SaveError),
                      'message': str(cur)})
        cur = cur.__cause__ or cur.__context__
      w.emit({**base, 'raised': chain})
    # Every process failed the same way. Exit normally: jax.distributed's atexit shutdown is a
    # barrier, so no process takes the coordination service down while a peer is still saving
    # (an early os._exit in process 0 aborted process 1 before it could emit).
    try:
      mngr.close()
    except Exception as e:  # pylint: disable=broad-except
      w.log('close after failed save raised', type(e).__name__, e)

  else:
    raise ValueError(f'unknown mode {mode!r}')


if __name__ == '__main__':
  main()
