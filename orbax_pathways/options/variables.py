"""Every ``ORBAX_PATHWAYS_*`` environment variable (``ENV_VARS``), parsed with typed validation.

Every variable is parsed once, when ``install()`` runs (at ``import orbax_pathways`` for the
global handler): a bad value raises ``ValueError`` naming the variable, the value found and the
values accepted, instead of failing at the first save or silently picking a default. Booleans
accept ``1/true/yes/y/on/t`` and ``0/false/no/n/off/f`` (any case) and reject anything else.
``engine/runtime.py``, ``preemption/`` and ``sharding/layout.py`` read their variables through
``env_value`` / ``num_slices_from_env``; ``Options.from_env`` (``options/settings.py``) through
``FIELD_ENV``. A former variable name (``choices.FORMER_ENV``) is read where the current one is
unset (``env_raw``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import warnings
from typing import Any, Mapping

from orbax_pathways.options.choices import (COMPRESSIONS, DIVISIBILITIES, FORMER_ENV,
                                            FORMER_TRANSPORTS, LOCAL_STEPS_IN, LOCAL_WHEN_BUSY,
                                            MiB, RUNTIMES, SNAPSHOTS, TIER_MAX_AGE_S,
                                            TIER_SCOPES, TRANSPORTS)

_FORMER_ENV_OF = {new: old for old, new in FORMER_ENV.items()}


_TRUE = ('1', 'true', 'yes', 'y', 'on', 't')
_FALSE = ('0', 'false', 'no', 'n', 'off', 'f')


@dataclasses.dataclass(frozen=True)
class EnvVar:
  """One ``ORBAX_PATHWAYS_*`` variable: its type, default and accepted values."""
  name: str
  kind: str  # 'bool' | 'int' | 'float' | 'choice' | 'str'
  default: Any
  doc: str
  choices: tuple[str, ...] = ()
  minimum: float | None = None
  unit: str = ''
  unset: str = ''  # what leaving it unset does, when not simply the default value

  def accepted(self) -> str:
    if self.kind == 'bool':
      return f'a boolean: one of {list(_TRUE)} or {list(_FALSE)}, any case'
    if self.kind == 'choice':
      return f'one of {list(self.choices)}'
    if self.kind == 'str':
      return 'a directory path, or "off"'
    number = 'an integer' if self.kind == 'int' else 'a number'
    bound = '' if self.minimum is None else f' >= {self.minimum:g}'
    return f'{number}{bound}{" (" + self.unit + ")" if self.unit else ""}'

  def unset_hint(self) -> str:
    if self.unset:
      return f'Unset it to {self.unset}.'
    if self.kind == 'bool':
      return f"Unset it for the default ({'on' if self.default else 'off'})."
    return f'Unset it for the default ({self.default!r}).'

  def parse(self, raw: str | None) -> Any:
    """The typed value of ``raw`` (None or empty: the default); ValueError if malformed."""
    if raw is None or not raw.strip():
      return self.default
    text = raw.strip()
    if self.kind == 'str':
      return text
    if self.kind == 'bool':
      low = text.lower()
      if low in _TRUE:
        return True
      if low in _FALSE:
        return False
      raise ValueError(f'{self.name}={raw!r} is not {self.accepted()}. {self.unset_hint()}')
    if self.kind == 'choice':
      low = former_transport(text.lower(), self.name) if self.choices == TRANSPORTS else text.lower()
      if low in self.choices:
        return low
      raise ValueError(f'{self.name}={raw!r} is not one of {list(self.choices)}. '
                       f'{self.unset_hint()}')
    try:
      value = int(text) if self.kind == 'int' else float(text)
    except ValueError:
      raise ValueError(f'{self.name}={raw!r} is not {self.accepted()}. '
                       f'{self.unset_hint()}') from None
    if math.isnan(value) or (self.minimum is not None and value < self.minimum):
      raise ValueError(f'{self.name}={raw!r} is out of range: it must be {self.accepted()}. '
                       f'{self.unset_hint()}')
    return value


ENV_VARS: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar('ORBAX_PATHWAYS_DISABLE', 'bool', False,
           'import without installing anything'),
    EnvVar('ORBAX_PATHWAYS_NO_SIGTERM', 'bool', False,
           'keep SIGTERM\'s default action (no preemption notice)'),
    EnvVar('ORBAX_PATHWAYS_SIGTERM_GRACE_S', 'float', 120.0,
           'seconds after a SIGTERM notice before SIGTERM\'s default action applies',
           minimum=0.001, unit='seconds; inf: only a second SIGTERM'),
    EnvVar('ORBAX_PATHWAYS_LEASE', 'bool', True,
           'saving CheckpointManagers take the directory\'s writer lease (a second live writer '
           'is refused)'),
    EnvVar('ORBAX_PATHWAYS_EMERGENCY', 'choice', 'pathways',
           "what Orbax's emergency CheckpointManager is: 'pathways', this package's drop-in "
           "(one manager, local-only steps in the node-local tier at local_directory, any "
           "topology); 'orbax', Orbax's own class",
           choices=('pathways', 'orbax')),
    EnvVar('ORBAX_PATHWAYS_LEASE_TIMEOUT_S', 'float', 30.0,
           'seconds without renewal after which a writer lease counts as abandoned',
           minimum=0.1, unit='seconds'),
    EnvVar('ORBAX_PATHWAYS_MAX_CHUNK_BYTES', 'int', 16 * MiB, 'largest stored chunk',
           minimum=1, unit='bytes'),
    EnvVar('ORBAX_PATHWAYS_MAX_INFLIGHT_BYTES', 'int', 1024 * MiB,
           'host bytes handed to tensorstore at once', minimum=1, unit='bytes'),
    EnvVar('ORBAX_PATHWAYS_COALESCE_BYTES', 'int', 1 * MiB,
           'arrays up to this size: one chunk per host (0: off)', minimum=0, unit='bytes'),
    EnvVar('ORBAX_PATHWAYS_SNAPSHOT', 'choice', 'auto', 'device-to-host copy', SNAPSHOTS),
    EnvVar('ORBAX_PATHWAYS_VERIFY', 'bool', True, 'crc32c check on restore'),
    EnvVar('ORBAX_PATHWAYS_TRANSPORT', 'choice', None, 'who moves shard bytes', TRANSPORTS,
           unset='auto-detect'),
    EnvVar('ORBAX_PATHWAYS_RUNTIME', 'choice', None, 'which JAX runtime this is', RUNTIMES,
           unset='auto-detect'),
    EnvVar('ORBAX_PATHWAYS_DIVISIBILITY', 'choice', 'replicate',
           'a dimension that no longer divides after a reshard', DIVISIBILITIES),
    EnvVar('ORBAX_PATHWAYS_COMPRESSION', 'choice', 'auto', 'zstd or not', COMPRESSIONS),
    EnvVar('ORBAX_PATHWAYS_GCS_GRPC', 'bool', False, "tensorstore's gRPC GCS driver"),
    EnvVar('ORBAX_PATHWAYS_STORAGE_RETRIES', 'int', None, 'GCS retries per request',
           minimum=0, unset="keep tensorstore's default (32)"),
    EnvVar('ORBAX_PATHWAYS_REQUEST_DEADLINE_FLOOR_S', 'float', 10.0,
           'shortest deadline of one storage request before a second one is issued',
           minimum=0.001, unit='seconds'),
    EnvVar('ORBAX_PATHWAYS_REQUEST_DEADLINE_CAP_S', 'float', 120.0,
           'longest deadline of one storage request before a second one is issued',
           minimum=0.001, unit='seconds'),
    EnvVar('ORBAX_PATHWAYS_PEER_TIMEOUT_S', 'float', 60.0,
           'seconds a save waits for another process, or a colocated call for a worker, beyond '
           'what this process observed of the work itself, before naming who did not answer',
           minimum=0.001, unit='seconds'),
    EnvVar('ORBAX_PATHWAYS_NUM_SLICES', 'int', None,
           'split devices into equal slices when they carry no slice_index', minimum=1,
           unset='take slices from the devices (slice_index, else one per process)'),
    EnvVar('ORBAX_PATHWAYS_TIER_DIR', 'str', None,
           'node-local tier directory (tmpfs), or "off"',
           unset='/dev/shm (a tmpfs) for gs:// or network storage, several processes or '
                 'Pathways workers; none for one process on local disk'),
    EnvVar('ORBAX_PATHWAYS_TIER_KEEP', 'int', 1, 'committed steps the node-local tier keeps',
           minimum=1),
    EnvVar('ORBAX_PATHWAYS_LOCAL_STEPS_KEEP', 'int', None,
           'local-only steps kept per checkpoint directory', minimum=1,
           unset='ORBAX_PATHWAYS_TIER_KEEP'),
    EnvVar('ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS', 'int', 0,
           'save a step that the CheckpointManager declines to the node-local tiers only, when '
           'its number is a multiple of this (0: never)', minimum=0),
    EnvVar('ORBAX_PATHWAYS_LOCAL_COPIES', 'int', 1,
           'copies of each host\'s share of a local-only step: 1, or 2 (a partner host of '
           'another slice keeps the second)', minimum=1),
    EnvVar('ORBAX_PATHWAYS_TIER_MAX_AGE_S', 'float', TIER_MAX_AGE_S,
           "node-local tier entries of other checkpoint directories idle this long are dropped",
           minimum=0, unit='seconds; inf: never by age'),
    EnvVar('ORBAX_PATHWAYS_TIER_MAX_BYTES', 'int', None,
           "the node-local tier's size above which entries are dropped, oldest first",
           minimum=0, unit='bytes', unset="cap it at half the size of the tier's filesystem"),
    EnvVar('ORBAX_PATHWAYS_TIER_SCOPE', 'choice', 'written',
           "what the node-local tier keeps: the chunks this host wrote, or every chunk its "
           'devices hold', TIER_SCOPES),
    EnvVar('ORBAX_PATHWAYS_LOCAL_SAVE_WHEN_BUSY', 'choice', 'wait',
           'a local-only save due while the previous one is busy: wait for its writes (it '
           'commits first), or skip the step (every process alike)', LOCAL_WHEN_BUSY),
    EnvVar('ORBAX_PATHWAYS_LOCAL_STEPS_IN', 'choice', 'nodes',
           "where a local-only step's Orbax files and records go: each node alone (no storage "
           'request, no barrier), or storage (with the bytes in the tiers)', LOCAL_STEPS_IN),
    EnvVar('ORBAX_PATHWAYS_TIER_PEER_TIMEOUT_S', 'float', 20.0,
           "longest wait on another host's node-local tier before its chunks come from storage",
           minimum=0.001, unit='seconds'),
    EnvVar('ORBAX_PATHWAYS_PEER_ADDRESS', 'str', None,
           "the address other hosts reach this host's node-local tier server at",
           unset="this host name's address"),
    EnvVar('ORBAX_PATHWAYS_MAP_TIER', 'bool', True,
           "map the node-local tier's chunk files into restore buffers (0: copy them; "
           'read by storage/pages.py)'),
    EnvVar('ORBAX_PATHWAYS_SLOW', 'bool', False, 'test suite only: run slow tests'),
)}


# The Options field each variable sets (``Options.from_env``); the field's default is the
# variable's.
FIELD_ENV: dict[str, str] = {
    'max_chunk_bytes': 'ORBAX_PATHWAYS_MAX_CHUNK_BYTES',
    'max_inflight_bytes': 'ORBAX_PATHWAYS_MAX_INFLIGHT_BYTES',
    'coalesce_bytes': 'ORBAX_PATHWAYS_COALESCE_BYTES',
    'snapshot': 'ORBAX_PATHWAYS_SNAPSHOT',
    'verify_checksums': 'ORBAX_PATHWAYS_VERIFY',
    'transport': 'ORBAX_PATHWAYS_TRANSPORT',
    'divisibility': 'ORBAX_PATHWAYS_DIVISIBILITY',
    'compression': 'ORBAX_PATHWAYS_COMPRESSION',
    'gcs_grpc': 'ORBAX_PATHWAYS_GCS_GRPC',
    'storage_retries': 'ORBAX_PATHWAYS_STORAGE_RETRIES',
    'num_slices': 'ORBAX_PATHWAYS_NUM_SLICES',
    'tier_dir': 'ORBAX_PATHWAYS_TIER_DIR',
    'tier_keep': 'ORBAX_PATHWAYS_TIER_KEEP',
    'local_steps_keep': 'ORBAX_PATHWAYS_LOCAL_STEPS_KEEP',
    'local_save_interval_steps': 'ORBAX_PATHWAYS_LOCAL_SAVE_INTERVAL_STEPS',
    'tier_scope': 'ORBAX_PATHWAYS_TIER_SCOPE',
    'local_save_when_busy': 'ORBAX_PATHWAYS_LOCAL_SAVE_WHEN_BUSY',
    'local_steps_in': 'ORBAX_PATHWAYS_LOCAL_STEPS_IN',
    'local_copies': 'ORBAX_PATHWAYS_LOCAL_COPIES',
    'tier_max_age_s': 'ORBAX_PATHWAYS_TIER_MAX_AGE_S',
    'tier_max_bytes': 'ORBAX_PATHWAYS_TIER_MAX_BYTES',
    'tier_peer_timeout_s': 'ORBAX_PATHWAYS_TIER_PEER_TIMEOUT_S',
    'request_deadline_floor_s': 'ORBAX_PATHWAYS_REQUEST_DEADLINE_FLOOR_S',
    'request_deadline_cap_s': 'ORBAX_PATHWAYS_REQUEST_DEADLINE_CAP_S',
    'peer_timeout_s': 'ORBAX_PATHWAYS_PEER_TIMEOUT_S',
}


def field_default(field: str) -> Any:
  """The default of the ``Options`` field ``field``: its variable's (``FIELD_ENV``)."""
  return ENV_VARS[FIELD_ENV[field]].default


