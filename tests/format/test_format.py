"""``orbax_pathways.format.names`` agrees with Orbax's own constants and with what tensorstore writes.

The names are compared with Orbax's private constants (tests may import ``orbax.checkpoint._src``;
the package may not, outside ``_compat``). Chunk keys and the chunk grid are compared with the keys
tensorstore actually stores for arrays written with Orbax's own write spec, zarr v2 and zarr3, in
per-array directories and in OCDBT; the read spec must read those arrays back bit-exactly.
"""

from __future__ import annotations

from etils import epath
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.metadata import checkpoint as checkpoint_metadata
from orbax.checkpoint._src.metadata import sharding as sharding_metadata
from orbax.checkpoint._src.path import atomicity_types
from orbax.checkpoint._src.path import format_utils
from orbax.checkpoint._src.serialization import jax_array_handlers
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils
import pytest
import tensorstore as ts

from orbax_pathways.format import names as fmt
from orbax_pathways.format import grid as grid_lib
from orbax_pathways.format import records as records_lib

from support import procs
from support.workers import bare_import_worker


def test_names_are_orbaxs():
  assert fmt.TMP_SUFFIX == atomicity_types.TMP_DIR_SUFFIX
  assert fmt.COMMIT_SUCCESS_FILE == atomicity_types.COMMIT_SUCCESS_FILE
  assert fmt.CHECKPOINT_METADATA_FILE == checkpoint_metadata._STEP_METADATA_FILENAME  # pylint: disable=protected-access
  assert fmt.ITEM_METADATA_FILE == format_utils.PYTREE_METADATA_FILE
  assert fmt.OCDBT_MANIFEST_FILE == format_utils.OCDBT_MANIFEST_FILE
  assert fmt.SHARDING_FILE == sharding_metadata._SHARDING == jax_array_handlers._SHARDING_FILE_NAME  # pylint: disable=protected-access
  assert fmt.STRINGS_FILE == ocp.type_handlers.StringHandler()._filename  # pylint: disable=protected-access
  assert fmt.ARRAY_METADATAS_DIR == array_metadata_store.PathResolver._metadata_subdir  # pylint: disable=protected-access
  try:  # Orbax >= 0.12.5 keeps it here; older ones in tensorstore_utils
    from orbax.checkpoint._src.serialization import ocdbt_process_spec  # pylint: disable=g-import-not-at-top
    prefix = ocdbt_process_spec.PROCESS_PREFIX
  except ImportError:
    from orbax.checkpoint._src.serialization import tensorstore_utils  # pylint: disable=g-import-not-at-top
    prefix = tensorstore_utils.PROCESS_SUBDIR_PREFIX
  assert fmt.OCDBT_PROCESS_PREFIX == prefix
  assert fmt.JAX_ARRAY_VALUE_TYPE == jax_array_handlers.JAX_ARRAY_TYPE_STR


def test_our_names_are_the_metadata_modules():
  assert (fmt.PATHWAYS_DIR, fmt.PATHWAYS_SUFFIX) == (records_lib.DIRNAME, records_lib.SUFFIX)
  assert not hasattr(fmt, 'chunk_index')  # one definition, in metadata: no format<->metadata circle


@pytest.mark.parametrize('prefix', [None, 'ckpt'])
@pytest.mark.parametrize('fixed_length', [None, 6])
def test_step_names_as_orbax_builds_them(prefix, fixed_length):
  name_format = ocp.step.standard_name_format(step_prefix=prefix,
                                              step_format_fixed_length=fixed_length)
  for step in (0, 7, 1234):
    name = name_format.build_name(step)
    assert fmt.parse_step_name(name) == (step, False)
    tmp = name + fmt.TMP_SUFFIX  # atomicity._get_tmp_directory
    assert fmt.parse_step_name(tmp) == (step, True)
    assert fmt.final_name(tmp) == name and fmt.is_tmp(tmp) and not fmt.is_tmp(name)
    assert fmt.step_of(name) == fmt.step_of(tmp) == step
  assert fmt.parse_step_name('tensorboard') is None
  assert fmt.parse_step_name('default') is None
  assert fmt.step_of('default') is None


def _write_with_orbax_spec(directory, name, value, write_shape, *, zarr3, ocdbt):
  """Writes ``value`` with Orbax's exact write spec (chunks = write shape, as stock Orbax);
  returns the kvstore the array's keys live in (OCDBT: this writer's database)."""
  spec = tensorstore_utils.ArrayWriteSpec(
      directory, relative_array_filename=name, global_shape=value.shape, write_shape=write_shape,
      dtype=value.dtype, use_zarr3=zarr3, use_ocdbt=ocdbt, process_id=0 if ocdbt else None)
  context = tensorstore_utils.get_ts_context(use_ocdbt=ocdbt)
  t = ts.open(spec.json, create=True, open=True, context=context).result()
  t.write(value).result()
  return spec.json['kvstore']


def _stored_chunk_keys(kvstore, *, prefix: str) -> set[str]:
  """The keys under ``prefix`` in ``kvstore``, less zarr's metadata keys."""
  context = tensorstore_utils.get_ts_context(use_ocdbt=True)
  keys = {k.decode() for k in ts.KvStore.open(kvstore, context=context).result().list().result()}
  keys = {k[len(prefix):] for k in keys if k.startswith(prefix)}
  return keys - {'.zarray', '.zattrs', 'zarr.json'}


CASES = [  # (shape, write/chunk shape): ragged edges, a full grid, a vector, a scalar
    ((5, 3), (2, 2)),
    ((8, 6), (4, 3)),
    ((7,), (3,)),
    ((), ()),
]


