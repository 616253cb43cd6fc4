"""Worker for tests/storage/test_gcs_request_kinds.py: every kind of storage request a save or restore
makes on gs://, held unanswered in turn.

Two fresh interpreters, started by the test with ``procs.run_worker``; both need 8 CPU devices
and ``ORBAX_PATHWAYS_TIER_DIR`` set by the test (the node-local tier both share):

- ``save SERVER_URL``: saves the suite's ``random_state`` once per restore case, each into a
  bucket of its own on fake-gcs-server (``case_bucket``), straight to the server: v0
  ``CheckpointManager`` or ``ocp.v1.save_pytree``, with the tier on or off as the case says;
  ``no_index`` cases then lose their ``_pathways/index.msgpack`` (a step saved before the index
  existed: the writer records are read).
- ``run SERVER_URL``: this process's own ``FaultProxy`` in front of the server, every client
  pointed at it before anything touches storage. Each restore case in turn, in ``CASES`` order:
  the proxy holds the first request the case names (reads it, never answers), the restore runs
  with a bound of ``LIMIT_S`` (``support.procs.run_limited``), the hold is released. Then each
  save case the same way, into a fresh bucket, followed by a restore without any hold. Every
  case is the first of its kind for its bucket: its own bucket, step directory and objects, so
  no client cache (gcsfs's listings and object info, Orbax's bucket lookup, our index cache,
  tensorstore's manifest cache) answers it. The first case (the third object GET) is also the
  first of its kind in the process.

Prints one JSON line per case: ``name``, ``held`` (the requests the proxy held), ``elapsed``,
``hung`` (still running at ``LIMIT_S``), ``error`` (text, or None), ``ok`` (values equal), and
``held_kind`` (the held request as ``describe`` names it) and, per restore case, every request
the proxy saw (``requests``, for the enumeration).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from urllib.parse import unquote

LIMIT_S = 60.0  # past this a case counts as hung; the test's bound is tighter


@dataclasses.dataclass(frozen=True)
class Case:
  """One request kind: what the proxy holds (``method`` and a regex over the unquoted target,
  ``{b}`` standing for the case's bucket), in which phase, through which API."""
  name: str
  phase: str  # 'restore' (of a step saved by another process) or 'save'
  method: str
  target: str
  client: str  # who issues it: gcsfs (etils.epath), google-cloud-storage, tensorstore
  what: str
  api: str = 'v0'  # 'v0': CheckpointManager; 'v1': ocp.v1.save_pytree / load_pytree
  tier: bool = True  # saved with the node-local tier on (its chunks then come from the tier)
  target_tree: bool = True  # restore with a target (False: Orbax reads the _sharding file)
  no_index: bool = False  # the step's index removed: the writer records are read
  nth: int = 1  # hold the nth request that matches (1: the first)


_O = r'^/storage/v1/b/{b}/o'  # object resource (gcsfs stat, tensorstore ?alt=media)
_D = r'^/download/storage/v1/b/{b}/o'  # gcsfs media download
_U = r'^/upload/storage/v1/b/{b}/o\?'  # uploads (tensorstore uploadType=media, gcsfs resumable)
_STEP = 'ckpt/1'
_ITEM = 'ckpt/1/default'

CASES: tuple[Case, ...] = (
    # -- restore in a fresh process (the step was saved by another one) --------------------------
    Case('third_object_get', 'restore', 'GET', r'^(/download)?/storage/v1/b/{b}/o/[^?]', 'any',
         "the restore's third object GET", nth=3),
    Case('bucket_lookup', 'restore', 'GET', r'^/storage/v1/b/{b}\?', 'google-cloud-storage',
         "Orbax's bucket lookup before it lists steps (hierarchical namespace check)"),
    # gcsfs 2026.10 pages by 1000, some older releases by 5000
    Case('step_listing', 'restore', 'GET', _O + r'\?(?=.*[?&]prefix=ckpt/(&|$))(?=.*maxResults=\d+)',
         'gcsfs', "Orbax's listing of the steps"),
    Case('commit_success_stat', 'restore', 'GET', _O + rf'/{_STEP}/commit_success\.txt$', 'gcsfs',
         "Orbax's check that the step committed (commit_success.txt)"),
    Case('checkpoint_metadata_read', 'restore', 'GET', _D + rf'/{_STEP}/_CHECKPOINT_METADATA\?',
         'gcsfs', '_CHECKPOINT_METADATA'),
    Case('item_metadata_read', 'restore', 'GET', _D + rf'/{_ITEM}/_METADATA\?', 'gcsfs',
         "the item's _METADATA (the tree)"),
    Case('array_metadatas_read', 'restore', 'GET', _D + rf'/{_ITEM}/array_metadatas/process_0\?',
         'gcsfs', 'array_metadatas/process_0'),
    Case('index_read', 'restore', 'GET', _O + rf'/{_ITEM}/_pathways/index\.msgpack\?.*alt=media',
         'tensorstore', 'our _pathways/index.msgpack'),
    Case('record_read', 'restore', 'GET', _O + rf'/{_ITEM}/_pathways/p0\.msgpack\?.*alt=media',
         'tensorstore', 'our writer record (a step without an index)', no_index=True),
    Case('records_listing', 'restore', 'GET', _O + rf'\?(?=.*startOffset={_ITEM}/_pathways/)',
         'tensorstore', 'our listing of _pathways/ (a step without an index)', no_index=True),
    Case('ocdbt_manifest_read', 'restore', 'GET', _O + rf'/{_ITEM}/manifest\.ocdbt\?.*alt=media',
         'tensorstore', "the item's OCDBT manifest"),
    Case('btree_node_read', 'restore', 'GET', _O + rf'/{_ITEM}/d/[0-9a-f]+\?.*alt=media',
         'tensorstore', 'an OCDBT B-tree node (with the zarr .zarray values)'),
    Case('chunk_data_read', 'restore', 'GET',
         _O + rf'/{_ITEM}/ocdbt\.process_0/d/[0-9a-f]+\?.*alt=media', 'tensorstore',
         'array chunk data (tier off)', tier=False),
    Case('sharding_file_read', 'restore', 'GET', _O + rf'/{_ITEM}/_sharding\?.*alt=media',
         'tensorstore', "Orbax's _sharding file (a restore without a target)", target_tree=False),
    Case('v1_checkpoint_metadata_read', 'restore', 'GET', _D + rf'/{_STEP}/_CHECKPOINT_METADATA\?',
         'gcsfs', 'ocp.v1.load_pytree: _CHECKPOINT_METADATA', api='v1'),
    Case('v1_item_metadata_read', 'restore', 'GET', _D + rf'/{_STEP}/state/_METADATA\?', 'gcsfs',
         "ocp.v1.load_pytree: the item's _METADATA", api='v1'),
    # -- save (the array data upload is tests/storage/test_gcs_deadlines.py's) ---------------------------
    Case('save_step_stat', 'save', 'GET', _O + rf'/{_STEP}$', 'gcsfs',
         "Orbax's existence check of the step directory"),
    Case('save_listing', 'save', 'GET', _O + rf'\?(?=.*[?&]prefix={_STEP}/)', 'gcsfs',
         'a one-entry listing (is_dir) inside the step'),
    # A CheckpointManager save writes a step's small files in one multipart upload each
    # (_compat/orbax_small_writes.py): the first (_CHECKPOINT_METADATA, in save()) and the
    # seventh (the step's commit_success.txt, in the finalize thread). ocp.v1.save_pytree is no
    # manager save: its small files are Orbax's delete and resumable upload.
    Case('save_small_file_upload', 'save', 'POST', _U + r'(?=.*uploadType=multipart)', 'gcsfs',
         "a small file's one-request upload: the first, _CHECKPOINT_METADATA's"),
    Case('save_commit_file_upload', 'save', 'POST', _U + r'(?=.*uploadType=multipart)', 'gcsfs',
         "a small file's one-request upload: the step's commit_success.txt", nth=7),
    Case('v1_save_upload_start', 'save', 'POST',
         # gcsfs 2026.10 names the object in the start's query, some older releases only in its
         # JSON body
         # (the save's first resumable start is _CHECKPOINT_METADATA's either way)
         _U + rf'(?=.*uploadType=resumable)(?!.*upload_id)(?!.*name=(?!{_STEP}/_CHECKPOINT_METADATA(&|$)))',
         'gcsfs', 'ocp.v1.save_pytree: the start of the _CHECKPOINT_METADATA upload', api='v1'),
    Case('v1_save_upload_data', 'save', 'POST',
         _U + rf'(?=.*name={_STEP}/state/_METADATA(&|$))(?=.*upload_id=)',
         'gcsfs', "ocp.v1.save_pytree: the bytes of the item's _METADATA", api='v1'),
    Case('v1_save_delete', 'save', 'DELETE', _O + '/', 'gcsfs',
         'ocp.v1.save_pytree: a delete before an overwrite', api='v1'),
    # No read of _CHECKPOINT_METADATA: a CheckpointManager save reads the one it wrote from
    # memory (manager/step_metadata.py), and ocp.v1.save_pytree reads none back.
    Case('save_sharding_write', 'save', 'POST', _U + rf'.*name={_ITEM}/_sharding(&|$)', 'tensorstore',
         "Orbax's _sharding file"),
    Case('save_merged_manifest_write', 'save', 'POST', _U + rf'.*name={_ITEM}/manifest\.ocdbt(&|$)',
         'tensorstore', "Orbax's OCDBT merge: the item's manifest"),
    Case('save_index_write', 'save', 'POST', _U + rf'.*name={_ITEM}/_pathways/index\.msgpack(&|$)',
         'tensorstore', 'our index'),
    Case('save_lease_write', 'save', 'POST', _U + r'.*name=ckpt/orbax-pathways-lease\.json(&|$)',
         'tensorstore', 'the writer lease'),
)

BY_NAME = {c.name: c for c in CASES}


def case_bucket(case: Case, run_id: str) -> str:
  """The case's own bucket (3-63 characters: lowercase, digits, dashes)."""
  return f'rk-{run_id}-{case.name.replace("_", "-")}'[:63].rstrip('-')


def matcher(case: Case, bucket: str):
  """``match(method, target)`` for the proxy: true from the case's ``nth`` matching request on."""
  rx = re.compile(case.target.format(b=re.escape(bucket)))
  seen = [0]

  def match(method: str, target: str) -> bool:
    if method != case.method or not rx.search(unquote(target)):
      return False
    seen[0] += 1
    return seen[0] >= case.nth
  return match


def describe(method: str, target: str, agent: str) -> dict:
  """One request as the enumeration lists it: ``method``, ``client`` (the User-Agent's
  product: python-gcsfs, gcloud-python, tensorstore), ``op`` (bucket, stat, list, read, upload,
  delete) and ``object`` (name, or the listing's prefix)."""
  t = unquote(target)
  client = agent.split('/')[0] or '?'
  path, _, query = t.partition('?')
  q = dict(kv.partition('=')[::2] for kv in query.split('&') if kv)
  m = re.match(r'^(/download|/upload)?/storage/v1/b/[^/]+(/o(/.*)?)?$', path)
  if m is None:
    op, obj = 'other', t
  elif m.group(2) is None:
    op, obj = 'bucket', ''
  elif m.group(3):
    obj = m.group(3)[1:]
    op = ('delete' if method == 'DELETE' else
          'read' if m.group(1) == '/download' or q.get('alt') == 'media' else 'stat')
  elif method == 'POST':
    op, obj = 'upload', q.get('name', '')
  else:  # gcsfs lists by prefix, tensorstore by key range
    op, obj = 'list', q.get('prefix', q.get('startOffset', ''))
  return {'method': method, 'client': client, 'op': op, 'object': obj}


# ---- the child's side ------------------------------------------------------------------------


def _state():
  from support.arrays import mesh, random_state  # pylint: disable=g-import-not-at-top
  return random_state(mesh())


def _save(case: Case, path: str, state) -> None:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  if case.api == 'v1':
    ocp.v1.save_pytree(f'{path}/1', state)
    return
  with ocp.CheckpointManager(path) as mngr:
    mngr.save(1, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()


def _restore_equal(case: Case, path: str, state) -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from support.arrays import abstract, assert_bit_identical  # pylint: disable=g-import-not-at-top
  if case.api == 'v1':
    got = ocp.v1.load_pytree(f'{path}/1', abstract(state))
  else:
    with ocp.CheckpointManager(path) as mngr:
      if case.target_tree:
        got = mngr.restore(1, args=ocp.args.StandardRestore(abstract(state)))
      else:
        got = mngr.restore(1)
  if case.target_tree:
    assert_bit_identical(got, state)
  else:
    assert jax.tree.structure(got) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  return True


def _options(case: Case):
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  options = orbax_pathways.Options.from_env()  # the deadline floor the test set
  return options if case.tier else dataclasses.replace(options, tier_dir='off')


def _point_clients_at(url: str) -> None:
  from support import gcs_server  # pylint: disable=g-import-not-at-top
  for k in gcs_server.FakeGcs.unset_keys():
    os.environ.pop(k, None)
  os.environ.update(gcs_server.hermetic_env(url, tempfile.mkdtemp(prefix='gcloud-')))
  gcs_server.configure_fsspec_anon()


def save_phase(server_url: str, run_id: str) -> None:
  _point_clients_at(server_url)
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  state = _state()
  for case in CASES:
    if case.phase != 'restore':
      continue
    path = f'gs://{case_bucket(case, run_id)}/ckpt'
    orbax_pathways.install(_options(case))
    _save(case, path, state)
    if case.no_index:
      epath.Path(f'{path}/1/default/_pathways/index.msgpack').unlink()
  print(json.dumps({'saved': True}))


def _fast_gcsfs_backoff() -> None:
  """gcsfs's sleeps between its attempts shortened as ``support.gcs_fixtures`` does in the
  pytest process (the same retries, the same number of them)."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import gcsfs.retry  # pylint: disable=g-import-not-at-top
  from support.gcs_fixtures import _ScaledSleep  # pylint: disable=g-import-not-at-top
  if getattr(gcsfs.retry, 'asyncio', None) is asyncio:
    gcsfs.retry.asyncio = _ScaledSleep(asyncio)


def run_phase(server_url: str, run_id: str, names: list[str]) -> None:
  from support.fault_proxy import FaultProxy  # pylint: disable=g-import-not-at-top
  proxy = FaultProxy(server_url).start()
  _point_clients_at(proxy.url)
  _fast_gcsfs_backoff()
  import orbax_pathways  # pylint: disable=g-import-not-at-top
  from support.procs import run_limited  # pylint: disable=g-import-not-at-top
  state = _state()
  cases = [BY_NAME[n] for n in names] if names else list(CASES)
  for case in cases:
    bucket = case_bucket(case, run_id)
    path = f'gs://{bucket}/ckpt'
    orbax_pathways.install(_options(case))
    first = len(proxy.log())
    held_before = len(proxy.held())
    proxy.hold(matcher(case, bucket))
    if case.phase == 'restore':
      fn = lambda: _restore_equal(case, path, state)  # pylint: disable=cell-var-from-loop
    else:
      fn = lambda: (_save(case, path, state), 'saved')[1]  # pylint: disable=cell-var-from-loop
    th, res = run_limited(fn, LIMIT_S)
    held = proxy.held()[held_before:]
    proxy.release()
    out = {'name': case.name, 'held': [list(h) for h in held], 'hung': th.is_alive(),
           'elapsed': res.get('elapsed', LIMIT_S), 'ok': res.get('value') is True}
    if th.is_alive():
      th.join(240)  # released: it fails or finishes now
    err = res.get('error')
    out['error'] = None if err is None else f'{type(err).__name__}: {err}'[:2000]
    seen = proxy.log()[first:]
    out['held_kind'] = [describe(*r) for r in seen if [r[0], r[1]] in out['held']][:1]
    if case.phase == 'restore':
      out['requests'] = [describe(*r) for r in seen]
    elif out['error'] is None and not out['hung']:
      try:  # the step the held save committed reads back
        out['ok'] = _restore_equal(case, path, state)
      except Exception as e:  # pylint: disable=broad-except
        out['error'] = f'restore after the save: {type(e).__name__}: {e}'[:2000]
    print(json.dumps(out), flush=True)
  proxy.stop()


def main(argv: list[str]) -> None:
  mode, server_url, run_id, *names = argv
  t0 = time.monotonic()
  if mode == 'save':
    save_phase(server_url, run_id)
  else:
    run_phase(server_url, run_id, names)
  print(json.dumps({'phase_s': time.monotonic() - t0}), file=sys.stderr)


if __name__ == '__main__':
  main(sys.argv[1:])
