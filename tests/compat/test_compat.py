"""Every Orbax internal we reach, exercised against the installed Orbax (see _compat/)."""

import pathlib
import tomllib

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from orbax_pathways.transports import values
from orbax_pathways._compat import orbax as compat
from orbax_pathways._compat import orbax_manager
from orbax_pathways._compat import supported

from support.arrays import mesh, put
from support import REPO


def test_installed_orbax_is_in_the_supported_range():
  assert ocp.__version__ in SpecifierSet(compat.SUPPORTED_ORBAX)
  assert compat.SUPPORTED_ORBAX == orbax_manager.SUPPORTED == supported.ORBAX


_ROOT = pathlib.Path(REPO)


def test_the_supported_orbax_range_is_written_once_and_pinned_inside():
  """``_compat/supported.ORBAX`` is the package's one copy of the range: ``pyproject.toml``
  declares the same, no other module spells it, and both CI pin files sit inside it."""
  requires = tomllib.loads((_ROOT / 'pyproject.toml').read_text())['project']['dependencies']
  declared = [r for r in map(Requirement, requires) if r.name == 'orbax-checkpoint']
  assert [str(r.specifier) for r in declared] == [str(SpecifierSet(supported.ORBAX))]
  spelled = {str(p.relative_to(_ROOT)) for p in (_ROOT / 'orbax_pathways').rglob('*.py')
             if supported.ORBAX in p.read_text()}
  assert spelled == {'orbax_pathways/_compat/supported.py'}
  for ends in ('oldest', 'newest'):
    pins = (_ROOT / '.ci' / f'constraints-{ends}.txt').read_text().splitlines()
    orbax = [line.split('==')[1].strip() for line in pins
             if line.startswith('orbax-checkpoint==')]
    assert len(orbax) == 1 and orbax[0] in SpecifierSet(supported.ORBAX), (ends, orbax)


def _item(path, zarr3=False, ocdbt=True, gcs_grpc=False):
  return values.Item(directory=str(path), use_zarr3=zarr3, use_ocdbt=ocdbt, gcs_grpc=gcs_grpc)


_F32 = np.dtype('float32')


def test_write_spec_keeps_orbax_layout_and_sets_our_chunks(tmp_path):
  for zarr3 in (False, True):
    tspec = compat.build_write_spec(
        _item(tmp_path, zarr3), 'w', global_shape=(64, 32), write_shape=(16, 32),
        chunk_shape=(8, 16), dtype=_F32, stored_dtype=_F32, process_id=0, ext_metadata=None,
        use_compression=True)
    assert tspec['driver'] == ('zarr3' if zarr3 else 'zarr')
    assert tspec['kvstore']['driver'] == 'ocdbt'
    # Orbax >= 0.12.5 ends the process directory with '/', 0.12.4 does not (same files).
    assert tspec['kvstore']['base']['path'].rstrip('/').endswith('ocdbt.process_0')
    meta = tspec['metadata']
    chunks = meta['chunk_grid']['configuration']['chunk_shape'] if zarr3 else meta['chunks']
    assert chunks == [8, 16]
    md = compat.array_metadata(
        _item(tmp_path, zarr3), 'w', global_shape=(64, 32), write_shape=(16, 32),
        chunk_shape=(8, 16), dtype=_F32, stored_dtype=_F32, ext_metadata=None,
        use_compression=True)
    assert md.chunk_shape == (8, 16) and md.write_shape == (16, 32)
  tspec = compat.build_write_spec(
      _item(tmp_path, ocdbt=False), 'w', global_shape=(4,), write_shape=(4,), chunk_shape=(2,),
      dtype=_F32, stored_dtype=np.dtype('int8'), process_id=None, ext_metadata=None,
      use_compression=True)
  assert tspec['driver'] == 'cast' and tspec['base']['metadata']['chunks'] == [2]


def test_ts_context_extra_resources():
  ctx = compat.ts_context(True, {'gcs_request_retries': {'max_retries': 2}})
  assert ctx['gcs_request_retries'].to_json()['max_retries'] == 2


