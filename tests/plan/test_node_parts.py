"""Which saved parts of a node step a process reads to restore what its devices hold now
(``plan/node_parts.py``, pure): checked against JAX's own layout of the same shardings."""

from __future__ import annotations

import jax
import numpy as np

from orbax_pathways.plan import boxes as boxes_lib
from orbax_pathways.plan import node_parts

P = jax.sharding.PartitionSpec
Box = boxes_lib.Box


def _record(mesh_shape, axis_names, device_ids, spec) -> node_parts.SavedLayout:
  return node_parts.SavedLayout(tuple(mesh_shape), tuple(axis_names), tuple(device_ids),
                                tuple(spec))


def test_device_runs_round_trip_and_stay_one_per_process():
  pairs = [(p * 2048 + k, p) for p in range(4) for k in range(2)]
  runs = node_parts.encode_processes(reversed(pairs))
  assert runs == [[0, 2, 0], [2048, 2, 1], [4096, 2, 2], [6144, 2, 3]]
  assert [node_parts.process_of(runs, d) for d, _ in pairs] == [p for _, p in pairs]
  assert node_parts.process_of(runs, 2) is None and node_parts.process_of(runs, -1) is None


def test_saved_boxes_are_jaxs_own():
  """Every saved device's box equals what JAX lays out for the same mesh and spec."""
  devices = np.array(jax.devices()[:8]).reshape(2, 4)
  mesh = jax.sharding.Mesh(devices, ('a', 'b'))
  for spec in (P('a', 'b'), P('b', None), P(('a', 'b')), P(None, 'a'), P()):
    for shape in ((16, 12), (8, 4)):
      sharding = jax.sharding.NamedSharding(mesh, spec)
      record = _record(mesh.devices.shape, mesh.axis_names, [d.id for d in mesh.devices.flat],
                       spec)
      ids, start, stop = node_parts.saved_boxes(record, shape)
      jax_boxes = {d.id: Box.from_slices(i, shape)
                   for d, i in sharding.devices_indices_map(shape).items()}
      for k, d in enumerate(ids.tolist()):
        assert (tuple(start[k]), tuple(stop[k])) == (jax_boxes[d].start, jax_boxes[d].stop), (
            spec, shape, d)


def test_a_process_needs_the_parts_its_boxes_overlap_and_prefers_its_nodes():
  """Four processes saved rows 16 each (64 rows); a process now holding rows 0..31 needs parts
  0 and 1, one holding rows 24..47 parts 1 and 2. A replicated array needs one part: this
  node's where it holds one. A numpy leaf (no sharding record) needs any one part, none more
  when others are read anyway."""
  runs = [[0, 2, 0], [2, 2, 1], [4, 2, 2], [6, 2, 3]]
  sharded = _record((8,), ('x',), range(8), ('x', None))
  replicated = _record((8,), ('x',), range(8), ())
  assert node_parts.needed([(sharded, (64, 16), [Box((0, 0), (32, 16))])], runs, 4,
                           local={0}) == {0, 1}
  assert node_parts.needed([(sharded, (64, 16), [Box((24, 0), (48, 16))])], runs, 4,
                           local=set()) == {1, 2}
  assert node_parts.needed([(replicated, (24,), [Box((0,), (24,))])], runs, 4,
                           local={2, 3}) == {2}
  # Of the parts some live node holds: process 0's is on none.
  asked = []
  live = lambda p: asked.append(p) or p in (1, 2)  # pylint: disable=unnecessary-lambda-assignment
  assert node_parts.needed([(replicated, (24,), [Box((0,), (24,))])], runs, 4, local=set(),
                           live=live) == {1}
  assert asked == [0, 1]  # asked only until one is live
  assert node_parts.needed([(None, (3,), [Box((0,), (3,))])], runs, 4, local={3}) == {3}
  assert node_parts.needed([(sharded, (64, 16), [Box((48, 0), (64, 16))]),
                            (None, (3,), [Box((0,), (3,))])], runs, 4, local=set()) == {3}


def test_a_layout_the_records_do_not_say_needs_every_part():
  """A sharding that is not a mesh's, or a device no run names, needs every part."""
  runs = [[0, 2, 0], [2, 2, 1]]
  assert node_parts.needed([(node_parts.UNKNOWN, (8,), [Box((0,), (4,))])], runs, 2,
                           local={0}) == {0, 1}
  unnamed = _record((4,), ('x',), [0, 1, 2, 9], ('x',))
  assert node_parts.needed([(unnamed, (8,), [Box((4,), (8,))])], runs, 2, local=set()) == {0, 1}
