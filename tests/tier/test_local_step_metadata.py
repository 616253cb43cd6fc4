"""A manager save's reads of the ``_CHECKPOINT_METADATA`` it writes come from memory
(``_compat/orbax_step_metadata.py``, ``manager/step_metadata.py``), for storage and local-only
steps alike: on gs:// Orbax reads that file back three times a save and checks four times that
the step directory is not a file, about 17 round trips one after another.

Real Orbax ``CheckpointManager`` on gs:// (fake-gcs-server behind the project's fault proxy,
whose request log says which requests a save sent), real node-local tier.
"""

from __future__ import annotations

import json
from urllib.parse import unquote

import pytest

from support import local_resume

pytestmark = pytest.mark.gcs


def _metadata_reads(log, step_dir: str) -> list[str]:
  """The GETs (stat or download) of ``<step_dir>/_CHECKPOINT_METADATA`` in the proxy's log."""
  name = f'{step_dir}/_CHECKPOINT_METADATA'
  return [t for m, t, _ in log if m == 'GET' and unquote(t.split('?')[0]).endswith(name)]


def _directory_checks(log, directory: str) -> int:
  """The GETs of the object named ``directory`` (its name's end) in the proxy's log: how
  gcsfs asks whether a directory exists (or is a file), with a listing beside."""
  return sum(1 for m, t, _ in log
             if m == 'GET' and t.startswith('/storage/') and 'alt=media' not in t
             and unquote(t.split('?')[0]).endswith('/' + directory))