def test_registry_and_sharding_metadata_helpers():
  assert compat.registered_array_handler() is ocp.type_handlers.get_type_handler(jax.Array)
  s = put(np.zeros((8, 4), np.float32), mesh(), 'data').sharding
  md = compat.sharding_metadata_from_jax(s)
  assert md.to_jax_sharding() == s
  assert compat.random_key_impl_field()
  assert compat.ocdbt_subdir_process_id(True) == 0 and compat.ocdbt_subdir_process_id(False) is None
  assert compat.ocdbt_subdir_process_id(True, 'w3') == 'w3'
  assert compat.persistence_dtype_supported(np.float32)
  assert not compat.persistence_dtype_supported(np.float16)


def test_param_names_are_the_names_orbax_saves_leaves_under():
  tree = {'a': {'b': np.zeros(2), 'c': [np.zeros(1), 3]}, 'd': np.zeros(())}
  assert jax.tree.leaves(compat.param_names(tree)) == ['a.b', 'a.c.0', 'a.c.1', 'd']


def test_merge_ocdbt_joins_per_process_trees_into_the_items(tmp_path):
  """Two per-process OCDBT trees (as two processes' parts of a save) merged into the item's
  tree: both keys read back through it, with their bytes."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  for p in (0, 1):
    kv = ts.KvStore.open({'driver': 'ocdbt', 'base': f'file://{tmp_path}/ocdbt.process_{p}'}
                         ).result()
    kv.write(f'key{p}', f'bytes of {p}'.encode()).result()
  compat.merge_ocdbt(tmp_path)
  merged = ts.KvStore.open({'driver': 'ocdbt', 'base': f'file://{tmp_path}'}).result()
  assert [merged.read(f'key{p}').result().value for p in (0, 1)] == [b'bytes of 0', b'bytes of 1']


def test_gcs_grpc_switches_only_the_driver():
  kw = dict(global_shape=(4,), write_shape=(4,), chunk_shape=(4,), dtype=_F32, stored_dtype=_F32,
            process_id=0, ext_metadata=None, use_compression=True)
  http = compat.build_write_spec(_item('gs://bucket/ck/1/default'), 'w', **kw)
  grpc = compat.build_write_spec(_item('gs://bucket/ck/1/default', gcs_grpc=True), 'w', **kw)
  assert http['kvstore']['base']['driver'] == 'gcs'
  assert grpc['kvstore']['base'] == {**http['kvstore']['base'], 'driver': 'gcs_grpc'}
  assert compat.with_gcs_grpc({'driver': 'file', 'path': '/x'}) == {'driver': 'file', 'path': '/x'}


def test_physical_read_spec_reads_prng_keys_as_key_data():
  """Orbax >= 0.12.7 has the rule as a function; before, our copy of the rule is used. Both must
  agree (in a venv with Orbax >= 0.12.7 this compares them)."""
  m = mesh()
  keys = ocp.ArrayRestoreArgs(global_shape=(8,), dtype=jax.random.key(0).dtype)
  plain = ocp.ArrayRestoreArgs(global_shape=(8, 4), dtype=np.float32)
  s = jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec('data'))
  shape, dtype, sharding = compat.physical_read_spec(keys, s)
  assert (shape, np.dtype(dtype)) == ((8, 2), np.uint32)
  assert sharding.spec == jax.sharding.PartitionSpec('data', None)
  assert compat.physical_read_spec(plain, s) == ((8, 4), np.float32, s)
  for arg in (keys, plain):
    assert compat._physical_read_spec_before_0_12_7(arg, s) == compat.physical_read_spec(arg, s)


def test_ci_constraints_sit_at_the_declared_bounds():
  """.ci/constraints-oldest.txt pins each declared lower bound, and every pin in both files is
  inside the range pyproject.toml declares (so CI tests the range users get)."""
  import pathlib  # pylint: disable=g-import-not-at-top
  import tomllib  # pylint: disable=g-import-not-at-top
  from packaging.requirements import Requirement  # pylint: disable=g-import-not-at-top
  from packaging.utils import canonicalize_name  # pylint: disable=g-import-not-at-top
  from packaging.version import Version  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(REPO)
  project = tomllib.loads((root / 'pyproject.toml').read_text())['project']
  declared = {}
  for line in project['dependencies'] + [d for ds in project['optional-dependencies'].values()
                                         for d in ds]:
    r = Requirement(line)
    declared[canonicalize_name(r.name)] = r.specifier
  for name in ('oldest', 'newest'):
    pins = {}
    for line in (root / '.ci' / f'constraints-{name}.txt').read_text().splitlines():
      if line.strip() and not line.startswith('#'):
        r = Requirement(line)
        (spec,) = r.specifier
        pins[canonicalize_name(r.name)] = spec.version
    for pkg, version in pins.items():
      if pkg in declared:
        assert version in declared[pkg], (name, pkg, version, str(declared[pkg]))
    if name == 'oldest':
      for pkg, spec in declared.items():
        lower = [s.version for s in spec if s.operator == '>=']
        if pkg in pins and lower:
          assert Version(pins[pkg]) == Version(lower[0]), (pkg, pins[pkg], lower[0])


def test_v1_leaf_handler_factories_are_hooked_and_given_back_exactly():
  """v1 builds the v0 handler of each leaf kind through a module-level factory
  (``_compat/orbax_v1_seams.py``); the installed Orbax has all three, ``install`` wraps them and
  ``uninstall`` puts back the very same functions."""
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax_pathways._compat import orbax_v1_seams as compat_v1  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint.experimental.v1._src.serialization import (  # pylint: disable=g-import-not-at-top
      array_leaf_handler, numpy_leaf_handler, scalar_leaf_handler)
  seams = [(array_leaf_handler, '_create_v0_array_handler'),
           (numpy_leaf_handler, '_create_v0_numpy_handler'),
           (scalar_leaf_handler, '_create_v0_scalar_handler')]
  assert compat_v1.HOST_SEAMS == ('numpy', 'scalar')
  assert compat_v1.hooked_host_kinds() == ('numpy', 'scalar')
  orbax_pathways.uninstall()
  try:
    originals = [getattr(m, n) for m, n in seams]
    assert not compat_v1.installed() and compat_v1.hooked_host_kinds() == ()
    orbax_pathways.install()
    assert all(getattr(m, n) is not o for (m, n), o in zip(seams, originals))
    assert type(numpy_leaf_handler.NumpyLeafHandler()._handler_impl).__name__ == 'ProxyNumpyHandler'  # pylint: disable=protected-access
    assert type(scalar_leaf_handler.ScalarLeafHandler()._handler_impl).__name__ == 'ProxyScalarHandler'  # pylint: disable=protected-access
    orbax_pathways.uninstall()
    assert [getattr(m, n) for m, n in seams] == originals
    assert type(numpy_leaf_handler.NumpyLeafHandler()._handler_impl) is compat.NumpyHandler  # pylint: disable=protected-access
  finally:
    orbax_pathways.install()


def test_numpy_handler_settings_carry_over():
  """The settings ours takes from the Orbax handler it stands in for."""
  import inspect  # pylint: disable=g-import-not-at-top
  settings = dict(metadata_key='.zarray2', ocdbt_process_id='pwcontroller')
  if 'deepcopy_host_arrays' in inspect.signature(compat.NumpyHandler).parameters:
    settings['deepcopy_host_arrays'] = False  # v1 takes it from the Context's MemoryOptions
  h = compat.NumpyHandler(**settings)
  assert compat.numpy_handler_constructor_kwargs(h) == settings
  s = compat.ScalarHandler(ocdbt_process_id='pwcontroller')
  assert compat.numpy_handler_constructor_kwargs(s) == dict(
      metadata_key=None, ocdbt_process_id='pwcontroller')
  from orbax_pathways.frontends import orbax_v0  # pylint: disable=g-import-not-at-top
  ours = orbax_v0.ProxyNumpyHandler(**compat.numpy_handler_constructor_kwargs(h))
  assert compat.numpy_handler_deepcopies(ours) == settings.get('deepcopy_host_arrays', True)
  assert compat.numpy_handler_ocdbt_process_id(ours) == 'pwcontroller'


def test_the_installed_gcsfs_lists_an_object_created_on_a_whole_second():
  """GCS and fake-gcs-server send ``timeCreated`` without a fraction for an object created on a
  whole second; gcsfs before 2024.12.0 (gcsfs#649) raised IndexError listing it, which failed
  an Orbax save's finalize in CI. ``pyproject.toml``'s floor keeps those releases out."""
  import datetime  # pylint: disable=g-import-not-at-top
  import gcsfs  # pylint: disable=g-import-not-at-top
  parse = gcsfs.GCSFileSystem._parse_timestamp  # pylint: disable=protected-access
  assert parse(None, '2026-12-04T21:08:00Z') == datetime.datetime(
      2026, 12, 4, 21, 8, tzinfo=datetime.timezone.utc)
  assert parse(None, '2026-12-04T21:08:00.5Z').microsecond == 500000


def test_step_metadata_memory_is_installed_only_with_the_package_and_given_back_exactly(tmp_path):
  """``_compat/orbax_step_metadata.py`` wraps Orbax's metadata store's ``write`` / ``read`` and
  ``_sanitize_metadata_path``; ``uninstall`` puts back the very same functions. Installed, a
  step directory registered with ``remembering`` has its ``_CHECKPOINT_METADATA`` read from
  what this process wrote; outside the block (and for any other directory) a read is Orbax's
  own, from the file."""
  import json  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.metadata import checkpoint as ck  # pylint: disable=g-import-not-at-top
  from orbax_pathways._compat import orbax_step_metadata as osm  # pylint: disable=g-import-not-at-top
  seams = [(ck._MetadataStoreImpl, 'write'), (ck._MetadataStoreImpl, 'read'),  # pylint: disable=protected-access
           (ck, '_sanitize_metadata_path')]
  assert osm.installed()
  orbax_pathways.uninstall()
  try:
    originals = [vars(m)[n] for m, n in seams]
    assert not osm.installed()
    orbax_pathways.install()
    assert all(vars(m)[n] is not o for (m, n), o in zip(seams, originals))
    step = tmp_path / '7'
    step.mkdir()
    other = tmp_path / '8'
    other.mkdir()
    store = ck.metadata_store(enable_write=True, blocking_write=True)
    with osm.remembering(step):
      for d in (step, other):
        store.write(ck.step_metadata_file_path(d), {'a': 1})
        (d / ck._STEP_METADATA_FILENAME).write_text(json.dumps({'a': 2}))  # pylint: disable=protected-access  # changed behind the store's back
      assert store.read(ck.step_metadata_file_path(step)) == {'a': 1}  # what this save wrote
      assert store.read(ck.step_metadata_file_path(other)) == {'a': 2}  # not registered: the file
    assert store.read(ck.step_metadata_file_path(step)) == {'a': 2}  # the block ended: the file
    orbax_pathways.uninstall()
    assert [vars(m)[n] for m, n in seams] == originals
  finally:
    orbax_pathways.install()


def test_small_writes_seam_is_installed_only_with_the_package_and_given_back_exactly(tmp_path):
  """``_compat/orbax_small_writes.py`` wraps Orbax's ``async_path.write_text``, ``read_text`` and
  ``exists``; ``uninstall`` puts back the very same functions. Installed, a file of a registered
  step directory that is not on gs:// (here a local disk) is still written by Orbax's own code,
  with its text; while the directory stays registered, reading it back and asking whether it
  (or a directory above it) exists are answered from what this process wrote, even after the
  file changed or went behind its back; once the block ends, from the disk again.
  ``inside_registered`` covers the step's files down to an item's ``array_metadatas``."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.path import async_path  # pylint: disable=g-import-not-at-top
  from orbax_pathways._compat import orbax_small_writes as osw  # pylint: disable=g-import-not-at-top
  from orbax_pathways._compat import orbax_step_metadata as osm  # pylint: disable=g-import-not-at-top
  names = ('write_text', 'read_text', 'exists')
  assert osw.installed()
  orbax_pathways.uninstall()
  try:
    originals = [vars(async_path)[n] for n in names]
    assert not osw.installed()
    orbax_pathways.install()
    assert all(vars(async_path)[n] is not o for n, o in zip(names, originals))
    step = tmp_path / '3'
    (step / 'default' / 'array_metadatas').mkdir(parents=True)
    mine = step / 'default' / 'array_metadatas' / 'process_0'
    other = tmp_path / '4' / 'x'
    other.parent.mkdir()
    run = asyncio.run
    with osm.remembering(step):
      assert osm.inside_registered(step / 'commit_success.txt')
      assert osm.inside_registered(mine)
      assert not osm.inside_registered(tmp_path / '4' / 'commit_success.txt')
      assert not osm.inside_registered(step / 'a' / 'b' / 'c' / 'd')
      run(async_path.write_text(mine, '{"x": 1}'))
      run(async_path.write_text(other, 'o'))
      assert mine.read_text() == '{"x": 1}'  # Orbax's own write, on a local disk
      mine.write_text('changed')  # behind the save's back
      other.write_text('changed')
      assert run(async_path.read_text(mine)) == '{"x": 1}'
      assert run(async_path.read_text(other)) == 'changed'  # not registered: the disk
      mine.unlink()
      assert run(async_path.exists(mine)) and run(async_path.exists(step / 'default'))
      assert not run(async_path.exists(step / 'default' / 'array_metadatas' / 'process_1'))
    assert not run(async_path.exists(mine))  # the block ended: the disk
    assert not osw.put(mine, b'{}')  # not gs://: nothing written
    assert not mine.exists()
    orbax_pathways.uninstall()
    assert [vars(async_path)[n] for n in names] == originals
  finally:
    orbax_pathways.install()


def test_an_item_directory_in_a_step_this_save_created_is_made_without_an_existence_check(
    tmp_path, caplog):
  """``_compat/orbax_small_writes.py`` wraps Orbax's ``atomicity._create_tmp_directory``: once
  this process's save created a registered step directory, making an item directory in it asks
  nobody whether it exists (on gs:// two round trips in every save's commit). Seen on a local
  disk, where it shows: a directory planted behind the save's back is not found and removed
  first, as Orbax's own code does outside a registered step; the make fails on it instead.
  ``uninstall`` gives the very same function back."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.path import async_path  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.path import atomicity  # pylint: disable=g-import-not-at-top
  from orbax_pathways._compat import orbax_step_metadata as osm  # pylint: disable=g-import-not-at-top

  def create(path):
    return asyncio.run(atomicity._create_tmp_directory(async_path.mkdir, path))  # pylint: disable=protected-access

  from etils import epath  # pylint: disable=g-import-not-at-top
  step, other = epath.Path(tmp_path) / '7', epath.Path(tmp_path) / '8'
  with osm.remembering(step):
    assert not osm.created_fresh(step)
    create(step)
    assert osm.created_fresh(step) and step.is_dir()
    (step / 'default' / 'planted').mkdir(parents=True)  # behind the save's back
    with pytest.raises(FileExistsError):
      create(step / 'default')  # no existence check: made at once, and it is there
    create(other)  # not registered: Orbax's own
    assert not osm.created_fresh(other)
    (other / 'default' / 'planted').mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
      create(other / 'default')  # Orbax's own: found, removed, made again
    assert not (other / 'default' / 'planted').exists()
    assert 'already exists' in caplog.text
  assert not osm.created_fresh(step)  # the registration ended
  wrapped = vars(atomicity)['_create_tmp_directory']
  orbax_pathways.uninstall()
  try:
    assert vars(atomicity)['_create_tmp_directory'] is not wrapped
    assert vars(atomicity)['_create_tmp_directory'] is wrapped.__wrapped__
  finally:
    orbax_pathways.install()


def test_the_hidden_manager_takes_the_very_handlers_of_its_manager(tmp_path):
  """``orbax_manager_state.handlers_of`` reads Orbax's private composite handler registry: the
  manager's handler objects per item and argument type, save and restore, without Orbax's
  metrics item; an empty registry for a manager built without handlers."""
  from orbax_pathways._compat import orbax_manager_state  # pylint: disable=g-import-not-at-top
  handler = ocp.StandardCheckpointHandler(use_ocdbt=False)
  with ocp.CheckpointManager(tmp_path / 'a', item_handlers=handler) as m:
    got = orbax_manager_state.handlers_of(m).get_all_entries()
  assert {k: v for k, v in got.items()} == {('default', ocp.args.StandardSave): handler,
                                            ('default', ocp.args.StandardRestore): handler}, got
  with ocp.CheckpointManager(tmp_path / 'b') as m:
    empty = orbax_manager_state.handlers_of(m)
    assert not empty.get_all_entries()


def test_the_clean_up_seam_spares_only_the_local_steps_directory_and_is_given_back(tmp_path):
  """``_compat/orbax_tmp_cleanup.py`` wraps Orbax's ``temporary_paths.all_temporary_paths``
  while the package is installed and gives back the very same function. Here (a local disk)
  Orbax's own rule finds the ``.orbax-checkpoint-tmp`` step; the list never names
  ``.orbax-pathways-local``; the gs:// case is ``tests/tier/test_local_step_commits.py``."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.path import temporary_paths  # pylint: disable=g-import-not-at-top
  from orbax_pathways._compat import orbax_tmp_cleanup  # pylint: disable=g-import-not-at-top
  assert orbax_tmp_cleanup.installed()
  wrapped = temporary_paths.all_temporary_paths
  for name in ('3.orbax-checkpoint-tmp-1700000000', '.orbax-pathways-local', '2'):
    (tmp_path / name).mkdir()
  found = asyncio.run(temporary_paths.all_temporary_paths(tmp_path))
  assert [p.get().name for p in found] == ['3.orbax-checkpoint-tmp-1700000000'], found
  from orbax_pathways._compat import seam  # pylint: disable=g-import-not-at-top
  original = seam.originals(orbax_tmp_cleanup.FEATURE)['all_temporary_paths']
  orbax_pathways.uninstall()
  try:
    assert temporary_paths.all_temporary_paths is original is not wrapped
    assert not orbax_tmp_cleanup.installed()
    orbax_tmp_cleanup.uninstall()  # idempotent
  finally:
    orbax_pathways.install()
  assert temporary_paths.all_temporary_paths is not wrapped and orbax_tmp_cleanup.installed()


def test_a_save_alone_counts_and_signals_in_its_own_namespace_and_is_given_back():
  """``_compat/orbax_process_local``: its four Orbax targets exist; inside ``alone()`` (and in
  a commit thread Orbax starts from it) operation ids and the signalling client are the
  namespace's, outside they are Orbax's, and ``uninstall()`` puts back the very originals."""
  from orbax_pathways._compat import orbax_process_local as alone_lib  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.futures import future, signaling_client, synchronization  # pylint: disable=g-import-not-at-top
  assert alone_lib.missing() == []
  gen = synchronization.OperationIdGenerator
  originals = [vars(gen)['next_operation_id'], vars(gen)['get_current_operation_id'],
               vars(signaling_client)['get_signaling_client'],
               vars(future._SignalingThread)['__init__']]  # pylint: disable=protected-access
  job_client = signaling_client.get_signaling_client()
  try:
    before = gen.get_current_operation_id()

    def thread_sees():
      seen = {}
      t = future._SignalingThread(  # pylint: disable=protected-access
          target=lambda: seen.update(id=gen.get_current_operation_id(),
                                     client=signaling_client.get_signaling_client()),
          send_signals=[], receive_signals=[])
      t.start()
      t.join()
      return seen

    with alone_lib.alone(7):
      assert gen.next_operation_id() == 'alone-7-1'
      assert gen.next_operation_id() == 'alone-7-2'
      assert gen.get_current_operation_id() == 'alone-7-2'
      own_client = signaling_client.get_signaling_client()
      assert own_client is not job_client
      assert thread_sees() == {'id': 'alone-7-2', 'client': own_client}
      assert alone_lib.job_operation_id() == before
    assert gen.get_current_operation_id() == before  # the job's counter never moved
    assert signaling_client.get_signaling_client() is job_client
    assert thread_sees() == {'id': before, 'client': job_client}
  finally:
    alone_lib.uninstall()
  assert [vars(gen)['next_operation_id'], vars(gen)['get_current_operation_id'],
          vars(signaling_client)['get_signaling_client'],
          vars(future._SignalingThread)['__init__']] == originals  # pylint: disable=protected-access
