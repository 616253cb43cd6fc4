"""Which kind of JAX runtime this controller runs under, and which transport moves shard bytes.

Called on the controller (every process in multi-controller JAX) at each save and restore;
cheap. ``ORBAX_PATHWAYS_RUNTIME`` and ``ORBAX_PATHWAYS_TRANSPORT`` override the detection (tests,
or a platform that knows better); both are parsed by ``options/variables.py`` (validated at
``install()``, read again here so that a test or platform may set them later).
"""

from __future__ import annotations

import os

import jax

from orbax_pathways import options as options_lib


# The names, once: in options/choices.py (the layer below), which validates them.
Runtime = options_lib.Runtime
TransportName = options_lib.TransportName

RUNTIME_ENV = 'ORBAX_PATHWAYS_RUNTIME'
TRANSPORT_ENV = 'ORBAX_PATHWAYS_TRANSPORT'


def _choice(enum_cls, env: str):
  value = options_lib.env_value(env)
  return None if value is None else enum_cls(value)


def detect_runtime() -> Runtime:
  """Pathways when the default backend is the IFRT ``proxy``; multi-controller when
  ``jax.process_count() > 1``; otherwise single process."""
  override = _choice(Runtime, RUNTIME_ENV)
  if override is not None:
    return override
  # jax < 0.12 types jax.config without its flags (attributes made at runtime).
  platforms = jax.config.jax_platforms  # type: ignore[attr-defined, unused-ignore]
  if jax.default_backend() == 'proxy' or 'proxy' in str(platforms or ''):
    return Runtime.PATHWAYS
  if jax.process_count() > 1:
    return Runtime.MULTI_CONTROLLER
  return Runtime.SINGLE


def choose_transport(runtime: Runtime | None = None,
                     requested: str | None = None) -> TransportName:
  """An explicit request wins, then the environment, then the runtime's default: colocated
  under Pathways (persistence when ``ENABLE_PATHWAYS_PERSISTENCE=1``), local otherwise."""
  if requested:
    if requested not in options_lib.TRANSPORTS:
      raise ValueError(f'transport={requested!r} is not one of {list(options_lib.TRANSPORTS)}; '
                       'pass None to detect it.')
    return TransportName(requested)
  override = _choice(TransportName, TRANSPORT_ENV)
  if override is not None:
    return override
  runtime = runtime or detect_runtime()
  if runtime is Runtime.PATHWAYS:
    if os.environ.get('ENABLE_PATHWAYS_PERSISTENCE') == '1':
      return TransportName.PERSISTENCE
    return TransportName.COLOCATED
  return TransportName.IN_PROCESS