@pytest.mark.parametrize('ocdbt', [False, True], ids=['dirs', 'ocdbt'])
@pytest.mark.parametrize('zarr3', [False, True], ids=['zarr2', 'zarr3'])
def test_chunk_keys_and_grid_match_tensorstore(tmp_path, zarr3, ocdbt):
  item = str(tmp_path / 'item')
  for i, (shape, chunk) in enumerate(CASES):
    name = f'params.a{i}'
    value = (np.arange(int(np.prod(shape)), dtype=np.float32) + 1).reshape(shape)
    kvstore = _write_with_orbax_spec(item, name, value, chunk, zarr3=zarr3, ocdbt=ocdbt)
    if ocdbt:  # the writer's database; the array is a key prefix inside it
      kvstore, prefix = {k: v for k, v in kvstore.items() if k != 'path'}, name + '/'
    else:  # the array's own directory
      kvstore, prefix = {'driver': 'file', 'path': kvstore['path'] + '/'}, ''
    stored = _stored_chunk_keys(kvstore, prefix=prefix)
    origins = list(fmt.chunk_origins(shape, chunk))
    assert {fmt.chunk_key(o, chunk, zarr3=zarr3) for o in origins} == stored, (shape, chunk)
    assert len(origins) == len(stored)  # one grid cell per stored chunk, none twice
    # Every element lies in exactly one clipped chunk region.
    covered = np.zeros(shape, np.int32)
    for o in origins:
      covered[fmt.chunk_region(o, chunk, shape).to_slices()] += 1
    assert (covered == 1).all()
    if ocdbt:
      assert fmt.param_chunk_key(name, origins[-1], chunk, zarr3=zarr3) in {
          prefix + k for k in stored}


def _merge_ocdbt(item: str, zarr3: bool) -> None:
  """What Orbax's finalize does: the item's root database references every writer's."""
  asyncio_utils.run_sync(ocdbt_utils.merge_ocdbt_per_process_files(
      epath.Path(item), ts_context=tensorstore_utils.get_ts_context(use_ocdbt=True),
      use_zarr3=zarr3, enable_validation=False))


@pytest.mark.parametrize('ocdbt', [False, True], ids=['dirs', 'ocdbt'])
@pytest.mark.parametrize('zarr3', [False, True], ids=['zarr2', 'zarr3'])
def test_read_spec_reads_what_orbax_wrote(tmp_path, zarr3, ocdbt):
  item = str(tmp_path / 'item')
  value = (np.arange(15, dtype=np.float32) * 3).reshape(5, 3)
  _write_with_orbax_spec(item, 'params.w', value, (2, 2), zarr3=zarr3, ocdbt=ocdbt)
  if ocdbt:
    _merge_ocdbt(item, zarr3)
  spec = fmt.array_read_spec(item, 'params.w', ocdbt=ocdbt, zarr3=zarr3)
  context = ts.Context({'cache_pool#ocdbt': {'total_bytes_limit': 1 << 20}})
  t = ts.open(spec, read=True, context=context).result()
  np.testing.assert_array_equal(t.read().result(), value)
  assert tuple(t.chunk_layout.write_chunk.shape) == (2, 2)


@pytest.mark.parametrize('directory', ['/ckpt/7/default', '/ckpt/7/default/',
                                       'gs://bucket-name/run/7/default'])
@pytest.mark.parametrize('ocdbt', [False, True], ids=['dirs', 'ocdbt'])
def test_kvstore_spec_is_orbaxs_read_rule(directory, ocdbt):
  ours = fmt.kvstore_spec(directory, 'params.w', ocdbt=ocdbt)
  assert fmt.array_read_spec(directory, 'params.w', ocdbt=ocdbt, zarr3=True)['kvstore'] == ours
  orbax = tensorstore_utils.build_kvstore_tspec(directory, 'params.w', use_ocdbt=ocdbt)
  if ocdbt and not directory.startswith('gs://'):  # write-side locking of local OCDBT files
    orbax = {k: v for k, v in orbax.items() if k != 'manifest'}
    orbax['base'] = {k: v for k, v in orbax['base'].items() if k != 'file_io_locking'}
  if ocdbt:  # Orbax versions differ on a trailing '/' of the OCDBT base: the same directory
    orbax['base'] = {**orbax['base'], 'path': orbax['base']['path'].rstrip('/')}
    ours = {**ours, 'base': {**ours['base'], 'path': ours['base']['path'].rstrip('/')}}
  assert ours == orbax


def test_chunk_index_merges_writers():
  a = records_lib.ArrayRecord('w', 'float32', (4,), (2,), (records_lib.ChunkRecord((0,), 11, 8),))
  b = records_lib.ArrayRecord('w', 'float32', (4,), (2,), (records_lib.ChunkRecord((2,), 22, 8),))
  assert grid_lib.chunk_index([a, b]) == {(0,): a.chunks[0], (2,): b.chunks[0]}
  assert grid_lib.chunk_index([]) == {}


def _bare_import(module: str):
  """Imports ``module`` without running ``orbax_pathways/__init__.py`` (which installs the
  handler, hence imports jax): what a jax-free module needs is then all that is loaded
  (``support/workers/bare_import_worker.py``)."""
  return procs.run_worker(bare_import_worker, module, 'jax,jaxlib,tensorstore,orbax',
                          timeout=120, check=False, fresh=True)


def test_format_imports_neither_jax_nor_tensorstore():
  proc = _bare_import('orbax_pathways.format.names')
  assert proc.returncode == 0, proc.stderr
