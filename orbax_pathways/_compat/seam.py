"""The one way the package replaces an Orbax (or gcsfs, google-cloud-storage, jax) attribute:
each ``_compat`` module declares a ``Feature``, its ``Target``s (owner, attribute, the wrapper
that makes the replacement from the original, or an attribute the owner does not define and
the package adds) and why it needs them; ``install`` checks every
target of the feature before it replaces any, and a missing target turns that feature off, with
one warning naming the attribute and the feature, leaving the library as it was there: never an
exception at import or at a manager's construction, never a feature half applied.

Who calls what, on which host: every ``_compat`` module's ``install`` / ``uninstall``
(``orbax_pathways._install``, at ``import orbax_pathways`` and ``uninstall()``, on every
process that imports the package; ``_compat/orbax_process_local.py`` at the first node step).
``declared()`` lists every feature ever declared (the conformance test checks each target
against the installed libraries); ``off()`` says which features a missing target turned off.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable, Sequence

log = logging.getLogger('orbax_pathways')
_ABSENT = object()  # an attribute the owner did not define itself (``Target.add``)


@dataclasses.dataclass(frozen=True)
class Target:
  """``owner().attr`` replaced by ``wrap(original)``. ``owner`` resolves the class or module
  (it may raise: a module an Orbax release does not have). ``optional``: a target some
  supported releases lack, whose absence is fine (the feature goes on without it)."""

  owner: Callable[[], Any]
  attr: str
  wrap: Callable[[Any], Any]
  optional: bool = False
  add: bool = False  # set where the owner has none of its own (``wrap`` gets None); removed again


@dataclasses.dataclass(frozen=True)
class Feature:
  """What the package does through these targets (``name``: said in the warning) and why it
  patches rather than uses a public extension point (``why``: ``docs/architecture.md`` lists
  them). ``targets`` builds the list when the feature is installed."""

  name: str
  why: str
  targets: Callable[[], Sequence[Target]]


@dataclasses.dataclass(frozen=True)
class _Applied:
  owner: Any
  attr: str
  original: Any  # exactly what was in the owner's ``__dict__``
  replacement: Any


class _State:
  def __init__(self) -> None:
    self.lock = threading.RLock()
    self.declared: dict[str, Feature] = {}
    self.applied: dict[str, list[_Applied]] = {}
    self.off: dict[str, list[str]] = {}


_state = _State()


def _where(owner: Any, attr: str) -> str:
  module = getattr(owner, '__module__', None) if isinstance(owner, type) else None
  name = getattr(owner, '__qualname__', None) or getattr(owner, '__name__', repr(owner))
  return f'{module}.{name}.{attr}' if module else f'{name}.{attr}'


def resolve(feature: Feature) -> tuple[list[tuple[Any, Target]], list[str]]:
  """The targets of ``feature`` found (their owners resolved, present in the owner's own
  ``__dict__``) and the names of the required ones missing (pure of side effects)."""
  found, missing = [], []
  for t in feature.targets():
    try:
      owner = t.owner()
    except Exception as e:  # pylint: disable=broad-except  (a module this release lacks)
      if not t.optional:
        missing.append(f'{t.attr} ({type(e).__name__}: {e})')
      continue
    if t.attr in vars(owner) or t.add:
      found.append((owner, t))
    elif not t.optional:
      missing.append(_where(owner, t.attr))
  return found, missing


def install(feature: Feature) -> bool:
  """Applies every target of ``feature`` (once; True), or none when a required one is missing
  (False: one warning naming them and the feature, which stays off until ``uninstall``)."""
  with _state.lock:
    _state.declared[feature.name] = feature
    if feature.name in _state.applied:
      return True
    if feature.name in _state.off:
      return False
    found, missing = resolve(feature)
    if missing:
      _state.off[feature.name] = missing
      from orbax_pathways._compat import supported  # pylint: disable=g-import-not-at-top
      log.warning('orbax_pathways: %s not found in the installed libraries (orbax-checkpoint '
                  '%s is supported): %s is off, and Orbax behaves there as without the '
                  'package. Install a supported orbax-checkpoint version to have it.',
                  ', '.join(missing), supported.ORBAX, feature.name)
      return False
    applied = []
    for owner, t in found:
      original = vars(owner).get(t.attr, _ABSENT)
      replacement = t.wrap(None if original is _ABSENT else original)
      setattr(owner, t.attr, replacement)
      applied.append(_Applied(owner, t.attr, original, replacement))
    _state.applied[feature.name] = applied
    return True


def uninstall(feature: Feature | str) -> None:
  """Puts the originals of ``feature`` back, last applied first (idempotent); a feature that
  was off may be installed again."""
  name = feature if isinstance(feature, str) else feature.name
  with _state.lock:
    _state.off.pop(name, None)
    for a in reversed(_state.applied.pop(name, [])):
      if vars(a.owner).get(a.attr) is not a.replacement:
        log.warning('orbax_pathways: %s was replaced by someone else after us; putting the '
                    'original back anyway.', _where(a.owner, a.attr))
      if a.original is _ABSENT:
        delattr(a.owner, a.attr)
      else:
        setattr(a.owner, a.attr, a.original)


def installed(feature: Feature | str) -> bool:
  name = feature if isinstance(feature, str) else feature.name
  with _state.lock:
    return name in _state.applied


def originals(feature: Feature | str) -> dict[str, Any]:
  """The originals of an installed feature, by attribute name (tests check they come back)."""
  name = feature if isinstance(feature, str) else feature.name
  with _state.lock:
    return {a.attr: a.original for a in _state.applied.get(name, []) if a.original is not _ABSENT}


def off() -> dict[str, list[str]]:
  """The features a missing target turned off, with what was missing."""
  with _state.lock:
    return {k: list(v) for k, v in _state.off.items()}


def declared() -> list[Feature]:
  """Every feature installed (or tried) in this process."""
  with _state.lock:
    return list(_state.declared.values())
