"""Bands (``tier/manifest.py``): where the chunk grid cuts a writer's piece into
column blocks, the tier keeps the chunks of one chunk row side by side in one file, as they lie
in a same-mesh restore's region buffer, which then maps that file whole instead of copying each
chunk's rows into fresh pages. Each chunk is still checked against the committed record where
it lies: a damaged chunk alone goes to storage. Peers get one chunk of a band; ``orbax-pathways
tier`` checks every chunk of it; a forged band is refused.

Real Orbax CheckpointManager, real tensorstore, real files and mappings (``/proc/self/maps``).
"""

from __future__ import annotations

import gc
import logging
import math
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from orbax_pathways import stats
from orbax_pathways.cli import tier as cli_tier
from orbax_pathways.storage import pages
from orbax_pathways.tier import manifest as manifest_lib
from orbax_pathways.tier import store as tier_store
from support import ckpt

P = jax.sharding.PartitionSpec
ROWS, COLS = 1024, 4096  # 16 MiB of float32; 4 row blocks of 4 MiB, one per 'x' index


def _save(tier, root):
  """'big' sharded over 'x' (4 row blocks of 256 x 4096, each on 2 devices): each block is
  stored in 4 column chunks of 256 x 1024 (the chunk shape keeps chunks within 4x square), so
  a block is one band of 4 chunks. 'small' has chunks that span its rows: files of their own."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('x', 'y'))
  rng = np.random.default_rng(7)
  host = {'big': rng.standard_normal((ROWS, COLS)).astype(np.float32),
          'small': rng.standard_normal((64, 16)).astype(np.float32)}
  state = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, P('x', None)))
           for k, v in host.items()}
  return state, host, ckpt.save_tier_entry(tier, root, state)


def _restore(root, target):
  with ocp.CheckpointManager(root) as m:
    out = m.restore(1, args=ocp.args.StandardRestore(target))
  return out, stats.last_restore()


def _maps() -> str:
  with open('/proc/self/maps', encoding='utf-8') as f:
    return f.read()


def test_a_chunk_row_is_one_band_file_on_disk(tmp_path):
  _, host, entry = _save(tmp_path / 'tier', tmp_path / 'ckpt')
  big = next(a for a in entry.manifest.arrays if a.name == 'big')
  assert big.chunk_shape == (256, 1024)
  assert len(big.origins) == 16 and len(big.bands) == 4
  on_disk = sorted(f for f in os.listdir(entry.path) if f.endswith('.bin'))
  for f, origin, shape in big.bands:
    assert shape == (256, COLS) and origin[1] == 0
    # The band file holds the rows of the array, all columns: C order of the band.
    data = np.fromfile(os.path.join(entry.path, f), np.float32).reshape(shape)
    np.testing.assert_array_equal(data, host['big'][origin[0]:origin[0] + 256])
    assert sorted(o for o, g in zip(big.origins, big.files) if g == f) == [
        (origin[0], c) for c in range(0, COLS, 1024)]
  small = next(a for a in entry.manifest.arrays if a.name == 'small')
  assert small.bands == () and len(set(small.files)) == len(small.files)
  assert on_disk == sorted({f for f, _, _ in big.bands} | set(small.files))
  assert manifest_lib.decode(manifest_lib.encode(entry.manifest)) == entry.manifest


@pytest.mark.skipif(not pages.enabled(), reason='mappings are Linux-only')
def test_a_same_mesh_restore_maps_each_band_whole_and_returns_the_saved_values(tmp_path):
  state, host, entry = _save(tmp_path / 'tier', tmp_path / 'ckpt')
  big = next(a for a in entry.manifest.arrays if a.name == 'big')
  before = pages.live()
  out, st = _restore(tmp_path / 'ckpt', state)
  for k, v in host.items():
    np.testing.assert_array_equal(np.asarray(out[k]), v, err_msg=k)
  assert st.bytes_by_source.get('storage') == 0
  assert st.bytes_by_source['local'] == sum(v.nbytes for v in host.values())
  # One mapping per band (each row block's region is one band), none per chunk.
  assert pages.live() == before + len(big.bands)
  for f, _, _ in big.bands:
    assert os.path.join(entry.path, f) in _maps()
  del out
  gc.collect()
  assert pages.live() == before


def test_another_mesh_copies_each_chunk_out_of_its_band(tmp_path):
  """Column-sharded target: no band lies in a region as one run; every chunk is copied out of
  its band, checked, exact."""
  state, host, _ = _save(tmp_path / 'tier', tmp_path / 'ckpt')
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ('a', 'b'))
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=jax.sharding.NamedSharding(
      mesh, P('a', 'b') if k == 'big' else P())) for k, v in host.items()}
  before = pages.live()
  out, st = _restore(tmp_path / 'ckpt', target)
  for k, v in host.items():
    np.testing.assert_array_equal(np.asarray(out[k]), v, err_msg=k)
  assert st.bytes_by_source.get('storage') == 0
  assert pages.live() == before


def test_a_damaged_chunk_of_a_band_alone_is_read_from_storage(tmp_path, caplog):
  """One byte flipped in the second chunk of the first band (inside its rows, mapped or not):
  that chunk comes from storage over the mapped pages (copy-on-write: the tier's file keeps its
  bytes), the band's other chunks from the tier; one log line naming the chunk."""
  root = tmp_path / 'ckpt'
  state, host, entry = _save(tmp_path / 'tier', root)
  big = next(a for a in entry.manifest.arrays if a.name == 'big')
  f, origin, _ = min(big.bands, key=lambda b: b[1])
  path = os.path.join(entry.path, f)
  at = (3 * COLS + 1024 + 5) * 4  # row 3, column 1029: chunk (0, 1024)
  with open(path, 'r+b') as fh:
    fh.seek(at)
    b = fh.read(1)
    fh.seek(at)
    fh.write(bytes([b[0] ^ 0xFF]))
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  out, st = _restore(root, state)
  for k, v in host.items():
    np.testing.assert_array_equal(np.asarray(out[k]), v, err_msg=k)
  chunk_bytes = 256 * 1024 * 4
  assert st.bytes_by_source['storage'] == chunk_bytes
  assert st.bytes_by_source['local'] == sum(v.nbytes for v in host.values()) - chunk_bytes
  lines = [r.getMessage() for r in caplog.records if 'node-local copy' in r.getMessage()]
  assert len(lines) == 1 and "'big' chunk [0, 1024] is damaged" in lines[0], lines
  with open(path, 'rb') as fh:  # the restore's fallback never wrote into the tier's file
    fh.seek(at)
    assert fh.read(1) == bytes([b[0] ^ 0xFF])


