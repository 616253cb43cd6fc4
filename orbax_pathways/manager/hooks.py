"""What the package does around Orbax's ``CheckpointManager``: one typed protocol, the way
``transports/base.Transport`` is for the bytes.

``_compat/orbax_manager.py`` patches Orbax's manager and, at each of the points below, calls the
registered hook objects in ``ORDER`` (``register`` / ``unregister`` there). It holds no policy of
its own: with no hook registered, every patched method is stock Orbax. A concern subclasses
``ManagerHooks``, overrides the calls it needs (the others are no-ops), and is given its
configuration when built; nothing here reads process-wide settings.

The calls, in the order Orbax makes them for one manager. "Every process" means every process
that calls the manager (multi-controller JAX); under Pathways that is the one controller.

1. ``manager_init(mngr)``: every process, after Orbax's ``__init__`` returned (its listing is
   done). Each hook in ``ORDER``.
2. ``reached_preemption(mngr, step, stock, participants)``: every process, from
   ``should_save`` and ``save`` (Orbax asks it once or twice per step). The first hook that
   answers ``True`` / ``False`` decides; ``None`` passes to the next; if none answers, Orbax's
   own ``stock()``.
3. ``before_save(mngr, step)``: every process, in the training loop's thread, before Orbax
   writes anything of a step its policy takes (``force`` or ``should_save``; a declined step
   writes nothing and skips this call). Raising refuses the save: nothing is written, the step
   is not listed. Each hook in ``ORDER``. Then ``save_args(mngr, step, args, kwargs)`` with the
   save's arguments (the preemption save's local-only copy first: ``multitier/local_steps.py``).
4. ``save_error(mngr, step, error)``: when Orbax's ``save`` raised. The first hook that returns
   an exception has it raised in place of ``error`` (``None``: next; none: ``error`` itself).
5. ``after_save(mngr, step, saved)``: every process, once Orbax's ``save`` returned ``saved``
   (the device-to-host copy is done; the commit runs on). Then, when ``saved`` is ``False``
   (Orbax's policy declined the step), ``save_declined(mngr, step, args, kwargs)`` with the
   save's arguments: each hook in ``ORDER`` (the local-only steps: ``multitier/local_steps.py``).
6. ``commit_error(mngr, step, error)``: in Orbax's finalize thread (or inline for a synchronous
   save), when the step's commit failed; like ``save_error``.
7. ``after_commit(mngr, step, commit_s)``: every process, in Orbax's finalize thread, once
   ``step`` is committed, ``commit_s`` after its ``save()`` began. Each hook in ``ORDER``.
8. ``step_complete(step_path)``: every listing (``all_steps``, ``latest_step``, ``reload``, a
   restore's step lookup), on every process that lists, per step directory Orbax would list.
   ``False`` hides the step; the first hook that answers decides; none: listed (stock).
9. ``delete_step(step, path, remove)``: Orbax's deleter, for each step it destroys
   (``max_to_keep``, ``mngr.delete``), on the process that deletes (the primary host). ``True``:
   the hook deleted it (through ``remove(path)``, the stock removal); the first that does ends
   the call; none: Orbax's own deletion.
10. ``delete_started(mngr, step)`` / ``delete_ended(mngr, step)``: around the user's explicit
    ``mngr.delete(step)`` (``delete_ended`` even if it raised), on the process that calls it.
11. ``close(mngr)``: every process, once Orbax's ``close`` returned or raised. Each hook in
    ``ORDER``. ``wait(mngr)``: every process, once Orbax's ``wait_until_finished`` returned
    (saves a hook runs beside Orbax's finish too). Each hook in ``ORDER``.

Who registers what: ``orbax_pathways._install.install()`` (at ``import orbax_pathways``)
registers every concern below; ``manager.retention.install()``, ``manager.lease.install()`` and
``preemption.install()`` register their own, so each can be switched alone.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

# The order of the hooks at every call above: a concern later in the tuple sees what earlier ones
# did (the slices check refuses a manager before retention cleans its directory; the writer lease
# refuses a save before anything else about it runs; the tier's commit and the commit log run
# last). The step metadata memory is first so that its save_error / commit_error, which only
# pass, always run; it begins in save_args, once every before_save let the save go ahead.
ORDER = (
    'step_metadata',  # manager/step_metadata.py: a save's own step metadata read from memory
    'checks',       # _install: num_slices against the devices, our handler still registered
    'lease',        # manager/lease.py: one saving job per directory
    'retention',    # manager/retention.py: never a torn step listed or left behind
    'step_errors',  # manager/step_errors.py: errors that name the step and the path
    'preemption',   # preemption/: the notice, the agreement, the save on it
    'local_steps',  # multitier/local_steps.py: a declined step saved to the node-local tiers only
    'tier_commit',  # _install: the node-local tier's copy becomes the committed one; the log line
)


class ManagerHooks:
  """One concern's calls around a CheckpointManager (see the module docstring for when each
  runs and on which host). Subclasses set ``name`` (one of ``ORDER``) and override what they
  need."""

  name: ClassVar[str] = ''

  @property
  def order(self) -> int:
    """Where this concern runs among the others (``ORDER``)."""
    return ORDER.index(self.name)

  def manager_init(self, mngr: Any) -> None:
    """1. Every process, after Orbax's constructor."""

  def reached_preemption(self, mngr: Any, step: int, stock: Callable[[], bool],
                         participants: Any) -> bool | None:
    """2. ``True`` / ``False`` decides whether ``step`` is a preemption step; ``None`` passes."""
    return None

  def before_save(self, mngr: Any, step: int) -> None:
    """3. Every process, before the save writes anything; raise to refuse it."""

  def save_args(self, mngr: Any, step: int, args: tuple, kwargs: dict) -> None:
    """3. Every process, after ``before_save``, with the save's arguments."""

  def save_error(self, mngr: Any, step: int, error: BaseException) -> BaseException | None:
    """4. The error to raise in place of ``error`` from ``save``; ``None`` passes."""
    return None

  def after_save(self, mngr: Any, step: int, saved: bool) -> None:
    """5. Every process, once ``save`` returned."""

  def save_declined(self, mngr: Any, step: int, args: tuple, kwargs: dict) -> None:
    """5. Every process, when Orbax's policy declined ``step``; ``args``/``kwargs`` are the
    save's."""

  def commit_error(self, mngr: Any, step: int, error: BaseException) -> BaseException | None:
    """6. The error to raise in place of ``error`` from a failed commit; ``None`` passes."""
    return None

  def after_commit(self, mngr: Any, step: int, commit_s: float) -> None:
    """7. Every process, Orbax's finalize thread, once ``step`` is committed."""

  def step_complete(self, step_path: Any) -> bool | None:
    """8. ``False`` hides the step from listings; ``None`` passes."""
    return None

  def delete_step(self, step: int, path: Any, remove: Callable[[Any], None]) -> bool:
    """9. ``True`` once this hook deleted the step (through ``remove``)."""
    return False

  def delete_started(self, mngr: Any, step: int) -> None:
    """10. Before the user's ``mngr.delete(step)``."""

  def delete_ended(self, mngr: Any, step: int) -> None:
    """10. After it, even if it raised."""

  def close(self, mngr: Any) -> None:
    """11. Every process, once Orbax's ``close`` returned or raised."""

  def wait(self, mngr: Any) -> None:
    """11. Every process, once Orbax's ``wait_until_finished`` returned."""
