"""A ``jax.distributed`` process (``support.mp_harness``, 2 processes of 2 devices) saving, then
resuming, a sharded checkpoint, for ``tests/manager/test_preemption.py``
(``test_resume_fallback_is_agreed_by_every_process``).

    python mp_resume_worker.py save|resume DIRECTORY

``save``: a CheckpointManager on DIRECTORY saves steps 1 and 2 of a sharded ``w`` (4096 floats,
``1000 * step`` added) and emits ``{"saved": all_steps()}``. ``resume``: ``preemption.resume``
with the abstract state, then emits ``{"step", "ok", "latest"}`` (the step resumed from, whether
every addressable shard holds that step's values, ``latest_step()``). Top half numpy-only.
"""

from __future__ import annotations

import sys

import numpy as np

SIZE = 4 * 1024


def value(step: int) -> np.ndarray:
  return np.arange(SIZE, dtype=np.float32) + np.float32(1000 * step)


def main() -> None:
  from support import mp_worker as w  # pylint: disable=g-import-not-at-top
  w.init()
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  from orbax_pathways import preemption  # pylint: disable=g-import-not-at-top
  mode, directory = sys.argv[1], sys.argv[2]
  sh = NamedSharding(Mesh(np.array(jax.devices()), ('x',)), P('x'))

  def array(step):
    return jax.make_array_from_callback(value(step).shape, sh, lambda idx: value(step)[idx])

  mngr = ocp.CheckpointManager(directory)
  if mode == 'save':
    for step in (1, 2):
      mngr.save(step, args=ocp.args.StandardSave({'w': array(step)}))
    mngr.wait_until_finished()
    w.emit({'saved': mngr.all_steps()})
  else:
    abstract = {'w': jax.ShapeDtypeStruct((SIZE,), np.float32, sharding=sh)}
    step, state = preemption.resume(mngr, lambda: None, abstract_state=abstract)
    ok = all(np.asarray(s.data).tobytes() == value(step)[s.index].tobytes()
             for s in state['w'].addressable_shards)
    w.emit({'step': step, 'ok': ok, 'latest': mngr.latest_step()})


if __name__ == '__main__':
  main()
