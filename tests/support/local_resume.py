"""The check the local-only-step tests on gs:// share: ``preemption.resume`` through a manager
(a v0 ``CheckpointManager`` or an Orbax v1 ``training.Checkpointer``) of a one-leaf state
``{'w': base + step}`` restores the expected local-only step exactly, with no storage byte read
(every byte from the node-local tier)."""

from __future__ import annotations


def assert_resumes_from_the_tier(manager, base, expected_step: int) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from orbax_pathways import preemption, stats  # pylint: disable=g-import-not-at-top
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {'w': jax.ShapeDtypeStruct(base.shape, base.dtype, sharding=one)}
  step, got = preemption.resume(manager, lambda: None, abstract_state=target)
  assert step == expected_step, (step, expected_step)
  np.testing.assert_array_equal(np.asarray(got['w']), base + expected_step)
  assert stats.last_restore().bytes_by_source.get('storage', 0) == 0, stats.last_restore()
