"""Errors raised by orbax-pathways. Each message names the path, the array, what was expected,
what was found, and what to do.

Where stock Orbax raises a given exception type in the same situation, ours is a subclass of
that type and keeps Orbax's key phrase, so ``except ValueError`` / ``except FileNotFoundError``
and ``assertRaisesRegex(..., 'is not compatible with')`` written against stock Orbax still work.
"""

from __future__ import annotations


class OrbaxPathwaysError(Exception):
  """Base class of every error this package raises on purpose."""


class SaveError(OrbaxPathwaysError, RuntimeError, ValueError):
  """A background write failed; the step is not committed and earlier steps are untouched.
  (Also a ``ValueError``: what tensorstore raises for the same failures under stock Orbax.)"""


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
  if isinstance(cause, cls) or not isinstance(cause, Exception):
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
    return combined(message)
  except Exception:  # pylint: disable=broad-except  # a cause type with a custom constructor
    return cls(message)


class WriterLeaseError(OrbaxPathwaysError, RuntimeError):
  """A save refused because another job saves into the same checkpoint directory: it holds the
  directory's writer lease (``orbax_pathways.lease``), or took it over from this job."""
