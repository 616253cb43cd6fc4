"""Stock Orbax v1 in a fresh interpreter that never imports orbax_pathways (the test sets
``ORBAX_PATHWAYS_DISABLE=1``), for ``tests/frontends/test_orbax_v1.py``
(``test_stock_v1_reads_ours_and_we_read_stock_v1``, ``procs.run_worker``).

    python -m support.workers.stock_v1_worker OURS OUT_NPZ SCALARS_JSON STOCK

Loads the checkpoint ``OURS`` (saved by orbax_pathways) with ``ocp.v1.load``; writes its 'w',
'loader' and 'rng' leaves to ``OUT_NPZ`` and its 'step', 'lr' and 'ema' scalars to
``SCALARS_JSON``; then saves a stock v1 checkpoint of numpy and scalar leaves at ``STOCK``.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  ours, npz, scalars, stock = sys.argv[1:5]
  out = ocp.v1.load(ours)
  assert 'orbax_pathways' not in sys.modules
  np.savez(npz, w=np.asarray(out['w']), loader=out['loader'], rng=out['rng'])
  with open(scalars, 'w') as f:
    print(json.dumps({k: out[k] for k in ('step', 'lr', 'ema')}), file=f)
  ocp.v1.save(stock, {'x': np.arange(10.0), 'step': 3, 'lr': 0.5})


if __name__ == '__main__':
  main()
