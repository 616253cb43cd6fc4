"""Which ArrayHandler serves ``jax.Array``: stock Orbax's or ours, and proof of which one did.

Called by ``measure``, ``rss`` and ``profiling`` before every save / restore they time, in the
process that times it. Only the public API of the package is used:

- ``use_handler('stock')``: ``orbax_pathways.uninstall()``, then Orbax's registry must hand
  ``jax.Array`` to a class named ``ArrayHandler``; ``use_handler('ours')``:
  ``orbax_pathways.install()``, then it must hand it to an ``orbax_pathways.ProxyArrayHandler``.
- ``Served``: ``orbax_pathways.stats.last_save()`` / ``last_restore()`` must change across a call
  served by ours, and must not change across a call served by stock.
- ``save_stats_extras`` / ``restore_stats_extras``: the only code that reads fields of those stats
  records, for the JSON ``extras``.
"""

from __future__ import annotations

import gc


def use_handler(impl: str) -> None:
  import jax
  import orbax.checkpoint as ocp
  import orbax_pathways
  if impl == 'stock':
    orbax_pathways.uninstall()
    name = type(ocp.type_handlers.get_type_handler(jax.Array)).__name__
    if name != 'ArrayHandler':
      raise RuntimeError(f'stock run but jax.Array is handled by {name}')
  else:
    orbax_pathways.install()
    h = ocp.type_handlers.get_type_handler(jax.Array)
    if not isinstance(h, orbax_pathways.ProxyArrayHandler):
      raise RuntimeError(f'ours run but jax.Array is handled by {type(h).__name__}')
  gc.collect()


class Served:
  """Checks which handler served a save / restore, through orbax_pathways.stats."""

  def __init__(self, impl: str, kind: str):
    import orbax_pathways
    self.impl, self.kind = impl, kind
    self.getter = (orbax_pathways.stats.last_save if kind == 'save'
                   else orbax_pathways.stats.last_restore)
    self.before = self.getter()
    self.after = None

  def check(self):
    """Raises if the wrong handler served the call; ours: the new stats record, stock: None."""
    self.after = self.getter()
    if self.impl == 'ours' and (self.after is None or self.after is self.before):
      raise RuntimeError(f'ours {self.kind}: orbax_pathways.stats did not change: '
                         'our handler did not serve it')
    if self.impl == 'stock' and self.after is not self.before:
      raise RuntimeError(f'stock {self.kind}: orbax_pathways.stats changed: our handler served it')
    return self.after if self.impl == 'ours' else None


# The fields of orbax_pathways.stats.SaveStats / RestoreStats the JSON extras report. If the
# records change, only these two functions change.

def save_stats_extras(st, n_arrays: int) -> dict:
  """Ours' own account of a save (``stats.last_save()`` after the commit)."""
  out = {'ours_save_blocking_s': st.blocking_s, 'ours_write_s': st.write_s,
         'ours_arrays_per_serialize': st.arrays, 'ours_written_bytes': st.total_written}
  if st.arrays != n_arrays:
    out['note'] = f'last serialize saw {st.arrays} of {n_arrays} arrays'
  return out


def restore_stats_extras(rst) -> dict:
  """Ours' own account of a restore (``stats.last_restore()``): decoded bytes read and needed."""
  return {'ours_stats_bytes_read': sum(rst.bytes_read.values()),
          'ours_stats_bytes_needed': sum(rst.bytes_needed.values()),
          'ours_chunks_verified': rst.chunks_verified}
