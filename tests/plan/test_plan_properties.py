"""Property tests of the pure planners, on random shapes, meshes, specs, hosts and options.

Each property is what a checkpoint needs: every element written exactly once, by a host that
holds it; no chunk with two writers; restore reads that cover exactly what a host needs, each
chunk once; elastic remaps that keep every slice's device count. The planners were rewritten
for fleet scale (numpy over devices); their results must not change on disk, so each property
also compares with the straightforward per-device planners they replaced (``reference_*``
below, kept verbatim in spirit: the simplest code that states the rule).
"""

from __future__ import annotations

import itertools
import math
import pickle

import jax
import numpy as np
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from orbax_pathways.sharding import layout
from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import remap as elastic_plan
from orbax_pathways.plan import restore as restore_plan
from orbax_pathways.plan import save as save_plan

Box = boxes_lib.Box
MiB = 1 << 20
FAST = settings(max_examples=150, deadline=None, database=None)


# ---- the per-device planners the numpy ones replaced (oracles) -------------------------------

def reference_plan(global_shape, itemsize, placements, *, max_chunk_bytes, replica_parallel=True,
                   min_split_bytes=MiB, coalesce_bytes=0):
  """(chunk_shape, writes as (host, box, ((device, shard box), ...)))."""
  by_box = {}
  for p in placements:
    by_box.setdefault(p.box, []).append(p)
  shard_boxes = sorted(by_box)
  hosts_per_box = {b: list(dict.fromkeys(p.host for p in by_box[b])) for b in shard_boxes}
  parts = min((len(h) for h in hosts_per_box.values()), default=1)
  axis = None
  if replica_parallel and parts > 1 and shard_boxes:
    shard_shape = shard_boxes[0].shape
    if all(b.shape == shard_shape for b in shard_boxes):
      axis = next((a for a, d in enumerate(shard_shape) if d % parts == 0 and d >= parts), None)
      if axis is not None and math.prod(shard_shape) * itemsize // parts < min_split_bytes:
        axis = None
  writes = None
  if axis is None and math.prod(global_shape) * itemsize <= min(coalesce_bytes, max_chunk_bytes):
    writes = reference_coalesced(tuple(global_shape), by_box)
  if writes is None:
    writes = []
    for b in shard_boxes:
      holders = by_box[b]
      if axis is None:
        writes.append((holders[0].host, b, ((holders[0].device_id, b),)))
        continue
      step = b.shape[axis] // parts
      for i, host in enumerate(hosts_per_box[b][:parts]):
        holder = next(p for p in holders if p.host == host)
        start, stop = list(b.start), list(b.stop)
        start[axis] = b.start[axis] + i * step
        stop[axis] = start[axis] + step
        writes.append((host, Box(tuple(start), tuple(stop)), ((holder.device_id, b),)))
  grid = []
  for dim in range(len(global_shape)):
    g = 0
    for _, box, _ in writes:
      g = math.gcd(g, math.gcd(box.start[dim], box.shape[dim]))
    grid.append(g or max(1, global_shape[dim]))
  return boxes_lib.choose_chunk_shape(grid, itemsize, max_chunk_bytes), writes


