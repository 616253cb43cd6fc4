"""JAX multi-controller plumbing: process count and index, jax's coordination-service
(key-value) client, and whether its preemption service runs. Called on every controller process
by the preemption agreement, resume, the writer lease, the save liveness round and the tier's
peer exchange. ``jax.distributed``'s state is private: reached through ``src.jax``.
"""

from __future__ import annotations

from orbax_pathways._compat import src


def process_count() -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_count()


def process_index() -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index()


def distributed_client():
  """JAX's coordination-service client (None outside ``jax.distributed``)."""
  distributed = src.jax('distributed')
  return distributed.global_state.client


def jax_preemption_service_active() -> bool:
  """True if JAX's preemption sync manager runs (jax.distributed with the service enabled)."""
  distributed = src.jax('distributed')
  return (distributed.global_state.client is not None
          and distributed.global_state.preemption_sync_manager is not None)


def distributed_process_count() -> int:
  """``num_processes`` of ``jax.distributed`` (1 outside it), read without starting a backend
  (``jax.process_count()`` would)."""
  distributed = src.jax('distributed')
  if distributed.global_state.client is None:
    return 1
  return int(getattr(distributed.global_state, 'num_processes', 1) or 1)
