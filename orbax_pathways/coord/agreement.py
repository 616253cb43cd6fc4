"""How the processes of a manager agree (``preemption.install``'s arguments): on a preemption
step every ``interval`` steps, and, in every agreement round (the preemption step, a resumed
step, the node steps every node holds), how long a silence is allowed (``timeout_s``).

Who calls what, on which host: ``configure`` at ``preemption.install`` (every process that
imports the package); ``current`` by ``preemption/decision.py`` and ``multitier/resume.py``
(every process of a resume). No jax here.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Agreement:
  """Every ``interval`` steps, one round on the preemption step; ``timeout_s`` of silence
  allowed in any agreement round."""

  interval: int = 10
  timeout_s: float = 300.0

  def __post_init__(self):
    if self.interval < 1:
      raise ValueError(f'agreement_interval must be >= 1, got {self.interval}.')


class _State:
  """The agreement the registered preemption hooks use, for the calls no hook makes (the
  notice's log line, ``preemption.resume``): one object, no ``global`` statement."""

  current = Agreement()


_state = _State()


def configure(agreement: Agreement) -> None:
  """``preemption.install``: the agreement of the hooks it registers."""
  _state.current = agreement


def current() -> Agreement:
  return _state.current
