"""``Options.local_save_when_busy`` (``multitier/local_busy.py``): a local-only save due while the
previous one still commits is saved once the previous one's writes on this process are done,
committing after it (``'wait'``, the default: ``save()`` never waits for the previous commit),
or is skipped (``'skip'``).

Real Orbax ``CheckpointManager`` on gs:// (fake-gcs-server behind the project's fault proxy),
real node-local tier. The proxy holds the request that writes local-only step 1's index (in its
commit), so that save is still committing, for certain, when step 2 is due. Under multi-controller JAX the
same decision is one key-value round, the primary host's answer taken by every process:
``tests/tier/test_local_steps.py::test_every_process_skips_the_same_busy_local_steps``.
"""

from __future__ import annotations

import logging
import re
import time
from urllib.parse import unquote

import pytest

from support import local_resume

pytestmark = pytest.mark.gcs

HOLD_WAIT_S = 60.0  # far above one local save here; only a hang reaches it
# v0's item is 'default', v1's 'state'
_INDEX_OF_STEP_1 = re.compile(r'name=ckpt/\.orbax-pathways-local/1/[^/&]+/_pathways/index\.msgpack')


def _index_of_step_1(method: str, target: str) -> bool:
  """The upload of local-only step 1's ``_pathways`` index, written in its commit (tensorstore
  names the object in the URL; the commit marker's upload, one gcsfs multipart request, names
  it in the body only)."""
  return method == 'POST' and _INDEX_OF_STEP_1.search(unquote(target)) is not None


def _wait_held(proxy) -> None:
  deadline = time.monotonic() + HOLD_WAIT_S
  while not proxy.held():
    assert time.monotonic() < deadline, 'local-only step 1 never wrote its index'
    time.sleep(0.05)


@pytest.mark.parametrize('when_busy', ['skip', 'wait'])
def test_a_local_save_due_while_the_previous_one_commits(faulty_gcs, tmp_path, caplog,
                                                         when_busy):
  """Step 2's ``save()`` returns while step 1 still commits, and step 1's save no longer holds
  the loop's arrays (a loop that does not donate its state keeps no old arrays on the devices).
  ``'skip'``: step 2 is never saved (one log line says why), and step 3, due once step 1
  committed, is. ``'wait'``: step 2's save waited only for step 1's writes, not its commit
  (before, ``save()`` returned only once step 1 committed), and commits after it: every step is
  saved. Either way a resume restores the newest local-only step exactly, from the tier."""
  import gc  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  import weakref  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top

  orbax_pathways.install(orbax_pathways.Options(
      tier_dir=str(tmp_path / 'tier'), local_steps_in='storage', local_save_interval_steps=1, tier_keep=3,
      local_save_when_busy=when_busy))
  root = faulty_gcs.path('ckpt')
  base = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  options = ocp.CheckpointManagerOptions(save_interval_steps=100)
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  released = []
  try:
    with ocp.CheckpointManager(root, options=options) as m:
      m.save(0, args=ocp.args.StandardSave({'w': jax.device_put(base)}))
      m.wait_until_finished()
      faulty_gcs.proxy.hold(_index_of_step_1)
      step_1 = jax.device_put(base + 1)
      m.save(1, args=ocp.args.StandardSave({'w': step_1}))
      step_1 = weakref.ref(step_1)
      _wait_held(faulty_gcs.proxy)
      gc.collect()
      assert step_1() is None, 'step 1\'s save, still committing, holds the loop\'s array'
      # Released from another thread only if step 2's save() waited for step 1's commit: it
      # must return long before (if it did not, the release ends the wait and the assert fails).
      timer = threading.Timer(HOLD_WAIT_S,
                              lambda: (released.append(1), faulty_gcs.proxy.release()))
      timer.start()
      m.save(2, args=ocp.args.StandardSave({'w': jax.device_put(base + 2)}))
      timer.cancel()
      assert released == [], 'step 2\'s save() waited for step 1\'s commit'
      assert not (epath.Path(root) / '.orbax-pathways-local' / '1' / 'commit_success.txt').exists()
      faulty_gcs.proxy.release()  # the held request is reset; gcsfs retries it
      m.wait_until_finished()
      m.save(3, args=ocp.args.StandardSave({'w': jax.device_put(base + 3)}))
      m.wait_until_finished()
      assert m.all_steps() == [0]  # Orbax's listing: storage steps only
      local = sorted(int(p.name) for p in (epath.Path(root) / '.orbax-pathways-local').iterdir()
                     if p.name.isdigit())
  finally:
    faulty_gcs.proxy.release()
  skipped = [r.getMessage() for r in caplog.records if 'skipped' in r.getMessage()]
  if when_busy == 'skip':
    assert local == [1, 3], local
    assert len(skipped) == 1 and 'local-only step 2' in skipped[0], skipped
    assert "local_save_when_busy='skip'" in skipped[0], skipped
  else:
    assert local == [1, 2, 3], local
    assert not skipped, skipped
  with ocp.CheckpointManager(root, options=options) as m:
    local_resume.assert_resumes_from_the_tier(m, base, 3)


def test_a_v1_checkpointer_s_busy_local_save_is_skipped_and_its_loop_goes_on(faulty_gcs,
                                                                            tmp_path, caplog):
  """Orbax v1's ``training.Checkpointer``'s local-only saves run in the background as v0's do
  (its arguments detached, the save in v1's ``Context``): with ``'skip'``, step 2's ``save()``
  returns while step 1 still commits (the proxy holds its index), step 2 is never saved,
  step 3 is, and the resume through the v1 Checkpointer restores step 3 exactly from the tier.
  Before, v1's local-only saves ran in the loop's thread, where Orbax's ``save()`` waited for
  step 1's commit."""
  import threading  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top

  orbax_pathways.install(orbax_pathways.Options(
      tier_dir=str(tmp_path / 'tier'), local_steps_in='storage', local_save_interval_steps=1, tier_keep=3,
      local_save_when_busy='skip'))
  root = faulty_gcs.path('ckpt')
  base = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  policy = ocp.v1.training.save_decision_policies.FixedIntervalPolicy(100)
  caplog.set_level(logging.INFO, logger='orbax_pathways')
  released = []
  try:
    with ocp.v1.training.Checkpointer(root, save_decision_policy=policy) as ckptr:
      ckptr.save(0, {'w': jax.device_put(base)})
      ckptr.wait()
      faulty_gcs.proxy.hold(_index_of_step_1)
      ckptr.save(1, {'w': jax.device_put(base + 1)})
      _wait_held(faulty_gcs.proxy)
      timer = threading.Timer(HOLD_WAIT_S, lambda: (released.append(1),
                                                    faulty_gcs.proxy.release()))
      timer.start()
      ckptr.save(2, {'w': jax.device_put(base + 2)})  # returns at once: skipped
      timer.cancel()
      assert not released, 'save(2) waited for step 1 to commit'
      faulty_gcs.proxy.release()
      ckptr.wait()
      ckptr.save(3, {'w': jax.device_put(base + 3)})
      ckptr.wait()
      assert [c.step for c in ckptr.checkpoints] == [0]
      local = sorted(int(p.name) for p in (epath.Path(root) / '.orbax-pathways-local').iterdir()
                     if p.name.isdigit())
  finally:
    faulty_gcs.proxy.release()
  assert local == [1, 3], local
  skipped = [r.getMessage() for r in caplog.records if 'skipped' in r.getMessage()]
  assert len(skipped) == 1 and 'local-only step 2' in skipped[0], skipped
  with ocp.v1.training.Checkpointer(root) as ckptr:
    local_resume.assert_resumes_from_the_tier(ckptr, base, 3)
