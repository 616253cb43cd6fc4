"""Whether a CheckpointManager's save decision policy can save for preemption (the SIGTERM
notice needs one that does: ``preemption/notice.py``). Orbax's policy classes live in ``_src``:
reached through ``src.orbax``; an Orbax whose policies we do not know keeps the notice.
"""

from __future__ import annotations

from typing import Any

from orbax_pathways._compat import src


def _blind_policy_types() -> tuple[type, ...]:
  """Orbax's policies that never read ``context.reached_preemption`` (exact types: a subclass may
  override ``should_save`` and read it)."""
  from orbax.checkpoint import checkpoint_manager as _cm  # pylint: disable=g-import-not-at-top
  _sdp = src.orbax('checkpoint_managers.save_decision_policy')
  names = ('FixedIntervalPolicy', 'SpecificStepsPolicy', 'InitialSavePolicy',
           'ContinuousCheckpointingPolicy')
  found = [getattr(_sdp, n) for n in names if hasattr(_sdp, n)]
  should_save_fn = getattr(_cm, '_ShouldSaveFnPolicy', None)  # options.should_save_fn
  return tuple(found + ([should_save_fn] if should_save_fn is not None else []))


def _saves_on_preemption(policy: Any, blind: tuple[type, ...]) -> bool:
  _sdp = src.orbax('checkpoint_managers.save_decision_policy')
  if isinstance(policy, _sdp.PreemptionCheckpointingPolicy):
    return True
  if type(policy) is _sdp.AnySavePolicy:  # pylint: disable=unidiomatic-typecheck
    return any(_saves_on_preemption(p, blind) for p in policy.policies)
  return type(policy) not in blind  # a policy we do not know may read reached_preemption


def manager_saves_on_preemption(mngr: Any) -> bool:
  """Whether ``mngr.should_save`` can answer True because ``reached_preemption`` did: its save
  decision policy holds ``PreemptionCheckpointingPolicy`` (the default, also inside
  ``AnySavePolicy``) or a policy Orbax does not define. False for ``FixedIntervalPolicy`` and the
  other interval policies alone (v1 ``training.Checkpointer(save_decision_policy=...)``)."""
  policy = getattr(mngr, '_save_decision_policy', None)  # pylint: disable=protected-access
  if policy is None:
    return True
  try:
    return _saves_on_preemption(policy, _blind_policy_types())
  except Exception:  # pylint: disable=broad-except
    return True  # an Orbax we do not know: keep the notice (the grace period still ends it)


def manager_policy_name(mngr: Any) -> str:
  """The manager's save decision policy as its repr says it (for log lines)."""
  policy = getattr(mngr, '_save_decision_policy', None)  # pylint: disable=protected-access
  return repr(policy)[:300]
