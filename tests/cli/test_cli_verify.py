"""The ``orbax-pathways verify`` command against real CheckpointManager checkpoints
(``tests/cli/conftest.py``), intact and damaged: flipped bytes, truncated and deleted files,
lost records, damaged metadata."""

from __future__ import annotations

import dataclasses
import pathlib
import shutil

from orbax_pathways.format import records as records_lib
from orbax_pathways.storage import meta_io
from support import damage
from support import cli_steps as cs
from support.cli_steps import KERNEL, run, run_json


def test_verify_clean_stock_and_ours(built):
  # Stock Orbax: intact, but nothing could be checked by checksum: not "OK", exit 3.
  code, doc = run_json('verify', built['stock'] / '1')
  assert code == 3 and not doc['ok'] and doc['verdict'] == 'unchecked'
  assert doc['modes'] == {'default': 'decode'} and doc['problems'] == []
  for key in ('path', 'step', 'state', 'ok', 'verdict', 'modes', 'arrays', 'chunks',
              'chunks_checksummed', 'bytes_read', 'seconds', 'problems', 'unchecked'):
    assert key in doc
  assert doc['arrays'] == 4 and doc['bytes_read'] == 256 * 128 * 4 + 128 * 2 + 64 * 64 * 4 + 8
  assert sorted(u['key'] for u in doc['unchecked']) == [
      'opt.mu', 'params.dense.bias', KERNEL, 'step']
  assert {u['reason'] for u in doc['unchecked']} == {
      'no orbax-pathways checksums (written by stock Orbax)'}
  code, out, _ = run('verify', built['stock'] / '1')
  assert code == 3 and out.splitlines()[-1].startswith(
      'UNCHECKED: no damage found, but 4 values without a checksum (decoded only); 4 arrays')
  assert f'unchecked      default {KERNEL}: no orbax-pathways checksums' in out
  # Ours (records written by the fixture for the arrays only): the Python int 'step' has no
  # checksum, as when Orbax's own handler saved it; the verdict says so.
  code, doc = run_json('verify', built['ours'] / '1')
  assert code == 3 and doc['modes'] == {'default': 'checksum'} and doc['problems'] == []
  assert not doc['ok'] and doc['verdict'] == 'unchecked'
  assert doc['chunks_checksummed'] == doc['chunks'] - 1  # all but the scalar 'step'
  assert doc['unchecked'] == [{'item': 'default', 'key': 'step', 'reason': (
      "scalar leaf saved by Orbax's own handler (Orbax v1, or an orbax-pathways version that "
      'did not record numpy and scalar leaves)')}]
  code, out, _ = run('verify', built['ours'] / '1')
  assert out.splitlines()[-1].startswith('UNCHECKED: no damage found, but 1 value without')
  code, doc = run_json('verify', built['plain_ours'] / '1')
  assert code == 3 and doc['chunks_checksummed'] == doc['chunks'] - 1, doc['problems']


def test_verify_a_host_leaf_record_lost_beside_other_host_records_is_a_problem(saved, tmp_path):
  """Host leaves recorded (a numpy record exists) but one scalar's record is gone: restore
  raises MissingChecksumError, so verify fails it too."""
  step = cs.copy(saved['host'] / '1', tmp_path / '1')
  assert run_json('verify', step)[0] == 0
  pw = step / 'default' / records_lib.DIRNAME
  (pw / 'index.msgpack').unlink()
  (scalar,) = pw.glob('scalar.*.msgpack')
  scalar.unlink()
  code, doc = run_json('verify', step)
  assert code == 1 and cs.kinds(doc) == {'missing_record'} and cs.bad_arrays(doc) == {'count', 'lr'}


def test_verify_manager_written(built):
  """Whatever the installed library wrote verifies clean (checksums when the core wrote them)."""
  step = built['ocdbt'] / '1'
  code, doc = run_json('verify', step)
  assert code == 0, doc['problems']
  if (step / 'default' / records_lib.DIRNAME).exists():
    assert doc['modes'] == {'default': 'checksum'} and doc['chunks_checksummed'] > 0