def test_a_managers_saves_read_back_no_step_metadata_and_write_all_of_it(faulty_gcs,
                                                                         tmp_path):
  """Neither storage step 0's save nor local-only step 2's sends a read of its
  ``_CHECKPOINT_METADATA`` (stock Orbax reads it back three times), and each file on storage
  holds everything Orbax wrote into it in three writes: the same fields in both, the item
  handler and the commit time. The step resumes exactly from the tier. Afterwards nothing is served
  from memory: a change made to the file on storage is what Orbax's reader returns."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top

  orbax_pathways.install(orbax_pathways.Options(
      tier_dir=str(tmp_path / 'tier'), local_steps_in='storage', local_save_interval_steps=1, tier_keep=2))
  root = faulty_gcs.path('ckpt')
  base = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  options = ocp.CheckpointManagerOptions(save_interval_steps=100)
  proxy = faulty_gcs.proxy
  with ocp.CheckpointManager(root, options=options) as m:
    proxy.reset_stats()
    m.save(0, args=ocp.args.StandardSave({'w': jax.device_put(base)}))
    m.wait_until_finished()
    storage_log = proxy.log()
    m.save(1, args=ocp.args.StandardSave({'w': jax.device_put(base + 1)}))
    m.wait_until_finished()
    proxy.reset_stats()
    m.save(2, args=ocp.args.StandardSave({'w': jax.device_put(base + 2)}))
    m.wait_until_finished()
    local_log = proxy.log()
  assert _metadata_reads(storage_log, 'ckpt/0') == []
  assert _metadata_reads(local_log, 'ckpt/.orbax-pathways-local/2') == []
  # No save asks whether the item directory it makes inside its new step exists (stock: one
  # existence check each), and where this Orbax has ``skip_sync_file_validations`` (0.12.8,
  # not 0.12.4) a local-only save asks about its step directory once before making it (the
  # hidden manager sets it), where a storage save, with Orbax's options as the user set
  # them, asks twice.
  import dataclasses  # pylint: disable=g-import-not-at-top
  assert _directory_checks(storage_log, 'ckpt/0/default') == 0
  assert _directory_checks(local_log, 'ckpt/.orbax-pathways-local/2/default') == 0
  step_checks = (_directory_checks(storage_log, 'ckpt/0'),
                 _directory_checks(local_log, 'ckpt/.orbax-pathways-local/2'))
  if 'skip_sync_file_validations' in {f.name for f in dataclasses.fields(ocp.options.FileOptions)}:
    assert 0 < step_checks[1] < step_checks[0], step_checks
  else:
    assert 0 < step_checks[1] == step_checks[0], step_checks
  from orbax_pathways._compat import orbax_step_metadata  # pylint: disable=g-import-not-at-top
  assert orbax_step_metadata.registered() == []  # every save's registration ended

  def read(name):
    from etils import epath  # pylint: disable=g-import-not-at-top
    return json.loads((epath.Path(root) / name / '_CHECKPOINT_METADATA').read_text())

  stored, local = read('0'), read('.orbax-pathways-local/2')
  assert set(local) == set(stored), (sorted(local), sorted(stored))
  assert local['item_handlers'] == stored['item_handlers']
  for written in (stored, local):
    assert isinstance(written['commit_timestamp_nsecs'], int), written
    assert written['commit_timestamp_nsecs'] >= written['init_timestamp_nsecs'] > 0, written

  with ocp.CheckpointManager(root, options=options) as m:
    local_resume.assert_resumes_from_the_tier(m, base, 2)

  from etils import epath  # pylint: disable=g-import-not-at-top
  changed = dict(local, custom_metadata={'changed': 'on storage'})
  (epath.Path(root) / '.orbax-pathways-local/2/_CHECKPOINT_METADATA').write_text(
      json.dumps(changed))
  hidden = ocp.CheckpointManager(f'{root}/.orbax-pathways-local',
                                 options=ocp.CheckpointManagerOptions(read_only=True))
  assert hidden.metadata(2).custom_metadata == {'changed': 'on storage'}


_SMALL_FILES = ('_CHECKPOINT_METADATA', 'commit_success.txt', 'default/_METADATA',
                'default/array_metadatas/process_0')


def _uploads(log) -> dict[str, int]:
  """Counts of gcsfs's requests by kind in the proxy's log: multipart uploads, resumable upload
  starts, deletes, downloads of the save's own small files, existence checks of step 1's item
  directory."""
  out = {'multipart': 0, 'resumable_start': 0, 'delete': 0, 'own_file_downloads': 0,
         'item_directory_checks': _directory_checks(log, '1/default')}
  for method, target, _ in log:
    if method == 'GET' and target.startswith('/download/') and (
        'array_metadatas/process_0' in unquote(target)
        or '_CHECKPOINT_METADATA' in unquote(target)):
      out['own_file_downloads'] += 1
    elif method == 'POST' and 'uploadType=multipart' in target:
      out['multipart'] += 1
    elif method == 'POST' and 'uploadType=resumable' in target and 'upload_id' not in target:
      out['resumable_start'] += 1
    elif method == 'DELETE':
      out['delete'] += 1
  return out


def test_a_saves_small_files_are_one_request_each_and_equal_stock_orbaxs(faulty_gcs):
  """A storage step's small files (``_CHECKPOINT_METADATA``, the item's ``_METADATA`` and
  ``array_metadatas``, ``commit_success.txt``) are written in one multipart upload each, as many
  as stock Orbax's resumable uploads of the same save, with none of its deletes before them;
  the save downloads none of the files it wrote, where stock reads its step metadata and
  array metadata back, and never asks whether the item directory it makes in the new step
  exists (``_compat/orbax_small_writes.py``); every file holds what stock's does
  (timestamps aside), and stock Orbax restores the step exactly."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top

  base = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  proxy = faulty_gcs.proxy
  logs, roots = {}, {}
  for impl in ('stock', 'ours'):
    if impl == 'stock':
      orbax_pathways.uninstall()
    else:
      orbax_pathways.install(orbax_pathways.Options(tier_dir='off'))
    roots[impl] = faulty_gcs.path(impl)
    with ocp.CheckpointManager(roots[impl]) as m:
      m.save(0, args=ocp.args.StandardSave({'w': jax.device_put(base)}))
      m.wait_until_finished()
      proxy.reset_stats()
      m.save(1, args=ocp.args.StandardSave({'w': jax.device_put(base + 1)}))
      m.wait_until_finished()
      logs[impl] = _uploads(proxy.log())
  assert logs['stock']['resumable_start'] >= len(_SMALL_FILES), logs
  assert logs['stock']['own_file_downloads'] >= 2, logs  # its step metadata, array metadata
  assert logs['stock']['item_directory_checks'] >= 1, logs
  assert logs['ours'] == {'multipart': logs['stock']['resumable_start'], 'resumable_start': 0,
                          'delete': 0, 'own_file_downloads': 0,
                          'item_directory_checks': 0}, logs

  def files(impl):
    out = {}
    for name in _SMALL_FILES:
      text = (epath.Path(roots[impl]) / '1' / name).read_text()
      out[name] = text.replace(roots[impl], '<root>')
    meta = json.loads(out['_CHECKPOINT_METADATA'])
    for k in ('init_timestamp_nsecs', 'commit_timestamp_nsecs'):
      assert isinstance(meta.pop(k), int), (impl, k)
    meta.pop('performance_metrics', None)
    out['_CHECKPOINT_METADATA'] = meta
    return out

  assert files('ours') == files('stock')
  orbax_pathways.uninstall()
  with ocp.CheckpointManager(roots['ours']) as m:
    np.testing.assert_array_equal(np.asarray(m.restore(1)['w']), base + 1)
