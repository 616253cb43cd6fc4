"""``manager/local_detach``: which save arguments a background local-only save can take from
the training loop, and what it copies (pure: real Orbax argument classes, real jax and numpy
values, no storage)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from orbax_pathways.multitier import local_detach


def test_a_pytree_save_keeps_its_arrays_and_copies_its_numpy_leaves():
  a, n = jnp.arange(4.0), np.arange(3)
  tree = {'a': a, 'n': n, 'step': 7, 'name': 'x', 'none': None, 'f': np.float32(2)}
  d = local_detach.detach((), {'args': ocp.args.StandardSave(tree)})
  assert d is not None and d.arrays == [a] and d.args == ()
  saved = d.kwargs['args'].item
  assert saved['a'] is a  # its shards are copied to host by snapshots.take, not here
  n[...] = -1  # the loop overwrites its numpy leaf after save() returned
  np.testing.assert_array_equal(saved['n'], [0, 1, 2])
  assert (saved['step'], saved['name'], saved['none']) == (7, 'x', None)


def test_a_composite_with_json_and_custom_metadata_is_copied_whole():
  meta, cfg = {'run': [1]}, {'lr': [0.1]}
  args = ocp.args.Composite(state=ocp.args.PyTreeSave({'w': jnp.ones(2)}),
                            config=ocp.args.JsonSave(cfg))
  d = local_detach.detach((args,), {'custom_metadata': meta})
  assert d is not None and len(d.arrays) == 1
  cfg['lr'].append(0.2)
  meta['run'].append(2)
  assert d.args[0]['config'].item == {'lr': [0.1]}
  assert d.kwargs['custom_metadata'] == {'run': [1]}
  assert isinstance(d.args[0], ocp.args.Composite)


class _Iterator:
  """A leaf no copy can stand for: a data iterator's position is read when its handler saves."""


@pytest.mark.parametrize('build', [
    lambda: ((), {'args': ocp.args.StandardSave({'it': _Iterator()})}),
    lambda: ((), {'args': ocp.args.Composite(
        state=ocp.args.StandardSave({'w': jnp.ones(2)}),
        data=ocp.args.JsonRestore())}),  # an argument kind it does not know
    lambda: ((), {'items': {'w': jnp.ones(2)}}),  # the legacy form
    lambda: ((), {}),
], ids=['unknown_leaf', 'unknown_item', 'legacy_items', 'no_args'])
def test_what_it_cannot_copy_runs_in_the_loop_s_thread(build):
  args, kwargs = build()
  assert local_detach.detach(args, kwargs) is None


def test_with_loop_items_an_item_it_cannot_copy_is_set_apart_as_given():
  """``loop_items=True`` (node steps): the items their handler must save in the loop's thread
  are returned as given, apart from the detached rest; a save of such items alone, or of an
  unknown leaf inside a tree, still runs in the loop's thread."""
  w, it = jnp.ones(2), ocp.args.JsonRestore()  # JsonRestore: an argument kind it does not know
  d = local_detach.detach((), {'args': ocp.args.Composite(state=ocp.args.PyTreeSave({'w': w}),
                                                          iter=it)}, loop_items=True)
  assert d is not None and d.loop_items == {'iter': it} and d.arrays == [w]
  assert list(d.kwargs['args'].keys()) == ['state']
  alone = ((), {'args': ocp.args.Composite(iter=it)})
  assert local_detach.detach(*alone, loop_items=True) is None
  tree = ((), {'args': ocp.args.Composite(state=ocp.args.StandardSave({'it': _Iterator()}))})
  assert local_detach.detach(*tree, loop_items=True) is None


def test_one_array_in_two_leaves_is_listed_twice_and_copied_once():
  from orbax_pathways.transports import snapshots  # pylint: disable=g-import-not-at-top
  a = jax.device_put(jnp.arange(8.0))
  d = local_detach.detach((), {'args': ocp.args.StandardSave({'x': a, 'y': a})})
  taken = snapshots.take(d.arrays)
  try:
    assert taken.nbytes == a.nbytes
    host = snapshots.device_data(a)
    np.testing.assert_array_equal(next(iter(host.values())), np.arange(8.0))
  finally:
    taken.release()
  assert snapshots.device_data(a) is None


def test_a_replicated_array_is_copied_once_for_all_its_devices():
  from orbax_pathways.transports import snapshots  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  assert len(devices) >= 2, 'tests run with several CPU devices (conftest)'
  mesh = jax.sharding.Mesh(np.array(devices), ('x',))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  a = jax.device_put(np.arange(16.0), rep)
  taken = snapshots.take([a])
  try:
    host = snapshots.device_data(a)
    assert set(host) == set(devices) and len({id(h) for h in host.values()}) == 1
    assert taken.nbytes == a.nbytes
  finally:
    taken.release()


def test_two_saves_of_one_array_share_its_copy_until_both_released():
  from orbax_pathways.transports import snapshots  # pylint: disable=g-import-not-at-top
  a = jax.device_put(jnp.arange(8.0))
  first, second = snapshots.take([a]), snapshots.take([a])  # two managers' local saves
  assert first.nbytes == a.nbytes and second.nbytes == 0  # copied once
  first.release()
  assert snapshots.device_data(a) is not None  # the second save still reads it
  second.release()
  assert snapshots.device_data(a) is None
