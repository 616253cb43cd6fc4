"""Restores array 'w' (96x64 float32) of an Orbax item with stock Orbax onto one device, for
``tests/tier/test_local_steps.py`` (the test sets ``ORBAX_PATHWAYS_DISABLE=1``).

    python -m support.workers.stock_read_worker ITEM_DIR

Prints one JSON object: ``{"error": <type>, "message": ...}`` if the restore raised, else
``{"nonzero": <count of nonzero values>}``.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {'w': jax.ShapeDtypeStruct((96, 64), np.float32, sharding=sharding)}
  try:
    out = ocp.PyTreeCheckpointer().restore(
        sys.argv[1], args=ocp.args.PyTreeRestore(
            item=target, restore_args={'w': ocp.ArrayRestoreArgs(sharding=sharding)},
            partial_restore=True))
  except Exception as e:  # pylint: disable=broad-except
    print(json.dumps({'error': type(e).__name__, 'message': str(e)[:2000]}))
    return
  print(json.dumps({'nonzero': int(np.count_nonzero(np.asarray(out['w'])))}))


if __name__ == '__main__':
  main()
