"""Spare files (``tier/spares.py``, for the multi-tier overhead): the band files of a tier entry
that a newer step replaced are kept, for a short while, for the next save to write over, instead of
freeing their pages and allocating new ones. Never a file someone still has open or mapped (a
restored array lives on a tier file's pages): the kernel's write lease refuses it.

Real Orbax CheckpointManager, real tensorstore, real files, mappings and a second process.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways import preemption
from orbax_pathways import stats
from orbax_pathways.cli import tier as cli_tier
from orbax_pathways.tier import fsafe
from orbax_pathways.tier import spares
from orbax_pathways.tier import store as tier_store

P = jax.sharding.PartitionSpec
ROWS, COLS = 1024, 4096  # 16 MiB of float32: 4 row blocks of 4 MiB, one band file each


def _state(step):
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('x', 'y'))
  base = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
  return {'w': jax.device_put(base + step, jax.sharding.NamedSharding(mesh, P('x', None)))}


def _values(a):
  """``a``'s values read from its buffers now (``np.asarray`` caches an array's first read)."""
  return np.asarray(jax.jit(lambda x: x * 1)(a))


def _band_files(tier):
  """(path, inode) of every band file of every entry under ``tier`` (the pool left out)."""
  return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_ino
          for d, _, fs in os.walk(tier) if spares.POOL not in d.split(os.sep)
          for f in fs if f.endswith('.bin')}


def _pool_files(tier):
  pool = tier / spares.POOL
  return [os.path.join(d, f) for d, _, fs in os.walk(pool) for f in fs] if pool.exists() else []


def test_a_local_save_every_step_writes_over_the_pages_of_the_step_it_replaced(tmp_path):
  """Local-only saves every step, ``tier_keep`` 1: from step 3 on, each save's band files are
  the files of the step dropped before it (same inodes), written over; the pool never holds
  more than one entry's files, 0600 in 0700 directories; resume reads the newest step exactly,
  nothing from storage."""
  root, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), local_steps_in='storage', local_save_interval_steps=1))
  options = ocp.CheckpointManagerOptions(save_interval_steps=100)
  seen: dict[int, set[int]] = {}
  with ocp.CheckpointManager(root, options=options) as m:
    for step in range(7):
      m.save(step, args=ocp.args.StandardSave(_state(step)))
      m.wait_until_finished()
      tier_store.flush()
      files = {p: ino for p, ino in _band_files(tier).items()
               if f'{os.sep}{step}{os.sep}' in p and 'orbax-pathways-local' in p}
      seen[step] = set(files.values())
      assert len(_pool_files(tier)) <= 4, _pool_files(tier)
  assert [len(seen[s]) for s in range(1, 7)] == [4] * 6  # step 0 is storage's
  for step in range(3, 7):  # step s writes over step s-2's files (s-1 is the newest kept)
    assert seen[step] == seen[step - 2], (step, seen)
  doc = cli_tier.report(str(tier))  # `orbax-pathways tier`: step 5's files, held for step 7
  assert doc['ok'] and doc['spares'] == {'files': 4, 'bytes': 4 * (4 << 20)}, doc['spares']
  assert 'spares: 4 files 16.0 MiB' in cli_tier.text(doc)
  pool = tier / spares.POOL
  for d, _, fs in os.walk(pool):
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for f in fs:
      assert stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode) == 0o600
  with ocp.CheckpointManager(root, options=options) as m:
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          _state(0))
    step, got = preemption.resume(m, lambda: None, abstract_state=target)
  assert step == 6
  np.testing.assert_array_equal(np.asarray(got['w']), np.asarray(_state(6)['w']))
  assert stats.last_restore().bytes_by_source.get('storage', 0) == 0


def test_a_restored_array_on_a_tier_file_keeps_its_values_when_that_step_is_replaced(tmp_path):
  """A same-mesh restore maps the tier's band files into the restored arrays (copy-on-write).
  Later saves replace that step; its files are mapped, so the lease is refused and they are
  never written over: the restored array keeps step 2's values while steps 3..6 are saved,
  and each of those restores exactly."""
  root, tier = tmp_path / 'ckpt', tmp_path / 'tier'
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), coalesce_bytes=0))
  with ocp.CheckpointManager(root) as m:
    for step in range(3):
      m.save(step, args=ocp.args.StandardSave(_state(step)))
      m.wait_until_finished()
      tier_store.flush()
  with ocp.CheckpointManager(root) as m:
    got = m.restore(2, args=ocp.args.StandardRestore(_state(0)))
  assert stats.last_restore().bytes_by_source.get('storage', 0) == 0
  with open('/proc/self/maps', encoding='utf-8') as f:
    mapped = [line.split()[-1] for line in f if str(tier) in line]
  assert len(set(mapped)) == 4, mapped  # the 4 band files of step 2, mapped into 'w'
  expected = np.asarray(_state(2)['w'])
  with ocp.CheckpointManager(root) as m:
    for step in range(3, 7):
      m.save(step, args=ocp.args.StandardSave(_state(step)))
      m.wait_until_finished()
      tier_store.flush()
      np.testing.assert_array_equal(_values(got['w']), expected)
  mapped_inodes = {os.stat(f'/proc/self/map_files/{line.split()[0]}').st_ino
                   for line in open('/proc/self/maps', encoding='utf-8') if str(tier) in line}
  assert not mapped_inodes & set(_band_files(tier).values())  # none of them written over
  with ocp.CheckpointManager(root) as m:
    again = m.restore(6, args=ocp.args.StandardRestore(_state(0)))
  np.testing.assert_array_equal(np.asarray(again['w']), np.asarray(_state(6)['w']))
  np.testing.assert_array_equal(_values(got['w']), expected)


def _entry(tier, step, writer='p0', sizes=(2 << 20, 2 << 20)):
  """A complete entry of ``writer`` for ``step`` with band files of ``sizes`` (real files, as
  ``write_entry`` leaves them)."""
  path = tier / 'ckpt-0123456789abcdef' / str(step) / 'default' / f'{writer}.s{step}'
  fsafe.private_dirs(str(tier), 'ckpt-0123456789abcdef', str(step), 'default', f'{writer}.s{step}')
  for i, n in enumerate(sizes):
    fsafe.write_file(str(path / f'0.{i}.bin'), bytes([step % 256]) * n)
  fsafe.write_file(str(path / 'manifest.msgpack'), b'm')
  return path


@pytest.fixture
def tier(tmp_path):
  t = tmp_path / 'tier'
  os.mkdir(t, 0o700)
  spares.note_writer('p0')
  return t


def test_a_spare_held_open_by_another_process_is_never_written_over(tier):
  """Another process has a retired file open for reading: the claim is refused (the kernel's
  lease), the spare is unlinked rather than written, and that process keeps reading the old
  bytes."""
  old = _entry(tier, 1)
  reader = subprocess.Popen(
      [sys.executable, '-c', 'import sys, time; f = open(sys.argv[1], "rb"); print("open", '
       'flush=True); sys.stdin.readline(); print(f.read(4).hex(), flush=True)',
       str(old / '0.0.bin')], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    assert reader.stdout.readline().strip() == 'open'
    assert spares.retire(str(tier), str(old)) == 2
    pool = spares.Pool(str(tier), 'p0')
    dest = tier / 'new.bin'
    fds = [pool.claim(2 << 20, str(dest)) for _ in range(2)]
    granted = [fd for fd in fds if fd is not None]
    assert len(granted) == 1  # the other spare: open in the reader, refused
    spares.write(granted[0], memoryview(b'\xff' * (2 << 20)))
    spares.release(granted[0])
    reader.stdin.write('\n')
    reader.stdin.flush()
    assert reader.stdout.readline().strip() == '01010101'  # step 1's bytes, not 0xff
  finally:
    reader.kill()
    reader.wait()
  assert spares.pooled(str(tier)) == (0, 0)


def test_the_pool_holds_one_retired_entry_and_only_fresh_spares(tier):
  """Retiring a newer step unlinks the spares an older retire left; a spare older than the
  window is never claimed and goes; an entry written longer ago than the window is not kept;
  sizes must match exactly; small files are not kept; another writer's entry is not kept."""
  assert spares.retire(str(tier), str(_entry(tier, 1, sizes=(2 << 20, 3 << 20, 4096)))) == 2
  assert spares.pooled(str(tier)) == (2, 5 << 20)
  assert spares.retire(str(tier), str(_entry(tier, 2, sizes=(2 << 20,)))) == 1
  assert spares.pooled(str(tier)) == (1, 2 << 20)  # step 1's spares went
  assert spares.Pool(str(tier), 'p0').claim(3 << 20, str(tier / 'x.bin')) is None
  assert spares.retire(str(tier), str(_entry(tier, 3, writer='p7'))) == 0  # not ours
  stale = _entry(tier, 4)
  assert spares.retire(str(tier), str(stale), now=time.time() + spares.WINDOW_S + 5) == 0
  later = time.time() + spares.WINDOW_S + 5
  assert spares.Pool(str(tier), 'p0', now=later).claim(2 << 20, str(tier / 'y.bin')) is None
  assert spares.pooled(str(tier)) == (0, 0)  # expired when listed
  assert not (tier / 'y.bin').exists()
  spares.retire(str(tier), str(_entry(tier, 5)))
  assert spares.expire(str(tier), now=later) == 4 << 20
  spares.retire(str(tier), str(_entry(tier, 6)))
  assert spares.drop(str(tier)) == 4 << 20 and spares.pooled(str(tier)) == (0, 0)