def reference_coalesced(global_shape, by_box):
  boxes = sorted(by_box)
  if len(boxes) < 2 or len(boxes) > save_plan.MAX_COALESCE_SHARDS or not global_shape:
    return None
  shard = boxes[0].shape
  if (0 in shard or any(b.shape != shard for b in boxes)
      or any(d % s for d, s in zip(global_shape, shard))
      or len(boxes) * math.prod(shard) != math.prod(global_shape)):
    return None
  counts = tuple(d // s for d, s in zip(global_shape, shard))
  at = {tuple(a // s for a, s in zip(b.start, shard)): b for b in boxes}
  if len(at) != len(boxes):
    return None
  hosts = {b: list(dict.fromkeys(p.host for p in by_box[b])) for b in boxes}
  candidates = sorted(itertools.product(*(boxes_lib.divisors(c) for c in counts)),
                      key=lambda k: (math.prod(c // f for c, f in zip(counts, k)), k[::-1]))
  for block in candidates:
    if math.prod(block) == 1:
      return None
    writes = []
    for origin in itertools.product(*(range(0, c, f) for c, f in zip(counts, block))):
      members = [at[tuple(o + i for o, i in zip(origin, idx))]
                 for idx in itertools.product(*(range(f) for f in block))]
      common = set(hosts[members[0]])
      for m in members[1:]:
        common &= set(hosts[m])
      if not common:
        writes = None
        break
      host = next(h for h in hosts[members[0]] if h in common)
      sources = tuple((next(p.device_id for p in by_box[m] if p.host == host), m) for m in members)
      start = tuple(o * s for o, s in zip(origin, shard))
      stop = tuple(a + f * s for a, f, s in zip(start, block, shard))
      writes.append((host, Box(start, stop), sources))
    if writes is not None:
      return writes
  return None


def reference_reads(global_shape, chunk_shape, needed):
  def align(box):
    return Box(tuple((a // c) * c for a, c in zip(box.start, chunk_shape)),
               tuple(min(d, -(-b // c) * c) for b, c, d in zip(box.stop, chunk_shape, global_shape)))
  groups = []
  for b in sorted(set(needed)):
    region, members, merged = align(b), [b], True
    while merged:
      merged = False
      for i, (g_box, g_members) in enumerate(groups):
        if g_box.intersect(region) is not None:
          region = Box(tuple(map(min, region.start, g_box.start)), tuple(map(max, region.stop, g_box.stop)))
          members += g_members
          del groups[i]
          merged = True
          break
    groups.append((region, members))
  return [(r, tuple(sorted(m))) for r, m in sorted(groups, key=lambda g: g[0])]


def reference_remap(saved, current):
  slices = [sorted(current[s]) for s in sorted(current)]
  m = len(slices)
  grid = np.asarray(saved.device_ids).reshape(saved.shape)
  slice_grid = np.asarray(saved.device_slices).reshape(saved.shape)
  saved_slices = sorted(set(saved.device_slices))
  n = len(saved_slices)
  per_saved = {s: sorted(d for d, ds in zip(saved.device_ids, saved.device_slices) if ds == s)
               for s in saved_slices}
  equal = len({len(v) for v in per_saved.values()} | {len(v) for v in slices}) == 1
  if len(saved.slice_axes) == 1 and equal:
    a = saved.axis_names.index(saved.slice_axes[0])
    if saved.shape[a] % n == 0:
      k = saved.shape[a] // n
      if all(np.all(np.take(slice_grid, range(j * k, (j + 1) * k), axis=a) == saved_slices[j])
             for j in range(n)):
        rank = {d: per_saved[s].index(d) for s in saved_slices for d in per_saved[s]}
        shape = list(saved.shape)
        shape[a] = k * m
        out = np.empty(shape, dtype=np.int64)
        for coord in np.ndindex(*shape):
          old = list(coord)
          old[a] = coord[a] % k
          out[coord] = slices[coord[a] // k][rank[int(grid[tuple(old)])]]
        return tuple(shape), tuple(int(x) for x in out.flat)
  return None  # the fallback path is unchanged


# ---- generators --------------------------------------------------------------------------

@st.composite
def layouts(draw):
  """An even layout: shape, shard boxes per device, replicas, device ids, hosts, in device order."""
  ndim = draw(st.integers(0, 3))
  counts = [draw(st.sampled_from([1, 1, 2, 3, 4])) for _ in range(ndim)]
  sizes = [draw(st.sampled_from([1, 2, 3, 4, 6, 8])) for _ in range(ndim)]
  shape = tuple(c * s for c, s in zip(counts, sizes))
  replicas = draw(st.sampled_from([1, 1, 2, 3, 4]))
  cells = list(itertools.product(*(range(c) for c in counts)))
  boxes = [Box(tuple(i * s for i, s in zip(cell, sizes)),
               tuple((i + 1) * s for i, s in zip(cell, sizes))) for cell in cells]
  if draw(st.booleans()):  # every shard on ``replicas`` devices
    held = boxes * replicas
  else:  # every shard at least once, some more often
    held = boxes + draw(st.lists(st.sampled_from(boxes), min_size=(replicas - 1) * len(boxes),
                                 max_size=(replicas - 1) * len(boxes)))
  held = draw(st.permutations(held))
  n = len(held)
  ids = sorted(draw(st.lists(st.integers(0, 4 * n), min_size=n, max_size=n, unique=True)))
  per_host = draw(st.sampled_from([1, 2, 3, 4, n]))
  if draw(st.booleans()):
    hosts = [f'p{i // per_host}' for i in range(n)]
  else:
    hosts = [f'p{draw(st.integers(0, 3))}' for _ in range(n)]
  return shape, [save_plan.Placement(d, h, b) for d, h, b in zip(ids, hosts, held)]


options = st.fixed_dictionaries({
    'itemsize': st.sampled_from([1, 2, 4]),
    'max_chunk_bytes': st.sampled_from([4, 64, 256, 16 * MiB, 16 * MiB]),
    'replica_parallel': st.sampled_from([True, True, False]),
    'min_split_bytes': st.sampled_from([0, 0, 8, MiB]),
    'coalesce_bytes': st.sampled_from([0, 256, MiB, MiB]),
})


def plan_and_reference(shape, placements, opts):
  opts = dict(opts)
  itemsize = opts.pop('itemsize')
  plan = save_plan.plan_array_writes(shape, itemsize, placements, **opts)
  chunk, writes = reference_plan(shape, itemsize, placements, **opts)
  return plan, chunk, writes


def as_tuples(plan):
  return [(w.host, w.box, tuple((s.device_id, s.shard_box) for s in w.sources)) for w in plan.writes]


def check_plan(plan, shape, placements):
  """Every element written once, by a host holding it; the chunk grid divides every piece."""
  written = np.zeros(shape, dtype=np.int64)
  chunk_owner = {}
  held = {(p.device_id, p.box): p.host for p in placements}
  for k, w in enumerate(plan.writes):
    written[w.box.to_slices()] += 1
    for s in w.sources:
      assert held.get((s.device_id, s.shard_box)) == w.host, (w, s)
    if len(w.sources) == 1:
      assert w.sources[0].shard_box.contains(w.box)
    else:
      assert sum(s.shard_box.size for s in w.sources) == w.box.size
      assert all(w.box.contains(s.shard_box) for s in w.sources)
    assert all(a % c == 0 for a, c in zip(w.box.start, plan.chunk_shape)), (w.box, plan.chunk_shape)
    assert all(b % c == 0 or b == d for b, c, d in zip(w.box.stop, plan.chunk_shape, shape))
    for c in plan.chunks(w):
      assert chunk_owner.setdefault(c, k) == k, f'chunk {c} has two writers'
  assert (written == 1).all() if placements else not plan.writes


# ---- save plans --------------------------------------------------------------------------

@FAST
@given(layouts(), options)
def test_every_element_written_once_by_a_holder_as_before(layout_, opts):
  shape, placements = layout_
  plan, chunk, writes = plan_and_reference(shape, placements, opts)
  assert plan.chunk_shape == chunk and as_tuples(plan) == writes
  check_plan(plan, shape, placements)
  hosts = {p.host for p in placements}
  for h in sorted(hosts) + ['nobody']:
    assert list(plan.for_host(h)) == [w for w in plan.writes if w.host == h]
  expected = {}
  for h, box, _ in writes:
    expected[h] = expected.get(h, 0) + box.size * opts['itemsize']
  assert plan.bytes_by_host(opts['itemsize']) == expected
  assert list(expected) == list(plan.bytes_by_host(opts['itemsize']))
  again = pickle.loads(pickle.dumps(plan))
  assert again == plan and again.for_host(placements[0].host if placements else 'p0') == \
      plan.for_host(placements[0].host if placements else 'p0')


@st.composite
def uneven(draw):
  """Boxes cut at random points (shards of different shapes), some devices sharing boxes."""
  ndim = draw(st.integers(1, 3))
  shape, cuts = [], []
  for _ in range(ndim):
    d = draw(st.integers(1, 9))
    inner = sorted(draw(st.sets(st.integers(1, d - 1), max_size=3))) if d > 1 else []
    shape.append(d)
    cuts.append([0] + inner + [d])
  boxes = [Box(tuple(c[i] for c, i in zip(cuts, idx)), tuple(c[i + 1] for c, i in zip(cuts, idx)))
           for idx in itertools.product(*(range(len(c) - 1) for c in cuts))]
  held = boxes + draw(st.lists(st.sampled_from(boxes), max_size=6))
  held = draw(st.permutations(held))
  hosts = [f'p{draw(st.integers(0, 2))}' for _ in held]
  return tuple(shape), [save_plan.Placement(i, h, b) for i, (h, b) in enumerate(zip(hosts, held))]


@FAST
@given(uneven(), options)
def test_uneven_shards_are_planned_as_before(layout_, opts):
  shape, placements = layout_
  plan, chunk, writes = plan_and_reference(shape, placements, opts)
  assert plan.chunk_shape == chunk and as_tuples(plan) == writes
  check_plan(plan, shape, placements)


# ---- NamedSharding arithmetic against JAX -------------------------------------------------

@st.composite
def named_shardings(draw):
  devices = jax.devices()
  ndev = draw(st.sampled_from([1, 2, 4, 6, 8]))
  naxes = draw(st.integers(1, 3))
  sizes = [1] * naxes  # a random factorization of ndev into naxes factors
  rest = ndev
  for p in (2, 3):
    while rest % p == 0:
      sizes[draw(st.integers(0, naxes - 1))] *= p
      rest //= p
  names = ('a', 'b', 'c')[:naxes]
  order = draw(st.permutations(range(len(devices))))[:ndev]
  mesh = Mesh(np.asarray([devices[i] for i in order]).reshape(sizes), names)
  ndim = draw(st.integers(0, 3))
  free = list(draw(st.permutations(names)))
  spec = []
  for _ in range(ndim):
    k = draw(st.integers(0, min(2, len(free))))
    entry, free = free[:k], free[k:]
    spec.append(None if not entry else entry[0] if len(entry) == 1 and draw(st.booleans())
                else tuple(entry))
  spec = spec[:draw(st.integers(0, ndim))] if draw(st.booleans()) else spec
  sharding = NamedSharding(mesh, P(*spec))
  counts = [math.prod(sizes[names.index(a)] for a in
                      ((() if e is None else (e,) if isinstance(e, str) else e)))
            for e in spec + [None] * (ndim - len(spec))]
  shape = tuple(c * draw(st.sampled_from([0, 1, 1, 2, 3])) for c in counts)
  return sharding, shape


@FAST
@given(named_shardings(), options, st.sampled_from([1, 2, 4]))
def test_named_sharding_boxes_and_plans_match_jax(named, opts, per_host):
  sharding, shape = named
  index_map = sharding.devices_indices_map(shape)
  expected = {d: Box.from_slices(idx, shape) for d, idx in index_map.items()}
  got = layout.device_boxes(sharding, shape, addressable_only=False)
  assert list(got.items()) == list(expected.items())
  assert layout.device_boxes(sharding, shape, addressable_only=True) == expected  # one process
  host_of = lambda d: f'h{d.id // per_host}'  # noqa: E731
  placements = [save_plan.Placement(d.id, host_of(d), expected[d])
                for d in sorted(expected, key=lambda d: d.id)]
  opts = dict(opts)
  itemsize = opts.pop('itemsize')
  min_split = opts.pop('min_split_bytes')  # plan_writes keeps the default
  table = layout.shard_table(sharding, shape, host_of)
  plan = save_plan.plan_shards(table, itemsize, min_split_bytes=min_split, **opts)
  chunk, writes = reference_plan(shape, itemsize, placements, min_split_bytes=min_split, **opts)
  assert plan.chunk_shape == chunk and as_tuples(plan) == writes
  cached = layout.plan_writes(sharding, shape, itemsize, host_of, **opts)
  assert (cached.chunk_shape, as_tuples(cached)) == reference_plan(shape, itemsize, placements, **opts)


def test_named_sharding_that_jax_cannot_divide_fails_as_jax_does():
  m = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ('a', 'b'))
  s = NamedSharding(m, P('a'))
  for call in (lambda: s.devices_indices_map((5, 2)),
               lambda: layout.device_boxes(s, (5, 2), addressable_only=False),
               lambda: layout.plan_writes(s, (5, 2), 4, str, max_chunk_bytes=MiB,
                                          replica_parallel=True, coalesce_bytes=0)):
    try:
      call()
    except ValueError as e:
      assert 'divisible' in str(e) or 'partitioned 2 times' in str(e), e
    else:
      raise AssertionError('expected the indivisible shape to be refused')


# ---- restore read plans ------------------------------------------------------------------

@st.composite
def reads(draw):
  ndim = draw(st.integers(1, 3))
  shape = tuple(draw(st.integers(1, 12)) for _ in range(ndim))
  chunk = tuple(draw(st.integers(1, d)) for d in shape)

  def box():
    lo = [draw(st.integers(0, d - 1)) for d in shape]
    return Box(tuple(lo), tuple(draw(st.integers(a + 1, d)) for a, d in zip(lo, shape)))

  needed = draw(st.lists(st.builds(box), min_size=0, max_size=12))
  if draw(st.booleans()):  # a host's devices: shards of an even grid, some replicated
    counts = [draw(st.sampled_from([c for c in range(1, d + 1) if d % c == 0])) for d in shape]
    size = [d // c for d, c in zip(shape, counts)]
    cells = list(itertools.product(*(range(c) for c in counts)))
    needed += [Box(tuple(i * s for i, s in zip(c, size)), tuple((i + 1) * s for i, s in zip(c, size)))
               for c in draw(st.lists(st.sampled_from(cells), max_size=8))]
  return shape, chunk, needed


@settings(max_examples=150, deadline=None, database=None)
@given(reads())
def test_read_plan_covers_exactly_the_needed_boxes_each_chunk_once(case):
  shape, chunk, needed = case
  plan = restore_plan.plan_array_reads(shape, chunk, needed)
  assert [(r.box, r.device_boxes) for r in plan.regions] == reference_reads(shape, chunk, needed)
  read = np.zeros(shape, dtype=np.int64)
  for r in plan.regions:
    read[r.box.to_slices()] += 1
    assert all(a % c == 0 for a, c in zip(r.box.start, chunk))
    assert all(b % c == 0 or b == d for b, c, d in zip(r.box.stop, chunk, shape))
    # Nothing beyond the chunks the region's boxes touch.
    lo = [min(b.start[k] for b in r.device_boxes) // c * c for k, c in enumerate(chunk)]
    hi = [min(d, -(-max(b.stop[k] for b in r.device_boxes) // c) * c)
          for k, (c, d) in enumerate(zip(chunk, shape))]
    assert r.box == Box(tuple(lo), tuple(hi))
    assert all(r.box.contains(b) for b in r.device_boxes)
  assert read.max(initial=0) <= 1  # each element, hence each chunk, read at most once per host
  assert sorted(b for r in plan.regions for b in r.device_boxes) == sorted(set(needed))


def test_read_plan_for_thousands_of_devices_merges_neighbours_only():
  # 64 x 64 shards of 3 x 5 read from chunks of 4 x 4: shards share chunks with their
  # neighbours up to the common multiples 12 x 20, so 16 x 16 regions of 4 x 4 shards each.
  needed = [Box((3 * i, 5 * j), (3 * i + 3, 5 * j + 5)) for i in range(64) for j in range(64)]
  plan = restore_plan.plan_array_reads((192, 320), (4, 4), needed)
  assert [r.box for r in plan.regions] == [
      Box((12 * i, 20 * j), (12 * i + 12, 20 * j + 20)) for i in range(16) for j in range(16)]
  assert all(len(r.device_boxes) == 16 for r in plan.regions)
  aligned = [Box((4 * i, 8 * j), (4 * i + 4, 8 * j + 8)) for i in range(48) for j in range(40)]
  plan = restore_plan.plan_array_reads((192, 320), (4, 8), aligned + [aligned[5]])
  assert [(r.box, r.device_boxes) for r in plan.regions] == [(b, (b,)) for b in sorted(aligned)]


# ---- elastic remap -----------------------------------------------------------------------

@st.composite
def slice_meshes(draw):
  n = draw(st.integers(1, 4))  # saved slices
  k = draw(st.integers(1, 3))  # positions per slice along the slice axis
  other = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
  a = draw(st.integers(0, len(other)))
  shape = other[:a] + [n * k] + other[a:]
  names = tuple('xyz'[i] for i in range(len(shape)))
  per = k * math.prod(other)
  ids = draw(st.permutations(range(n * per)))
  grid = np.empty(shape, dtype=np.int64)
  slices = np.empty(shape, dtype=np.int64)
  for j in range(n):  # slice j: a contiguous block along axis a, its devices in random order
    idx = [slice(None)] * len(shape)
    idx[a] = slice(j * k, (j + 1) * k)
    grid[tuple(idx)] = np.asarray(ids[j * per:(j + 1) * per]).reshape(grid[tuple(idx)].shape)
    slices[tuple(idx)] = j
  saved = elastic_plan.SavedMesh(tuple(shape), names, tuple(grid.reshape(-1).tolist()),
                                 tuple(slices.reshape(-1).tolist()), (names[a],))
  m = draw(st.integers(1, 5))
  fresh = draw(st.permutations(range(100, 100 + m * per)))
  current = {s: list(fresh[s * per:(s + 1) * per]) for s in range(m)}
  return saved, current, a, k, per


@FAST
@given(slice_meshes())
def test_remap_keeps_every_slice_whole(case):
  saved, current, a, k, per = case
  new = elastic_plan.remap_mesh(saved, current)
  assert (new.shape, new.device_ids) == reference_remap(saved, current)
  grid = np.asarray(new.device_ids).reshape(new.shape)
  assert sorted(new.device_ids) == sorted(d for v in current.values() for d in v)
  for s, devs in enumerate(current[x] for x in sorted(current)):
    block = np.take(grid, range(s * k, (s + 1) * k), axis=a)
    assert sorted(block.reshape(-1).tolist()) == sorted(devs)  # slice s, all of it, only it
    assert block.size == per


@FAST
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.integers(1, 24))
def test_remap_lays_any_device_count(shape, n):
  # Any saved mesh over any device count: every current device used once, in order; an axis
  # other than the first keeps a size that divides its saved size (so its shards still nest).
  names = tuple('xyz'[:len(shape)])
  saved = elastic_plan.SavedMesh(tuple(shape), names, tuple(range(math.prod(shape))),
                                 (0,) * math.prod(shape), ())
  new = elastic_plan.remap_mesh(saved, {0: list(range(100, 100 + n))})
  assert math.prod(new.shape) == n and new.device_ids == tuple(range(100, 100 + n))
  assert new.axis_names == names
  if new.fitted:
    assert all(s % t == 0 for s, t in zip(shape[1:], new.shape[1:]))
  assert set(new.resized_axes) == {x for x, a, b in zip(names, shape, new.shape) if a != b}