def former_transport(name: str, where: str) -> str:
  """``name``, or the current name of a former transport name (one ``DeprecationWarning``
  naming ``where`` it was given)."""
  if name not in FORMER_TRANSPORTS:
    return name
  warnings.warn(f'orbax_pathways: {where}={name!r} is now {FORMER_TRANSPORTS[name]!r} (the same '
                'transport); the former name will go away in a later release.',
                DeprecationWarning, stacklevel=3)
  return FORMER_TRANSPORTS[name]


def env_raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
  """The variable ``name`` as set, else its former name's value (``FORMER_ENV``), else None."""
  environ = os.environ if environ is None else environ
  raw = environ.get(name)
  if raw is None and name in _FORMER_ENV_OF:
    raw = environ.get(_FORMER_ENV_OF[name])
  return raw


def env_value(name: str, environ: Mapping[str, str] | None = None) -> Any:
  """The parsed value of the known variable ``name`` (its default when unset; its former
  name's value where only that is set)."""
  return ENV_VARS[name].parse(env_raw(name, environ))


def num_slices_from_env(environ: Mapping[str, str] | None = None) -> int | None:
  """``ORBAX_PATHWAYS_NUM_SLICES`` validated (an integer >= 1), or None when unset."""
  return env_value('ORBAX_PATHWAYS_NUM_SLICES', environ)