def test_verify_flipped_byte_ocdbt(built, tmp_path):
  step = cs.copy(built['ours'] / '1', tmp_path / '1')
  cs.flip(cs.largest_data_file(step / 'default'))
  code, doc = run_json('verify', step)
  assert code == 1 and not doc['ok']
  assert cs.kinds(doc) & {'crc_mismatch', 'read_error'} and KERNEL in cs.bad_arrays(doc)
  bad = next(p for p in doc['problems'] if p['array'] == KERNEL)
  assert bad['origin'] is not None and 'ocdbt key params.dense.kernel/' in bad['path']
  if bad['kind'] == 'crc_mismatch':
    assert bad['expected_crc32c'] != bad['found_crc32c']


def test_verify_flipped_byte_plain(built, tmp_path):
  step = cs.copy(built['plain_ours'] / '1', tmp_path / '1')
  chunk_file = step / 'default' / KERNEL / '0.0'
  cs.flip(chunk_file)
  code, out, _ = run('verify', step)
  assert code == 1 and 'FAILED' in out
  assert f'{KERNEL} chunk (0, 0)' in out and str(chunk_file) in out
  _, doc = run_json('verify', step)
  (bad,) = doc['problems']
  assert bad['kind'] in ('crc_mismatch', 'read_error') and bad['origin'] == [0, 0]
  assert bad['path'] == str(chunk_file)


