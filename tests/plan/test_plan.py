"""The save plan as pure integer arithmetic: who writes which box, with which chunk grid.

No jax and no storage here; ``test_handler.py`` checks the same rules end to end on disk.
"""

from __future__ import annotations

import itertools

import pytest

from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import save as save_plan
from orbax_pathways.plan import shards as shards_lib

Box = boxes_lib.Box
MiB = 1 << 20


def placements(shape, grid, host_of_device, replicas=1):
  """Devices numbered in order; ``grid`` shards per dimension; each shard on ``replicas``
  consecutive devices; ``host_of_device(d)`` names the host of device d."""
  shard = tuple(s // g for s, g in zip(shape, grid))
  out, dev = [], 0
  for idx in itertools.product(*(range(g) for g in grid)):
    start = tuple(i * s for i, s in zip(idx, shard))
    box = Box(start, tuple(a + s for a, s in zip(start, shard)))
    for _ in range(replicas):
      out.append(save_plan.Placement(dev, host_of_device(dev), box))
      dev += 1
  return out


def check_tiles_once(plan, shape):
  """Writes are disjoint, cover the array, and every write is cut by the chunk grid exactly."""
  covered = 0
  for a, b in itertools.combinations(plan.writes, 2):
    assert a.box.intersect(b.box) is None, (a.box, b.box)
  for w in plan.writes:
    covered += w.box.size
    assert all(x % c == 0 for x, c in zip(w.box.start, plan.chunk_shape)), (w.box, plan.chunk_shape)
    assert all(x % c == 0 or x == d for x, c, d in zip(w.box.stop, plan.chunk_shape, shape))
    src = sum(s.shard_box.size for s in w.sources)
    assert src == w.box.size or (len(w.sources) == 1 and w.sources[0].shard_box.contains(w.box))
  assert covered == boxes_lib.Box.full(shape).size


def test_small_array_on_one_host_is_one_write_and_one_chunk():
  shape = (256,)
  pl = placements(shape, (8,), lambda d: 'p0')
  plan = save_plan.plan_array_writes(shape, 4, pl, max_chunk_bytes=16 * MiB, coalesce_bytes=MiB)
  assert len(plan.writes) == 1 and plan.chunk_shape == (256,)
  (w,) = plan.writes
  assert w.host == 'p0' and w.box == Box((0,), (256,))
  assert [s.device_id for s in w.sources] == list(range(8))
  check_tiles_once(plan, shape)


def test_small_array_without_coalescing_keeps_one_chunk_per_shard():
  shape = (256,)
  plan = save_plan.plan_array_writes(shape, 4, placements(shape, (8,), lambda d: 'p0'),
                                     max_chunk_bytes=16 * MiB, coalesce_bytes=0)
  assert len(plan.writes) == 8 and plan.chunk_shape == (32,)
  check_tiles_once(plan, shape)


def test_small_array_over_two_hosts_is_one_write_per_host():
  shape = (48, 32)
  # 2 hosts x 4 devices, sharded 8-way over rows: host p0 holds rows 0-23, p1 rows 24-47.
  plan = save_plan.plan_array_writes(shape, 4, placements(shape, (8, 1), lambda d: f'p{d // 4}'),
                                     max_chunk_bytes=16 * MiB, coalesce_bytes=MiB)
  assert sorted((w.host, w.box) for w in plan.writes) == [
      ('p0', Box((0, 0), (24, 32))), ('p1', Box((24, 0), (48, 32)))]
  assert plan.chunk_shape == (24, 32)
  check_tiles_once(plan, shape)


def test_interleaved_hosts_cannot_be_gathered():
  shape = (64,)
  # Devices alternate between hosts: no two adjacent shards share a host.
  plan = save_plan.plan_array_writes(shape, 4, placements(shape, (8,), lambda d: f'p{d % 2}'),
                                     max_chunk_bytes=16 * MiB, coalesce_bytes=MiB)
  assert len(plan.writes) == 8 and plan.chunk_shape == (8,)
  assert [w.host for w in plan.writes] == ['p0', 'p1'] * 4
  check_tiles_once(plan, shape)


def test_replicated_shards_are_gathered_by_a_host_holding_all_of_them():
  shape = (16, 16)
  # 2x2 shards, each on 2 devices; device d lives on host p{d // 4}: shards 0,1 on p0, 2,3 on p1.
  plan = save_plan.plan_array_writes(
      shape, 4, placements(shape, (2, 2), lambda d: f'p{d // 4}', replicas=2),
      max_chunk_bytes=16 * MiB, coalesce_bytes=MiB)
  assert sorted((w.host, w.box) for w in plan.writes) == [
      ('p0', Box((0, 0), (8, 16))), ('p1', Box((8, 0), (16, 16)))]
  check_tiles_once(plan, shape)


def test_large_arrays_are_not_coalesced():
  shape = (1024, 512)  # 2 MiB of float32
  plan = save_plan.plan_array_writes(shape, 4, placements(shape, (8, 1), lambda d: 'p0'),
                                     max_chunk_bytes=16 * MiB, coalesce_bytes=MiB)
  assert len(plan.writes) == 8 and all(len(w.sources) == 1 for w in plan.writes)
  check_tiles_once(plan, shape)


def test_coalesced_chunk_respects_max_chunk_bytes():
  shape = (256,)
  plan = save_plan.plan_array_writes(shape, 4, placements(shape, (8,), lambda d: 'p0'),
                                     max_chunk_bytes=256, coalesce_bytes=MiB)
  assert len(plan.writes) == 8 and plan.chunk_shape == (32,)  # 1 KiB array > 256 B chunks


@pytest.mark.parametrize('grid', [(2, 4), (4, 2), (8, 1), (1, 8)])
def test_two_dimensional_grids_tile_exactly(grid):
  shape = (32, 64)
  for host_of in (lambda d: 'p0', lambda d: f'p{d // 4}', lambda d: f'p{d // 2}'):
    plan = save_plan.plan_array_writes(shape, 2, placements(shape, grid, host_of),
                                       max_chunk_bytes=16 * MiB, coalesce_bytes=MiB)
    check_tiles_once(plan, shape)
    for w in plan.writes:
      assert all(host_of(s.device_id) == w.host for s in w.sources)


def test_fleet_scale_layouts_plan_one_write_per_shard_and_hosts_find_their_own():
  # 8,192 devices, mesh (1024 data, 8 tp), 4 devices per host, from the mesh description alone.
  n = 8192
  ids = list(range(n))
  host_idx, hosts = shards_lib.intern_hosts([f'p{i // 4}' for i in ids])
  mesh = dict(mesh_shape=(n // 8, 8), axis_names=('data', 'tp'), device_ids=ids,
              host_of=host_idx, hosts=hosts)
  fsdp = shards_lib.mesh_grid(spec=('data', 'tp'), ndim=2, **mesh)
  plan = save_plan.plan_shards(fsdp.table((8192, 1024)), 2, max_chunk_bytes=16 * MiB)
  assert len(plan.writes) == n and plan.chunk_shape == (8, 128)
  assert [w.box for w in plan.for_host('p5')] == [
      Box((16, 128 * j), (24, 128 * (j + 1))) for j in range(4, 8)]
  assert plan.for_host('p5')[0].sources[0].device_id == 20
  # Tensor-parallel, replicated over data: 8 shards, each on 1,024 devices of 1,024 hosts.
  tp = shards_lib.mesh_grid(spec=(None, 'tp'), ndim=2, **mesh)
  plan = save_plan.plan_shards(tp.table((8192, 32768)), 2, max_chunk_bytes=16 * MiB)
  assert [(w.host, w.box) for w in plan.writes] == [
      (f'p{j // 4}', Box((0, 4096 * j), (8192, 4096 * (j + 1)))) for j in range(8)]
  assert plan.for_host('p7') == () and plan.bytes_by_host(2)['p1'] == 4 * 8192 * 4096 * 2
  # Large enough to split among the replicas' hosts: 1,024 pieces per shard; a host holds 4 shards.
  plan = save_plan.plan_shards(tp.table((1 << 22, 32768)), 2, max_chunk_bytes=16 * MiB,
                               min_split_bytes=MiB)
  assert len(plan.writes) == 8 * 1024 and len(plan.for_host('p7')) == 4
  assert {w.box.shape for w in plan.writes} == {(4096, 4096)}
