"""The timed saves and restores of one (handler, repetition), in the benchmark's main process.

``bench.py`` calls ``run_main_rep`` for stock, then ours, per repetition (after untimed warm-up
rounds of both). Each rep uses a fresh ``ocp.CheckpointManager`` in a fresh directory, runs
``gc.collect()`` between steps, and removes the checkpoint at the end. It measures:

- ``save_blocking_s`` (inside ``mngr.save``), ``commit_s`` (until ``wait_until_finished``),
  ``commit_cpu_s`` (``time.process_time``, all threads);
- ``restore_s`` / ``restore_cpu_s`` onto the saved shardings, then ``restore_fewer_s`` /
  ``restore_fewer_cpu_s`` onto the same PartitionSpecs on the half mesh, with
  ``reshard_bytes_read`` from tensorstore's counters; every restore is checked for shapes, dtypes,
  target devices and one leaf's values;
- ``tiny_save_commit_s`` / ``tiny_restore_s`` (10 x 1 KiB on one manager, after an untimed
  round) and ``tiny_floor_save_commit_s`` (10 Python floats: no array handler at all).
"""

from __future__ import annotations

import gc
import os
import time

from benchlib.handlers import Served, restore_stats_extras, save_stats_extras, use_handler
from benchlib.storage import ts_bytes_read
from benchlib.workloads import abstract, jax_leaves

LAST_CPU = {}  # CPU seconds (all threads of this process) of the last timed save / restore


def timed_save(mngr, step, tree):
  """(seconds inside ``mngr.save``, seconds until committed); CPU seconds in LAST_CPU['save']."""
  import orbax.checkpoint as ocp
  c0 = time.process_time()
  t0 = time.perf_counter()
  mngr.save(step, args=ocp.args.StandardSave(tree))
  t1 = time.perf_counter()
  mngr.wait_until_finished()
  t2 = time.perf_counter()
  LAST_CPU['save'] = time.process_time() - c0
  return t1 - t0, t2 - t0


def timed_restore(mngr, step, target):
  """(restored tree, seconds to restore + block_until_ready); CPU in LAST_CPU['restore']."""
  import jax
  import orbax.checkpoint as ocp
  c0 = time.process_time()
  t0 = time.perf_counter()
  out = mngr.restore(step, args=ocp.args.StandardRestore(target))
  jax.block_until_ready(out)
  dt = time.perf_counter() - t0
  LAST_CPU['restore'] = time.process_time() - c0
  return out, dt


def check_restored(out, ref_tree, mesh) -> None:
  """Cheap correctness: shapes, dtypes, target mesh, and a checksum of one small leaf."""
  import jax
  import numpy as np
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref_tree)):
    if isinstance(b, jax.Array):
      assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
      assert set(a.sharding.device_set) == set(mesh.devices.flat), 'restored on the wrong devices'
  small_a = out['small']['s00']
  small_b = ref_tree['small']['s00']
  np.testing.assert_array_equal(np.asarray(small_a), np.asarray(small_b))


def run_main_rep(impl, state, mesh, half, storage, rep, tiny_iters, tiny):
  """One rep of one handler: (metrics, extras). Tiny metrics are lists of ``tiny_iters``."""
  res: dict = {}
  extra: dict = {}
  use_handler(impl)
  _big(impl, state, mesh, half, storage, rep, res, extra)
  _tiny(impl, tiny, storage, rep, tiny_iters, res)
  _floor(impl, storage, rep, tiny_iters, res)
  gc.collect()
  return res, extra


def _big(impl, state, mesh, half, storage, rep, res, extra) -> None:
  """Save + commit, restore on the same mesh, restore onto the half mesh, of the big state."""
  import orbax.checkpoint as ocp
  n_arrays = len(jax_leaves(state))
  path = storage.new_dir(f'{impl}-r{rep}')
  try:
    with ocp.CheckpointManager(path) as mngr:
      sv = Served(impl, 'save')
      res['save_blocking_s'], res['commit_s'] = timed_save(mngr, 1, state)
      res['commit_cpu_s'] = LAST_CPU['save']
      extra['loadavg_1m'] = os.getloadavg()[0]
      st = sv.check()
      if st is not None:
        extra.update(save_stats_extras(st, n_arrays))
      gc.collect()

      rv = Served(impl, 'restore')
      out, res['restore_s'] = timed_restore(mngr, 1, abstract(state))
      res['restore_cpu_s'] = LAST_CPU['restore']
      rv.check()
      check_restored(out, state, mesh)
      del out
      gc.collect()

      if half is not None:
        rv = Served(impl, 'restore')
        b0, names = ts_bytes_read()
        out, res['restore_fewer_s'] = timed_restore(mngr, 1, abstract(state, half))
        res['restore_fewer_cpu_s'] = LAST_CPU['restore']
        b1, _ = ts_bytes_read()
        rst = rv.check()
        check_restored(out, state, half)
        res['reshard_bytes_read'] = b1 - b0
        extra['bytes_read_counters'] = names
        if rst is not None:
          extra.update(restore_stats_extras(rst))
        del out
        gc.collect()
  finally:
    storage.remove(path)


def _tiny(impl, tiny, storage, rep, tiny_iters, res) -> None:
  """Fixed cost of one save+commit and one restore of 10 x 1 KiB, in steady state (a training
  loop saves many steps on one manager): one untimed round first."""
  import orbax.checkpoint as ocp
  path = storage.new_dir(f'tiny-{impl}-r{rep}')
  res['tiny_save_commit_s'], res['tiny_restore_s'] = [], []
  try:
    with ocp.CheckpointManager(path) as mngr:
      timed_save(mngr, 0, tiny)
      timed_restore(mngr, 0, abstract(tiny))
      for i in range(tiny_iters):
        sv = Served(impl, 'save')
        _, c = timed_save(mngr, i + 1, tiny)
        sv.check()
        rv = Served(impl, 'restore')
        out, r = timed_restore(mngr, i + 1, abstract(tiny))
        rv.check()
        res['tiny_save_commit_s'].append(c)
        res['tiny_restore_s'].append(r)
        del out
  finally:
    storage.remove(path)


def _floor(impl, storage, rep, tiny_iters, res) -> None:
  """The floor under any handler: the same manager protocol for 10 Python floats (Orbax's
  scalar handler, no jax.Array at all), so the array handler's share of the tiny cost shows."""
  import orbax.checkpoint as ocp
  path = storage.new_dir(f'floor-{impl}-r{rep}')
  res['tiny_floor_save_commit_s'] = []
  floats = {f't{i}': float(i) for i in range(10)}
  try:
    with ocp.CheckpointManager(path) as mngr:
      timed_save(mngr, 0, floats)
      for i in range(tiny_iters):
        res['tiny_floor_save_commit_s'].append(timed_save(mngr, i + 1, floats)[1])
  finally:
    storage.remove(path)