def test_verify_truncated_files(built, tmp_path):
  step = cs.copy(built['plain'] / '1', tmp_path / 'plain')
  cs.strip_ours(step)
  cs.truncate(step / 'default' / KERNEL / '1.0')
  code, doc = run_json('verify', step)
  assert code == 1 and cs.kinds(doc) == {'read_error'}
  (bad,) = doc['problems']
  assert bad['origin'] == [256 // cs.mesh().shape['data'], 0] and bad['path'].endswith('/1.0')
  step = cs.copy(built['ours'] / '1', tmp_path / 'ocdbt')
  cs.truncate(cs.largest_data_file(step / 'default'))
  code, doc = run_json('verify', step)
  assert code == 1 and KERNEL in cs.bad_arrays(doc)


def test_verify_deleted_chunk_files(built, tmp_path):
  step = cs.copy(built['plain'] / '1', tmp_path / 'plain')  # stock: decode-only still catches it
  cs.strip_ours(step)
  (step / 'default' / KERNEL / '0.1').unlink()
  code, doc = run_json('verify', step)
  assert code == 1
  (bad,) = doc['problems']
  assert (bad['kind'], bad['array'], bad['origin']) == (
      'read_error', KERNEL, [0, 128 // cs.mesh().shape['model']])
  assert 'missing' in bad['error'] or 'NOT_FOUND' in bad['error']
  step = cs.copy(built['stock'] / '1', tmp_path / 'ocdbt')
  cs.largest_data_file(step / 'default').unlink()
  code, doc = run_json('verify', step)
  assert code == 1 and KERNEL in cs.bad_arrays(doc)


def test_verify_damaged_metadata(built, tmp_path):
  step = cs.copy(built['ours'] / '1', tmp_path / 'msgpack')
  damaged = step / 'default' / '_pathways' / 'process_1.msgpack'
  damaged.write_bytes(damaged.read_bytes()[:20])
  code, doc = run_json('verify', step)
  assert code == 1 and 'metadata' in cs.kinds(doc)
  assert any(str(damaged) in (p['error'] or '') for p in doc['problems'])

  step = cs.copy(built['ours'] / '1', tmp_path / 'writer_missing')
  (step / 'default' / '_pathways' / 'process_1.msgpack').unlink()
  code, doc = run_json('verify', step)
  assert code == 1 and cs.kinds(doc) == {'missing_record'}

  step = cs.copy(built['stock'] / '1', tmp_path / 'orbax_meta')
  (step / 'default' / '_METADATA').write_text('{"tree_metadata": {')
  code, doc = run_json('verify', step)
  assert code == 1 and 'metadata' in cs.kinds(doc)

  step = cs.copy(built['plain'] / '1', tmp_path / 'zarray')
  (step / 'default' / KERNEL / '.zarray').write_text('not json')
  code, doc = run_json('verify', step)
  assert code == 1 and 'open_error' in cs.kinds(doc) and KERNEL in cs.bad_arrays(doc)


def test_verify_partial_step_fails(built, tmp_path):
  step = cs.copy(built['stock'] / '1', tmp_path / '1.orbax-checkpoint-tmp')
  code, doc = run_json('verify', step)
  assert code == 1 and cs.kinds(doc) == {'not_committed'}


def test_verify_progress_bar(built):
  code, _, err = run('verify', built['ours'] / '1', '--progress')
  assert code == 3 and 'verify [' in err and '/s' in err and 'chunks' in err


def test_verify_fails_when_pathways_dir_deleted_and_a_sibling_item_has_records(saved, tmp_path):
  step = cs.copy(saved['two_items'] / '1', tmp_path / '1')
  assert run_json('verify', step)[0] == 0
  shutil.rmtree(step / 'ema' / records_lib.DIRNAME)
  code, out, _ = run('verify', step)
  assert code == 1 and 'FAILED: 1 problem' in out
  assert f'missing_record {"ema"}  {step / "ema" / "_pathways"}' in out
  assert 'model of the same save have orbax-pathways records' in out
  _, doc = run_json('verify', step)
  (bad,) = doc['problems']
  assert (bad['kind'], bad['item'], bad['origin']) == ('missing_record', 'ema', None)
  assert doc['modes'] == {'model': 'checksum', 'ema': 'decode'}


def test_verify_fails_when_colocated_records_deleted(saved, tmp_path):
  step = cs.copy(saved['colocated'] / '1', tmp_path / '1')
  assert run_json('verify', step)[0] == 0
  shutil.rmtree(step / 'default' / records_lib.DIRNAME)
  code, doc = run_json('verify', step)
  assert code == 1 and cs.kinds(doc) == {'missing_record'}
  (bad,) = doc['problems']
  assert 'ocdbt.process_w' in bad['error'] and 'colocated transport' in bad['error']
  assert doc['chunks'] > 0 and doc['chunks_checksummed'] == 0  # still decoded, nothing checked


def test_verify_stock_looking_step_without_records_passes(saved, tmp_path):
  """With the in-process transport and a single item nothing that survives says who wrote the step
  (no marker exists without a format change); verify cannot tell it from stock Orbax: decodes."""
  step = cs.copy(saved['train'] / '10', tmp_path / '10')
  shutil.rmtree(step / 'default' / records_lib.DIRNAME)
  code, doc = run_json('verify', step)
  assert code == 3 and doc['modes'] == {'default': 'decode'} and doc['verdict'] == 'unchecked'
  assert doc['problems'] == [] and len(doc['unchecked']) == doc['arrays']


def test_verify_names_every_chunk_of_an_array_without_records(built, tmp_path):
  step = cs.copy(built['ours'] / '1', tmp_path / '1')
  cs.rewrite_records(step / 'default', lambda a: None if a.name == 'opt.mu' else a)
  code, doc = run_json('verify', step)
  assert code == 1 and cs.kinds(doc) == {'missing_record'} and cs.bad_arrays(doc) == {'opt.mu'}
  mesh = cs.mesh()
  rows = 64 // mesh.shape['data']
  assert sorted(tuple(p['origin']) for p in doc['problems']) == [
      (r, 0) for r in range(0, 64, rows)]
  assert {p['path'] for p in doc['problems']} == {
      f'{step / "default"} (ocdbt key opt.mu/{r // rows}.0)' for r in range(0, 64, rows)}
  # The unrecorded chunks were still read and decoded.
  assert doc['chunks'] == run_json('verify', built['ours'] / '1')[1]['chunks']


def test_verify_names_chunks_a_deleted_writer_file_recorded(built, tmp_path):
  step = cs.copy(built['plain_ours'] / '1', tmp_path / '1')
  (step / 'default' / '_pathways' / 'process_1.msgpack').unlink()
  code, out, _ = run('verify', step)
  assert code == 1
  _, doc = run_json('verify', step)
  assert cs.kinds(doc) == {'missing_record'}
  kernel = [p for p in doc['problems'] if p['array'] == KERNEL]
  assert kernel and all(p['path'].startswith(str(step / 'default' / KERNEL) + '/')
                        for p in kernel)
  assert all(pathlib.Path(p['path']).exists() for p in kernel)  # present in storage
  assert f'{KERNEL} chunk ({kernel[0]["origin"][0]}, {kernel[0]["origin"][1]})' in out


def test_verify_persistence_records_without_checksums_decode(built, tmp_path):
  """The persistence transport records shardings but no chunk checksums: decode, no failure."""
  step = cs.copy(built['ours'] / '1', tmp_path / '1')
  item = step / 'default'
  cs.rewrite_records(item, lambda a: dataclasses.replace(a, chunks=()))
  for f in (item / records_lib.DIRNAME).glob('*.msgpack'):
    rec = records_lib.decode(f.read_bytes())
    f.write_bytes(records_lib.encode(dataclasses.replace(rec, transport='persistence')))
  code, doc = run_json('verify', step)
  assert code == 3 and doc['problems'] == [], doc['problems']
  assert doc['modes'] == {'default': 'decode'} and doc['chunks_checksummed'] == 0
  assert {u['key'] for u in doc['unchecked']
          if u['reason'] == 'written by the persistence transport, which records no checksums'
          } == {KERNEL, 'params.dense.bias', 'opt.mu'}


def test_verify_checks_numpy_and_scalar_leaves(saved, tmp_path):
  step = cs.copy(saved['host'] / '1', tmp_path / '1')
  code, doc = run_json('verify', step)
  assert code == 0 and doc['verdict'] == 'ok', doc
  assert doc['arrays'] == 4 and doc['chunks_checksummed'] == doc['chunks']
  loader = cs.host_state(cs.mesh())['loader']
  data = [p for p in (step / 'default').rglob('*') if p.is_file() and p.parent.name == 'd']
  damage.flip_bit_in(data, loader.tobytes()[:64], what='loader bytes')
  code, doc = run_json('verify', step)
  assert code == 1 and cs.kinds(doc) == {'crc_mismatch'} and cs.bad_arrays(doc) == {'loader'}


def test_verify_damaged_index_checks_the_records_beside_it(saved, tmp_path):
  step = cs.copy(saved['host'] / '1', tmp_path / '1')
  index = step / 'default' / records_lib.DIRNAME / records_lib.INDEX_FILENAME
  index.write_bytes(b'\x00garbage')
  meta_io.clear_cache()
  code, doc = run_json('verify', step)
  assert code == 1 and cs.kinds(doc) == {'metadata'}, doc['problems']
  (bad,) = doc['problems']
  assert bad['path'] == str(index) and 'is damaged' in bad['error']
  assert 'writer record(s) beside it are intact: the chunks were checked against them' in (
      bad['error'])
  assert doc['modes'] == {'default': 'checksum'} and doc['chunks_checksummed'] == doc['chunks']
  for f in index.parent.glob('*.msgpack'):  # and without records nothing can be checked
    if f != index:
      f.unlink()
  code, doc = run_json('verify', step)
  assert code == 1 and 'No writer record is beside it' in doc['problems'][0]['error']