def test_a_symlink_in_the_pool_is_never_followed(tier, tmp_path):
  """A symlink named like a spare (placed by something with this uid) is never written
  through: the claim refuses it and removes the link itself; its target is untouched."""
  target = tmp_path / 'elsewhere.bin'
  target.write_bytes(b'\x00' * (2 << 20))
  spares.retire(str(tier), str(_entry(tier, 1, sizes=(2 << 20,))))
  (pool_dir,) = [d for d, _, fs in os.walk(tier / spares.POOL) if fs]
  gen = os.listdir(pool_dir)[0].split('.')[1]
  for name in os.listdir(pool_dir):
    os.unlink(os.path.join(pool_dir, name))
  os.symlink(target, os.path.join(pool_dir, f'{2 << 20}.{gen}.0000'))
  assert spares.Pool(str(tier), 'p0').claim(2 << 20, str(tier / 'new.bin')) is None
  assert target.read_bytes() == b'\x00' * (2 << 20)
  assert not os.path.lexists(tier / 'new.bin') and os.listdir(pool_dir) == []


def test_a_symlinked_pool_directory_is_never_gone_through(tier, tmp_path):
  """``.spare`` itself a symlink to another directory: retiring never moves files there nor
  deletes what is there (the entry's files stay for the caller's removal), and nothing is
  claimed from it."""
  elsewhere = tmp_path / 'elsewhere'
  slot = elsewhere / spares._slot('p0')  # pylint: disable=protected-access
  os.makedirs(slot, mode=0o700)
  victim = slot / f'{2 << 20}.0000.0000'
  victim.write_bytes(b'\x07' * (2 << 20))
  os.chmod(victim, 0o600)
  os.symlink(elsewhere, tier / spares.POOL)
  entry = _entry(tier, 1, sizes=(2 << 20,))
  assert spares.retire(str(tier), str(entry)) == 0
  assert (entry / '0.0.bin').exists() and victim.read_bytes() == b'\x07' * (2 << 20)
  assert spares.Pool(str(tier), 'p0').claim(2 << 20, str(tier / 'new.bin')) is None
  assert victim.exists() and not (tier / 'new.bin').exists()
  assert spares.pooled(str(tier)) == (0, 0) and spares.drop(str(tier)) == 0
  assert victim.exists()