def test_tier_check_reads_every_chunk_of_a_band(tmp_path):
  root = tmp_path / 'ckpt'
  _, _, entry = _save(tmp_path / 'tier', root)
  status, problems = cli_tier._check(entry, str(root))
  assert (status, problems) == ('ok', [])
  big = next(a for a in entry.manifest.arrays if a.name == 'big')
  f, origin, _ = max(big.bands, key=lambda b: b[1])
  with open(os.path.join(entry.path, f), 'r+b') as fh:
    fh.seek((COLS - 1) * 4)  # row 0, last column: chunk (origin, 3072)
    b = fh.read(1)
    fh.seek((COLS - 1) * 4)
    fh.write(bytes([b[0] ^ 1]))
  status, problems = cli_tier._check(entry, str(root))
  assert status == 'damaged' and len(problems) == 1, problems
  assert f"'big' chunk [{origin[0]}, 3072] damaged" in problems[0], problems


def _with_big(m, **changes):
  arrays = tuple(type(a)(**{**a.__dict__, **changes}) if a.name == 'big' else a
                 for a in m.arrays)
  return type(m)(**{**m.__dict__, 'arrays': arrays})


def test_a_forged_band_is_refused(tmp_path):
  _, _, entry = _save(tmp_path / 'tier', tmp_path / 'ckpt')
  m = entry.manifest
  assert manifest_lib.manifest_problem(m) == ''
  big = next(a for a in m.arrays if a.name == 'big')
  f, origin, shape = big.bands[0]
  cases = {
      # A band reaching past the array: its bytes would be read past the file's end.
      'is not a band of [1024, 4096]': ((f, origin, (shape[0], shape[1] + 1)),) + big.bands[1:],
      # Rows no chunk fills: the band's size and its chunks' differ.
      'holds 8388608 bytes, its chunks 4194304': ((f, origin, (512, shape[1])),) + big.bands[1:],
      # A chunk placed in a band that does not contain it.
      'lies outside its band': ((f, (origin[0] + 256, 0), shape),
                                (big.bands[1][0], (origin[0], 0), shape)) + big.bands[2:],
  }
  for want, bands in cases.items():
    why = manifest_lib.manifest_problem(_with_big(m, bands=bands))
    assert want in why, (want, why)
  # A band file that is also another array's chunk file.
  small = next(a for a in m.arrays if a.name == 'small')
  forged = _with_big(m, bands=((small.files[0], origin, shape),) + big.bands[1:])
  assert manifest_lib.manifest_problem(forged) != ''
  # Written to disk, the entry is listed as damaged and no restore reads it.
  path = os.path.join(entry.path, manifest_lib.MANIFEST)
  with open(path, 'wb') as fh:
    fh.write(manifest_lib.encode(_with_big(m, bands=tuple(cases.values())[0])))
  (listed,) = tier_store.entries(str(tmp_path / 'tier'), str(tmp_path / 'ckpt'))
  assert listed.manifest is None and 'is not a band of' in listed.error


def test_a_band_file_of_another_size_is_refused_and_storage_serves(tmp_path, caplog):
  root = tmp_path / 'ckpt'
  state, host, entry = _save(tmp_path / 'tier', root)
  big = next(a for a in entry.manifest.arrays if a.name == 'big')
  f, _, shape = big.bands[0]
  with open(os.path.join(entry.path, f), 'ab') as fh:
    fh.write(b'\0' * 4096)
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  out, st = _restore(root, state)
  for k, v in host.items():
    np.testing.assert_array_equal(np.asarray(out[k]), v, err_msg=k)
  assert st.bytes_by_source['storage'] == math.prod(shape) * 4
