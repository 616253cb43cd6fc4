"""Orbax v1's front door: ``ocp.v1.save_pytree`` / ``load_pytree`` / ``training.Checkpointer``.

v1 builds its array handling per ``Context`` (``ArrayLeafHandler``), never from the v0 global
registry. It does so by building a v0 ArrayHandler from the Context and delegating every save,
load and metadata call to it; that construction is the seam we take (``_compat/orbax_v1_seams.py``).
Who calls what: v1's ``PyTreeHandler`` constructs an ``ArrayLeafHandler`` per Context on the
controller (every process under multi-controller JAX); our ``handler_for`` gets the handler
Orbax built from that Context and returns a ``ProxyArrayHandler`` with the same settings, so
v1 saves and loads go through the same engine as v0 (``frontends/orbax_v0.py``): same format,
checksums, elastic restore, stats and log lines.

v1's ``np.ndarray`` and scalar leaves (``NumpyLeafHandler``, ``ScalarLeafHandler``) are served
the same way: each builds a v0 ``NumpyHandler`` / ``ScalarHandler`` and delegates to it, and
``host_handler_for`` returns ours (``ProxyNumpyHandler`` / ``ProxyScalarHandler``) with the same
settings, so numpy and scalar leaves get the records and verified loads they get under v0.

The Context maps onto our options as follows (README "Orbax options"):
- ``PathwaysOptions.checkpointing_impl`` (under Pathways): COLOCATED_PYTHON -> the colocated
  transport, PERSISTENCE -> persistence, NO_DISPATCHER -> local (I/O on the controller), unset ->
  our default. An explicit ``orbax_pathways.Options(transport=...)`` still wins.
- ``ArrayOptions.Loading.use_load_and_broadcast``: Orbax's ``SingleReplicaArrayHandler`` keeps
  serving that Context (we have no broadcast restore); said once in the log.
- every other array option reaches us through the ParamInfo/SaveArgs v1 builds, as in v0.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from orbax_pathways._util import said
from orbax_pathways import options as options_lib
from orbax_pathways.engine import runtime
from orbax_pathways._compat import orbax as compat
from orbax_pathways._compat import orbax_v1_seams as compat_v1
from orbax_pathways.frontends import orbax_v0

def options_for(context: Any, base: options_lib.Options) -> options_lib.Options:
  """Our options for one v1 Context: ``base`` (the installed ones) plus what the Context says."""
  if base.transport is None and runtime.detect_runtime() is runtime.Runtime.PATHWAYS:
    impl = compat_v1.pathways_impl_name(context)
    if impl is not None:
      return dataclasses.replace(base, transport=impl)
  return base


def handler_for(context: Any, stock: Any, base: options_lib.Options) -> Any:
  """The v0 handler v1 uses for ``context``: ours, configured like ``stock`` (the handler Orbax
  built from the Context), unless the Context asks for something only Orbax's handler does."""
  if not compat.is_plain_array_handler(stock):
    reason = ('ArrayOptions.Loading.use_load_and_broadcast' if compat_v1.uses_load_and_broadcast(context)
              else f'a {type(stock).__name__}')
    said.once(logging.INFO, type(stock).__name__,
          'orbax_pathways: this Orbax v1 Context uses %s; Orbax\'s %s serves it (orbax_pathways '
          'has no equivalent), so its arrays are not checksummed or written by their owners.',
          reason, type(stock).__name__)
    return stock
  return orbax_v0.ProxyArrayHandler(options=options_for(context, base),
                                    **compat.handler_constructor_kwargs(stock))


# kind of host leaf -> (Orbax's handler class v1 builds, ours)
_HOST_HANDLERS = {'numpy': (compat.NumpyHandler, orbax_v0.ProxyNumpyHandler),
                  'scalar': (compat.ScalarHandler, orbax_v0.ProxyScalarHandler)}


def host_handler_for(kind: str, stock: Any, base: options_lib.Options) -> Any:
  """The v0 handler v1 uses for ``np.ndarray`` (``kind`` 'numpy') or scalar ('scalar') leaves:
  ours, built like ``stock`` (``deepcopy_host_arrays`` from the Context, the Pathways
  controller's ``ocdbt_process_id``), unless ``stock`` is not Orbax's own class (left as it is,
  as ``install()`` leaves a user's registered handler)."""
  orbax_cls, ours = _HOST_HANDLERS[kind]
  if type(stock) is not orbax_cls:  # pylint: disable=unidiomatic-typecheck  (not subclasses)
    return stock
  # v1's loads do not tell the handler a leaf's saved type (see ProxyNumpyHandler).
  return ours(options=base, saved_type_in_infos=False,
              **compat.numpy_handler_constructor_kwargs(stock))