def parse_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
  """Every known variable parsed; one ValueError listing every malformed one.

  Variables that are not known but look meant for us (``unknown_env``) are returned under
  ``'unknown'`` (with the closest known name, if any) for the caller to warn about.
  """
  environ = os.environ if environ is None else environ
  values, problems = {}, []
  for name, var in ENV_VARS.items():
    try:
      values[name] = var.parse(env_raw(name, environ))
    except ValueError as e:
      problems.append(str(e))
  if problems:
    raise ValueError('orbax_pathways: invalid environment: ' + ' '.join(problems))
  values['unknown'] = unknown_env(environ)
  return values


_PREFIX = 'ORBAX_PATHWAYS_'


def unknown_env(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
  """Set variables that are not ours but look meant to be: name -> the closest known name.

  Any unknown ``ORBAX_PATHWAYS_*`` name (closest known name or None), and a near-miss of a known
  name outside that prefix (``ORBAX_PATHWAY_VERIFY``, ``orbax_pathways_verify``,
  ``ORBAXPATHWAYS_VERIFY``): a name mentioning ORBAX or PATHWAY whose upper case is a close
  ``difflib`` match of a known one. ``_registration`` warns once per name at install (import).
  """
  environ = os.environ if environ is None else environ
  known = list(ENV_VARS)
  unknown: dict[str, str | None] = {}
  for name in environ:
    if name in ENV_VARS or name in FORMER_ENV:
      continue
    upper = name.upper()
    if name.startswith(_PREFIX):
      close = difflib.get_close_matches(name, known, n=1)
      unknown[name] = close[0] if close else None
    elif 'ORBAX' in upper or 'PATHWAY' in upper:
      # A Pathways runtime variable (PATHWAYS_*) is not ours: without ORBAX, only a typo of the
      # whole name (OBRAX_PATHWAYS_VERIFY) counts.
      close = difflib.get_close_matches(upper, known, n=1, cutoff=0.8 if 'ORBAX' in upper else 0.9)
      if close:
        unknown[name] = close[0]
  return unknown
