"""The conformance suite every ``Transport`` passes, zarr's ``StoreTests`` style.

``TransportConformance`` is a class of tests; ``tests/transports/test_transport_conformance.py`` subclasses
it once per transport (``local``, ``colocated``, ``persistence``), and a new transport adds a
subclass there (``docs/architecture.md``, "Adding a transport"). Each test saves and restores
through an unchanged ``ocp.CheckpointManager`` in the pytest process (8 CPU devices) with
``Options(transport=<name>)`` installed, and checks what a user would: the values and shardings
read back, the stats and the INFO line naming the transport, the ``_pathways`` records
(checksums), a flipped byte caught, ``unsupported()``'s refusals and the fallback they cause,
and the on-disk tree read back by stock Orbax's own handler.

A subclass sets what its transport is documented to do (class attributes below): whether it
records checksums, whether it counts the bytes each writer wrote, which transport its restores
and its refused saves go through, whether its checkpoints use OCDBT, and the reasons
``unsupported()`` gives for each refused case. A transport that cannot run here (Pathways'
persistence plugin needs a Pathways server) fakes only what it cannot reach, in ``fake()``.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways import stats
from orbax_pathways.storage import meta_io
from orbax_pathways.transports import registry
from orbax_pathways.transports import values

from support import damage
from support.arrays import abstract, assert_trees_equal, host, mesh

# Every dtype a jax.Array may have on the CPU backend without x64 (64-bit dtypes: test_handler's
# fresh-interpreter test).
DTYPES = (np.float32, jnp.bfloat16, np.float16, np.int8, np.int16, np.int32, np.uint8, np.uint16,
          np.uint32, np.bool_, ml_dtypes.int4, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
          ml_dtypes.float8_e4m3b11fnuz)

# Named shardings of a (32, 16) array: (mesh shape, mesh axes, spec).
SHARDINGS = {
    'row': ((4, 2), ('data', 'model'), P('data', None)),  # partly replicated (over 'model')
    'col': ((4, 2), ('data', 'model'), P(None, 'model')),
    'both': ((4, 2), ('data', 'model'), P('data', 'model')),
    'transposed': ((4, 2), ('data', 'model'), P('model', 'data')),
    'multi_axis': ((4, 2), ('data', 'model'), P(('data', 'model'), None)),
    'replicated': ((4, 2), ('data', 'model'), P()),
    'flat8': ((8,), ('x',), P(None, 'x')),
    'three_d': ((2, 2, 2), ('a', 'b', 'c'), P('c', ('a', 'b'))),
    'subset_mesh': ((2, 2), ('a', 'b'), P('b', None)),
}


def dtype_value(dtype, shape=(16, 8), seed=1) -> np.ndarray:
  """Small integers in ``dtype`` (exact in every dtype; non-negative for unsigned ones)."""
  raw = np.random.default_rng(seed).integers(-7, 7, size=shape)
  if np.dtype(dtype) == np.bool_:
    return raw > 0
  if np.dtype(dtype).kind == 'u':
    return np.abs(raw).astype(dtype)
  return raw.astype(dtype)


def distinct_bytes(tree) -> int:
  """The bytes of every jax.Array leaf once (PRNG keys: their key data), as written."""
  return sum(host(x).nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def _leaf(name: str, dtype, stored=None) -> values.SaveLeaf:
  return values.SaveLeaf(name=name, shape=(8, 4), dtype=np.dtype(dtype),
                         stored_dtype=np.dtype(stored if stored is not None else dtype),
                         compress=False, max_chunk_bytes=1 << 24)


# The saves ``unsupported()`` is asked about: (leaves, item uses OCDBT).
REFUSAL_CASES = {
    'float32': ([_leaf('f', np.float32)], False),
    'ocdbt': ([_leaf('f', np.float32)], True),
    'cast': ([_leaf('f', np.float32, jnp.bfloat16)], False),
    'dtypes': ([_leaf('h', np.float16), _leaf('m', np.bool_), _leaf('f', np.float32)], False),
}


class TransportConformance:
  """Subclass with ``transport`` set (and what differs from the defaults) to run the suite."""

  transport: ClassVar[str]
  # The transport a restore reports (a transport may read through another one).
  restore_transport: ClassVar[str | None] = None
  # Its checkpoints' OCDBT setting (a transport that cannot write OCDBT saves without it).
  use_ocdbt: ClassVar[bool] = True
  # Its ``_pathways`` records carry a crc32c per chunk (then restores verify them).
  records_checksums: ClassVar[bool] = True
  # ``SaveStats.written_bytes`` counts what each writer wrote.
  counts_written_bytes: ClassVar[bool] = True
  # ``unsupported()``'s reasons per ``REFUSAL_CASES`` name (absent: no reasons).
  refusals: ClassVar[dict[str, list[str]]] = {}
  # The transport a refused save uses instead (its ``fallback``), if any case is refused.
  fallback: ClassVar[str | None] = None

  def fake(self, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replaces only what cannot run in this process (nothing by default)."""
    del monkeypatch

  @pytest.fixture(autouse=True)
  def _installed(self, monkeypatch):
    self.fake(monkeypatch)
    orbax_pathways.install(orbax_pathways.Options(transport=self.transport))
    yield

  # ---- helpers ---------------------------------------------------------------------------------

  def manager(self, path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        path, item_handlers=ocp.PyTreeCheckpointHandler(use_ocdbt=self.use_ocdbt))

  def save(self, path, state, step: int = 0):
    """Saves ``state`` as ``step`` of ``path``; returns the save's stats."""
    with self.manager(path) as mngr:
      mngr.save(step, args=ocp.args.PyTreeSave(state))
      mngr.wait_until_finished()
    return stats.last_save()

  def restore(self, path, target=None, step: int = 0):
    """``step`` of ``path`` onto ``target`` (None: the saved shardings)."""
    with self.manager(path) as mngr:
      if target is None:
        return mngr.restore(step, args=ocp.args.PyTreeRestore())
      return mngr.restore(step, args=ocp.args.PyTreeRestore(
          target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))

  def supported(self, dtype) -> bool:
    return not registry.create(self.transport).unsupported(
        [_leaf('x', dtype)], values.Item(directory='/x', use_ocdbt=self.use_ocdbt))

  # ---- the tests -------------------------------------------------------------------------------

  def test_every_dtype_round_trips_with_and_without_a_target(self, tmp_path):
    m = mesh()
    dtypes = [d for d in DTYPES if self.supported(d)]
    assert np.float32 in dtypes and jnp.bfloat16 in dtypes, dtypes
    state = {}
    for d in dtypes:
      value = dtype_value(d)
      state[f'x_{np.dtype(d).name}'] = jax.device_put(value, NamedSharding(m, P('data', 'model')))
      state[f'r_{np.dtype(d).name}'] = jax.device_put(value, NamedSharding(m, P()))
    assert self.save(tmp_path, state).transport == self.transport
    assert_trees_equal(self.restore(tmp_path, abstract(state)), state)
    assert_trees_equal(self.restore(tmp_path), state)

  def test_every_sharding_kind_round_trips_and_is_written_once(self, tmp_path):
    value = np.arange(32 * 16, dtype=np.float32).reshape(32, 16)
    state: dict[str, Any] = {
        name: jax.device_put(value + i, NamedSharding(mesh(shape, axes), spec))
        for i, (name, (shape, axes, spec)) in enumerate(SHARDINGS.items())}
    state.update({
        'single': jax.device_put(np.arange(10, dtype=np.int32),
                                 SingleDeviceSharding(jax.devices()[3])),
        'scalar': jnp.float32(3.5),
        'empty': jnp.zeros((0, 4), jnp.float32),
        'empty_sharded': jax.device_put(np.zeros((8, 0), np.float32),
                                        NamedSharding(mesh(), P('data', None))),
        'key': jax.random.key(42),
        'keys': jax.random.split(jax.random.key(1), 8),
        'raw_key': jax.random.PRNGKey(0),
        'np': np.arange(4.0),
        'py_int': 3,
        'py_float': 2.5,
    })
    st = self.save(tmp_path, state)
    assert st.transport == self.transport
    if self.counts_written_bytes:  # each distinct shard written exactly once
      assert sum(st.written_bytes.values()) == distinct_bytes(state), st.written_bytes
    restored = self.restore(tmp_path, abstract(state))
    assert_trees_equal(restored, state)
    for k, v in state.items():
      if isinstance(v, jax.Array):
        assert restored[k].sharding == v.sharding, k
    assert jax.dtypes.issubdtype(restored['key'].dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(restored['keys']) == jax.random.key_impl(state['keys'])
    saved_shardings = self.restore(tmp_path)
    for name in SHARDINGS:
      assert saved_shardings[name].sharding == state[name].sharding, name
      np.testing.assert_array_equal(np.asarray(saved_shardings[name]), np.asarray(state[name]))
    assert saved_shardings['empty'].shape == (0, 4)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(saved_shardings['keys'])),
                                  np.asarray(jax.random.key_data(state['keys'])))

  def test_restores_onto_fewer_and_more_devices(self, tmp_path):
    value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    four = mesh((2, 2), ('a', 'b'))
    state = {'w': jax.device_put(value, NamedSharding(four, P('a', 'b'))),
             'r': jax.device_put(value[:8], NamedSharding(four, P()))}
    self.save(tmp_path, state)
    two = mesh((2,), ('x',), jax.devices()[6:])
    eight = mesh()
    for target_mesh, w_spec, r_spec in ((two, P('x'), P(None, 'x')),
                                        (eight, P(None, ('data', 'model')), P('data'))):
      target = {'w': jax.ShapeDtypeStruct(value.shape, value.dtype,
                                          sharding=NamedSharding(target_mesh, w_spec)),
                'r': jax.ShapeDtypeStruct((8, 32), value.dtype,
                                          sharding=NamedSharding(target_mesh, r_spec))}
      got = self.restore(tmp_path, target)
      assert stats.last_restore().transport == (self.restore_transport or self.transport)
      for k in target:
        assert got[k].sharding == target[k].sharding, (k, target_mesh.devices.size)
      np.testing.assert_array_equal(np.asarray(got['w']), value)
      np.testing.assert_array_equal(np.asarray(got['r']), value[:8])

  def test_checksums_are_recorded_and_a_flipped_byte_is_caught(self, tmp_path):
    value = np.random.default_rng(0).standard_normal((256, 64), dtype=np.float32)
    state = {'w': jax.device_put(value, NamedSharding(mesh(), P('data', 'model')))}
    self.save(tmp_path, state)
    item = tmp_path / '0' / 'default'
    rec = meta_io.read_item(item).arrays()['w']
    if not self.records_checksums:
      assert len(rec.chunks) == 0, rec.chunks  # the record says what the layout is, no more
      assert_trees_equal(self.restore(tmp_path, abstract(state)), state)
      assert stats.last_restore().chunks_verified == 0
      return
    assert sum(c.nbytes for c in rec.chunks) == value.nbytes, rec.chunks
    assert_trees_equal(self.restore(tmp_path, abstract(state)), state)
    assert stats.last_restore().chunks_verified == len(rec.chunks)
    first = rec.chunks[0]
    chunk = value[tuple(slice(o, o + c) for o, c in zip(first.origin, rec.chunk_shape))]
    files = sorted((p for p in item.rglob('*') if '_pathways' not in p.parts),
                   key=lambda p: -p.stat().st_size)
    damage.flip_bit_in(files, np.ascontiguousarray(chunk).tobytes()[:64],
                       what='the first chunk of w')
    with pytest.raises(orbax_pathways.ChecksumMismatchError,
                       match=r"Checksum mismatch in array 'w', chunk at \[\d+, \d+\] "
                             r'\(shape \[\d+, \d+\]\) of .*0/default/w: recorded crc32c '
                             r'0x[0-9a-f]{8}, read 0x[0-9a-f]{8}\. The stored bytes are damaged'):
      self.restore(tmp_path, abstract(state))

  @pytest.mark.parametrize('case', list(REFUSAL_CASES))
  def test_unsupported_gives_its_reasons(self, case):
    leaves, use_ocdbt = REFUSAL_CASES[case]
    item = values.Item(directory='/ckpt/1/default', use_ocdbt=use_ocdbt)
    got = registry.create(self.transport).unsupported(leaves, item)
    assert got == self.refusals.get(case, []), got

  def test_a_refused_save_falls_back_with_a_warning_and_round_trips(self, tmp_path):
    refused = [c for c in REFUSAL_CASES if self.refusals.get(c)]
    if not refused:
      assert self.fallback is None
      return
    m = mesh()
    state = {'h': jax.device_put(dtype_value(np.float16), NamedSharding(m, P('data'))),
             'f': jax.device_put(dtype_value(np.float32), NamedSharding(m, P(None, 'model')))}
    with pytest.warns(RuntimeWarning, match=rf'{self.transport} transport cannot write this save '
                      rf'\(.*using the {self.fallback} transport instead'):
      st = self.save(tmp_path, state)
    assert st.transport == self.fallback
    assert_trees_equal(self.restore(tmp_path, abstract(state)), state)

  def test_stats_and_the_info_line_name_the_transport(self, tmp_path, monkeypatch, caplog):
    from orbax_pathways._util import said  # pylint: disable=g-import-not-at-top
    monkeypatch.setattr(said, '_said', set())
    state = {'w': jax.device_put(np.arange(64.0, dtype=np.float32).reshape(8, 8),
                                 NamedSharding(mesh(), P('data')))}
    with caplog.at_level(logging.INFO, logger='orbax_pathways'):
      st = self.save(tmp_path, state)
      self.restore(tmp_path, abstract(state))
    assert st.transport == self.transport and st.arrays == 1
    rst = stats.last_restore()
    assert rst.transport == (self.restore_transport or self.transport) and rst.arrays == 1
    assert sum(rst.bytes_read.values()) >= state['w'].nbytes, rst.bytes_read
    said_lines = [r for r in caplog.records
                  if r.getMessage().startswith(f'orbax_pathways: transport {self.transport} ')]
    assert len(said_lines) == 1 and said_lines[0].levelname == 'INFO', said_lines

  def test_stock_orbax_reads_the_tree(self, tmp_path):
    m = mesh()
    rng = np.random.default_rng(3)
    state = {'params': {'w': jax.device_put(rng.standard_normal((64, 32), dtype=np.float32),
                                            NamedSharding(m, P('data', 'model'))),
                        'b': jax.device_put(rng.standard_normal(32).astype(jnp.bfloat16),
                                            NamedSharding(m, P()))},
             'mu': jax.device_put(rng.standard_normal((64, 32), dtype=np.float32),
                                  NamedSharding(m, P('data', None))),
             'step': 7}
    self.save(tmp_path, state)
    item = tmp_path / '0' / 'default'
    names = {p.name for p in item.iterdir()}
    assert {'_METADATA', '_sharding', '_pathways'} <= names, names
    if self.use_ocdbt:
      assert 'manifest.ocdbt' in names, names
    else:
      assert {'params.w', 'params.b', 'mu'} <= names, names
    orbax_pathways.uninstall()  # Orbax's own ArrayHandler from here on
    assert 'Proxy' not in type(ocp.type_handlers.get_type_handler(jax.Array)).__name__
    assert_trees_equal(self.restore(tmp_path, abstract(state)), state)
