"""A child of ``tests/compat/test_seam.py``: an Orbax release in which a method the package
patches moved, simulated on the installed Orbax before ``import orbax_pathways``.

    python -m support.workers.moved_target_worker DIR

``CheckpointManager.reached_preemption`` moves from the class into a base class made for it
(the method is still there, as in a release that moved it: Orbax keeps working; the class no
longer defines it itself). Then the package is imported, a ``CheckpointManager`` saves and
restores a sharded array in ``DIR``, and the worker prints one JSON object: the features
``seam.off()`` reports, whether each of the class's other patched methods is Orbax's own, the
warnings logged, and whether the values restored equal those saved.
"""

from __future__ import annotations

import json
import logging
import sys


def main() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  cls = ocp.CheckpointManager
  moved = vars(cls)['reached_preemption']
  base = cls.__bases__[0]
  cls.__bases__ = (type('MovedReachedPreemption', (base,), {'reached_preemption': moved}),
                   *cls.__bases__[1:])
  delattr(cls, 'reached_preemption')
  own = {name: vars(cls)[name] for name in ('save', 'restore', '_finalize', '__init__')}

  records: list[str] = []

  class Keep(logging.Handler):
    def emit(self, record):
      if record.levelno >= logging.WARNING:
        records.append(record.getMessage())

  logging.getLogger('orbax_pathways').addHandler(Keep())
  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from orbax_pathways._compat import seam  # pylint: disable=g-import-not-at-top

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  value = np.arange(64, dtype=np.float32).reshape(16, 4)
  state = {'w': jax.device_put(value, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec('x')))}
  with ocp.CheckpointManager(sys.argv[1]) as m:
    m.save(1, args=ocp.args.StandardSave(state))
    m.wait_until_finished()
    back = m.restore(1, args=ocp.args.StandardRestore(state))
  print(json.dumps({
      'off': seam.off(),
      'stock': {name: vars(cls)[name] is fn for name, fn in own.items()},
      'warnings': records,
      'equal': bool(np.array_equal(np.asarray(back['w']), value)),
  }))


if __name__ == '__main__':
  main()
