"""Errors raised by orbax-pathways. Each message names the path, the array, what was expected,
what was found, and what to do."""

from __future__ import annotations


class OrbaxPathwaysError(Exception):
  """Base class of every error this package raises on purpose."""


class SaveError(OrbaxPathwaysError, RuntimeError):
  """A background write failed; the step is not committed and earlier steps are untouched."""


class RestoreError(OrbaxPathwaysError, ValueError):
  """A checkpoint could not be read back as asked."""


class ChecksumMismatchError(RestoreError):
  """A chunk's bytes do not match the crc32c recorded when it was written."""


class TopologyError(RestoreError):
  """The saved layout cannot be mapped onto the current devices under the chosen policy."""


class RegistrationError(OrbaxPathwaysError, RuntimeError):
  """Orbax's type-handler registry is not in the state orbax-pathways expects."""
