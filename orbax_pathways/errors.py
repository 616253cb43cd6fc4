"""Errors raised by orbax-pathways. Each message names the path, the array, what was expected,
what was found, and what to do.

Where stock Orbax raises a given exception type in the same situation, ours is a subclass of
that type and keeps Orbax's key phrase, so ``except ValueError`` / ``except FileNotFoundError``
and ``assertRaisesRegex(..., 'is not compatible with')`` written against stock Orbax still work.
"""

from __future__ import annotations

import copy
from typing import Sequence


class OrbaxPathwaysError(Exception):
  """Base class of every error this package raises on purpose."""


class SaveError(OrbaxPathwaysError, RuntimeError, ValueError):
  """A background write failed; the step is not committed and earlier steps are untouched.
  (Also a ``ValueError``: what tensorstore raises for the same failures under stock Orbax.)"""


class PeerLostError(SaveError):
  """Other processes of a multi-process save did not report their writes (or the primary host
  its commit) within the liveness deadline: they died, hang, or are far slower. ``missing``:
  their process indices; ``hosts``: process index -> host name, where known. The step is not
  committed."""

  def __init__(self, message: str, missing: Sequence[int] = (),
               hosts: dict[int, str] | None = None):
    super().__init__(message)
    self.missing = tuple(missing)
    self.hosts = dict(hosts or {})


class SaveTimeoutError(SaveError, TimeoutError):
  """A multi-process save ran past Orbax's own timeout (``AsyncCheckpointer(timeout_secs=...)``,
  ``AsyncOptions.timeout_secs``) while this process waited for the others, or another process's
  writes timed out: a ``TimeoutError`` with stock's phrase ("Timed out while waiting for
  async_write_complete barrier", "... async_commit_complete barrier"), naming the processes it
  waited for. The step is not committed by this process."""


class RestoreError(OrbaxPathwaysError, ValueError):
  """A checkpoint could not be read back as asked."""


class ArrayNotFoundError(RestoreError, FileNotFoundError):
  """An array of the checkpoint is missing on storage (stock: ``FileNotFoundError`` without
  OCDBT, tensorstore's ``ValueError`` with it; this is both)."""


class StepDeletedError(RestoreError, FileNotFoundError):
  """The step was deleted (another process's retention) while it was being restored."""


class ShapeMismatchError(RestoreError):
  """The restore target's shape differs from the stored one and truncation/padding is off."""


class ChecksumMismatchError(RestoreError):
  """A chunk's bytes do not match the crc32c recorded when it was written."""


class MissingChecksumError(RestoreError):
  """A chunk of an array written by orbax-pathways has no recorded checksum (a writer's record
  is missing), so its bytes cannot be verified."""


class LocalStepIncompleteError(RestoreError):
  """A local-only step (``docs/multi_tier.md``) cannot be completed: a chunk of it is in no
  live process's node-local tier, and storage holds no bytes of such a step."""


class TopologyError(RestoreError):
  """The saved layout cannot be mapped onto the current devices under the chosen policy."""


class MetadataError(RestoreError):
  """An orbax-pathways metadata file that cannot be decoded (damaged, or from a newer schema)."""


_KEEPING: dict[tuple[type, type], type] = {}


def keeping_type(cls: type[OrbaxPathwaysError], cause: BaseException,
                 message: str) -> OrbaxPathwaysError:
  """``cls(message)`` that is also an instance of ``type(cause)``, so code that caught the
  original error (``except OSError``) still catches ours. Raise it ``from cause``. Falls back to
  plain ``cls`` when the two types cannot be combined or the cause needs other arguments."""
  base = type(cause)
  if isinstance(cause, cls):  # already ours: keep its type and attributes, say the new message
    try:
      again = copy.copy(cause)
      again.args = (message,)
      return again
    except Exception:  # pylint: disable=broad-except
      return cls(message)
  if not isinstance(cause, Exception):
    return cls(message)
  key = (cls, base)
  combined = _KEEPING.get(key)
  if combined is None:
    try:
      combined = type(f'{cls.__name__}', (cls, base), {'__module__': cls.__module__})
    except TypeError:  # incompatible layouts
      combined = cls
    _KEEPING[key] = combined
  try:
    made = combined(message)
  except Exception:  # pylint: disable=broad-except  # a cause type with a custom constructor
    return cls(message)
  if isinstance(cause, OrbaxPathwaysError):  # its fields (``missing``, ``workers``) too
    for k, v in vars(cause).items():
      if not k.startswith('__'):
        setattr(made, k, v)
  return made


class WorkerTimeoutError(OrbaxPathwaysError, RuntimeError):
  """A colocated call to worker hosts did not answer within its deadline. ``workers``: the
  writer keys (``w<cpu device id>``) of the devices whose answer did not come. (Not a
  ``TimeoutError``: Orbax replaces any ``TimeoutError`` of a commit future with its own.)"""

  def __init__(self, message: str, workers: Sequence[str] = ()):
    super().__init__(message)
    self.workers = tuple(workers)


class WriterLeaseError(OrbaxPathwaysError, RuntimeError):
  """A save refused because another job saves into the same checkpoint directory: it holds the
  directory's writer lease (``orbax_pathways.manager.lease``), or took it over from this job."""
