"""The hidden manager's retention runs after a local-only step's commit, not inside it
(``multitier/trailing_deleter.py``): the next local-only save does not wait for
the previous step's deletion, while the user's ``wait_until_finished()``, a resume's listing
and ``close()`` still see the retention done.

Real Orbax ``CheckpointManager`` on gs:// (fake-gcs-server behind the project's fault proxy),
real node-local tier. The proxy holds the first request that deletes local-only step 1 (its
commit marker: the package deletes the markers first), so that deletion is still running, for
certain, while steps 2 and 3 are saved.
"""

from __future__ import annotations

import logging
import time
from urllib.parse import unquote

import pytest

from support import local_resume

pytestmark = pytest.mark.gcs

WAIT_S = 60.0  # far above one local save here; only a hang reaches it


def _deletes_step_1(method: str, target: str) -> bool:
  return method == 'DELETE' and '.orbax-pathways-local/1/' in unquote(target)


def _committed_local_steps(bucket) -> list[int]:
  """Local-only steps with a commit marker, read from the server directly (no client cache)."""
  found = set()
  for name in bucket.objects():
    parts = name.split('/')
    if (len(parts) == 4 and parts[1] == '.orbax-pathways-local' and parts[2].isdigit()
        and parts[3] == 'commit_success.txt'):
      found.add(int(parts[2]))
  return sorted(found)


def _wait_for(what: str, check) -> None:
  deadline = time.monotonic() + WAIT_S
  while not check():
    assert time.monotonic() < deadline, f'timed out waiting for {what}'
    time.sleep(0.05)


def test_local_saves_commit_while_the_previous_step_is_still_being_deleted(faulty_gcs,
                                                                           tmp_path, caplog):
  """``tier_keep=1``: step 2's commit hands step 1 to retention, whose deletion the proxy
  holds. Steps 2 and 3 still commit (their markers are on the server, step 1's too), and only
  the user's ``wait_until_finished()`` waits for the deletions: then the tier's steps on
  storage are [3] and the resume restores step 3 exactly, from the tier. Before, the deletion
  ran inside step 2's commit, and steps 2 and 3 waited for it."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top

  orbax_pathways.install(orbax_pathways.Options(
      tier_dir=str(tmp_path / 'tier'), local_steps_in='storage', local_save_interval_steps=1, tier_keep=1))
  root = faulty_gcs.path('ckpt')
  base = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  options = ocp.CheckpointManagerOptions(save_interval_steps=100)
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  try:
    with ocp.CheckpointManager(root, options=options) as m:
      m.save(0, args=ocp.args.StandardSave({'w': jax.device_put(base)}))
      m.wait_until_finished()
      m.save(1, args=ocp.args.StandardSave({'w': jax.device_put(base + 1)}))
      m.wait_until_finished()
      assert _committed_local_steps(faulty_gcs) == [1]
      faulty_gcs.proxy.hold(_deletes_step_1)
      m.save(2, args=ocp.args.StandardSave({'w': jax.device_put(base + 2)}))
      _wait_for('the deletion of step 1 to start', faulty_gcs.proxy.held)
      m.save(3, args=ocp.args.StandardSave({'w': jax.device_put(base + 3)}))
      _wait_for('local-only step 3 to commit',
                lambda: 3 in _committed_local_steps(faulty_gcs))
      assert _committed_local_steps(faulty_gcs) == [1, 2, 3]  # step 1's deletion still held
      faulty_gcs.proxy.release()  # the held request is reset; gcsfs retries it
      m.wait_until_finished()
      assert _committed_local_steps(faulty_gcs) == [3]
      assert not any(n.split('/')[2] in ('1', '2') for n in faulty_gcs.objects()
                     if n.startswith('ckpt/.orbax-pathways-local/'))
      assert m.all_steps() == [0]  # Orbax's listing: storage steps only
  finally:
    faulty_gcs.proxy.release()
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING
              and 'local-only' in r.getMessage()], caplog.text
  with ocp.CheckpointManager(root, options=options) as m:
    local_resume.assert_resumes_from_the_tier(m, base, 3)


def test_a_failed_retention_deletion_is_logged_and_the_saves_go_on(faulty_gcs, tmp_path,
                                                                   caplog):
  """Every request that deletes local-only step 1 fails (the proxy answers 503, gcsfs retries
  and gives up) on the retention thread: one error names the step, the saves after it commit
  (step 2 is deleted after step 3's commit), step 1 stays with its commit marker, and the
  resume restores the newest local-only step, 3, exactly, from the tier."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top

  orbax_pathways.install(orbax_pathways.Options(
      tier_dir=str(tmp_path / 'tier'), local_steps_in='storage', local_save_interval_steps=1, tier_keep=1))
  root = faulty_gcs.path('ckpt')
  base = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  options = ocp.CheckpointManagerOptions(save_interval_steps=100)
  caplog.set_level(logging.INFO)
  with ocp.CheckpointManager(root, options=options) as m:
    for step in (0, 1):
      m.save(step, args=ocp.args.StandardSave({'w': jax.device_put(base + step)}))
      m.wait_until_finished()
    faulty_gcs.proxy.match = lambda method, target: _deletes_step_1(method, target)
    faulty_gcs.proxy.set_rate(1.0, ('503',))
    for step in (2, 3):
      m.save(step, args=ocp.args.StandardSave({'w': jax.device_put(base + step)}))
      m.wait_until_finished()
    faulty_gcs.proxy.set_rate(0.0)
    assert _committed_local_steps(faulty_gcs) == [1, 3]
  failed = [r.getMessage() for r in caplog.records
            if 'garbage collection of old step 1 ' in r.getMessage()]
  assert len(failed) == 1 and '.orbax-pathways-local/1' in failed[0], caplog.text
  with ocp.CheckpointManager(root, options=options) as m:
    local_resume.assert_resumes_from_the_tier(m, base, 3)
