"""Runtime detection, transport choice, and the colocated (Pathways worker) transport.

Colocated Python runs in this process on the CPU backend, so the Pathways worker code path runs
for real here; what cannot run here is Pathways itself (the IFRT proxy and remote workers).
"""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_pathways
from orbax_pathways.engine import runtime
from orbax_pathways.storage import meta_io

from support.arrays import assert_trees_equal, mesh, random_state
from support.ckpt import assert_stock_reads_same
from support.mp_harness import run_processes
from support.workers import runtime_worker


def test_detect_runtime_single_process_and_override(monkeypatch):
  assert runtime.detect_runtime() is runtime.Runtime.SINGLE
  assert runtime.choose_transport() is runtime.TransportName.IN_PROCESS
  monkeypatch.setenv('ORBAX_PATHWAYS_RUNTIME', 'pathways')
  assert runtime.detect_runtime() is runtime.Runtime.PATHWAYS
  assert runtime.choose_transport() is runtime.TransportName.COLOCATED
  monkeypatch.setenv('ENABLE_PATHWAYS_PERSISTENCE', '1')
  assert runtime.choose_transport() is runtime.TransportName.PERSISTENCE
  assert runtime.choose_transport(requested='in_process') is runtime.TransportName.IN_PROCESS
  monkeypatch.setenv('ORBAX_PATHWAYS_RUNTIME', 'bogus')
  with pytest.raises(ValueError, match=r"ORBAX_PATHWAYS_RUNTIME='bogus' is not one of "
                                       r"\['single', 'multi_controller', 'pathways'\]"):
    runtime.detect_runtime()


def test_multi_controller_runtime_is_detected_in_a_distributed_process():
  results = run_processes(runtime_worker.__file__, num_processes=2, devices_per_process=1, timeout=120)
  assert {(r.result['runtime'], r.result['transport']) for r in results} == {
      ('multi_controller', 'in_process')}


def _save_restore(directory, state, transport, **options):
  orbax_pathways.install(orbax_pathways.Options(transport=transport, **options))
  with ocp.CheckpointManager(directory) as mngr:
    mngr.save(0, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    save_stats = orbax_pathways.stats.last_save()
    restored = mngr.restore(0, args=ocp.args.StandardRestore(state))
    no_target = mngr.restore(0)
  return save_stats, restored, no_target


def test_colocated_transport_writes_every_byte_on_the_workers(tmp_path):
  m = mesh()
  state = random_state(m)
  state['key'] = jax.random.key(3)  # a second device set: one colocated call per device group
  st, restored, no_target = _save_restore(tmp_path / 'colocated', state, 'colocated')
  assert st.transport == 'colocated'
  assert st.controller_tensor_bytes == 0 and st.d2h_bytes == {}
  assert set(st.written_bytes) <= {f'w{d.id}' for d in jax.devices()}
  distinct = sum(x.nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array)
                 and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)) + 8  # key data
  assert sum(st.written_bytes.values()) == distinct
  assert_trees_equal(restored, state)
  assert_trees_equal(no_target, state)
  rst = orbax_pathways.stats.last_restore()
  assert rst.transport == 'colocated' and rst.chunks_verified > 0
  # Counted by the workers and returned to the controller (one in-process worker call here).
  assert set(rst.bytes_read) <= {f'w{d.id}' for d in jax.devices()}
  assert sum(rst.bytes_read.values()) >= distinct - 8
  item = tmp_path / 'colocated' / '0' / 'default'
  # The workers' OCDBT databases, plus the controller's for the Python scalar 'step', which
  # the scalar handler writes on the controller with Orbax's own spec, as stock does.
  assert sorted(p.name for p in item.glob('ocdbt.process_*')) == (
      ['ocdbt.process_0'] + [f'ocdbt.process_w{i}' for i in range(8)])
  md = meta_io.read_item(item)
  # The arrays' bytes by the worker hosts; the Python int 'step' (a host leaf) by the
  # controller itself, as stock Orbax writes it, with its record merged into the index.
  assert md.transports() == {'colocated', 'local'}
  assert all(w.writer.startswith('w') for w in md.writers if w.transport == 'colocated')
  assert [w.writer.split('.')[0] for w in md.writers if w.transport == 'local'] == ['scalar']


def test_colocated_and_local_store_identical_values(tmp_path):
  m = mesh()
  state = random_state(m)
  # Coalescing off: it gathers small arrays per host, and the two transports see different
  # hosts here (one process vs one in-process worker per device).
  _save_restore(tmp_path / 'local', state, 'in_process', coalesce_bytes=0)
  _save_restore(tmp_path / 'colocated', state, 'colocated', coalesce_bytes=0)
  local = meta_io.read_item(tmp_path / 'local' / '0' / 'default').arrays()
  coloc = meta_io.read_item(tmp_path / 'colocated' / '0' / 'default').arrays()
  # Arrays without replicas are chunked identically: same chunks, same checksums.
  for name in ('params.w', 'params.e'):
    assert {(c.origin, c.crc32c) for c in local[name].chunks} == {(c.origin, c.crc32c) for c in coloc[name].chunks}
  # Every array decodes to the same values with stock Orbax, in a process without our package.
  assert_stock_reads_same(tmp_path / 'local', tmp_path / 'colocated')


def test_colocated_with_cpu_device_ids_unlike_the_accelerators(tmp_path, monkeypatch):
  """Under Pathways a colocated CPU device has an id of its own, not its accelerator's. Here the
  mapping accelerator -> CPU device is simulated as a rotation of the 8 CPU devices (the only
  fake: what Pathways would return); every byte must still land in the right place."""
  from orbax_pathways.transports import colocated  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  real = colocated.cpu_map

  def rotated(devs):
    return {d.id: devices[(d.id + 3) % len(devices)] for d in devs} if real(devs) else {}

  monkeypatch.setattr(colocated, 'cpu_map', rotated)
  m = mesh()
  state = random_state(m)
  big = np.random.default_rng(2).standard_normal((512, 1024), dtype=np.float32)  # 2 MiB
  state['big'] = jax.device_put(big, jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec('data', 'model')))
  _save_restore(tmp_path / 'local', state, 'in_process')
  for coalesce in (1 << 20, 0):
    path = tmp_path / f'c{coalesce}'
    st, restored, no_target = _save_restore(path, state, 'colocated', coalesce_bytes=coalesce)
    assert st.transport == 'colocated'
    assert set(st.written_bytes) == {f'w{(d.id + 3) % 8}' for d in devices}
    assert_trees_equal(restored, state)
    assert_trees_equal(no_target, state)
    assert_stock_reads_same(tmp_path / 'local', path)


def test_the_transport_and_its_cost_are_said_once_at_the_first_save(tmp_path, monkeypatch, caplog):
  """Under Pathways the colocated transport costs transparent suspend-resume: said once, loudly."""
  from orbax_pathways._util import said  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(said, '_said', set())
  monkeypatch.setenv('ORBAX_PATHWAYS_RUNTIME', 'pathways')
  state = {'w': random_state(mesh())['params']['w']}
  with caplog.at_level('INFO', logger='orbax_pathways'):
    for step in range(2):
      _save_restore(tmp_path / str(step), state, None)
  said = [r for r in caplog.records if 'orbax_pathways: transport ' in r.getMessage()]
  assert len(said) == 1 and said[0].levelname == 'WARNING'
  assert 'transport colocated (pathways)' in said[0].getMessage()
  assert 'cannot transparently suspend-resume' in said[0].getMessage()
