"""Stock Orbax v1's partial saves in a fresh interpreter that never imports orbax_pathways (the
test sets ``ORBAX_PATHWAYS_DISABLE=1``), for ``tests/frontends/test_orbax_v1_partial.py``
(``test_stock_loads_our_partial_checkpoint_and_we_load_stocks``, ``procs.run_worker``).

    python -m support.workers.stock_v1_partial_worker OURS OUT_NPZ STOCK

Loads the partial checkpoint ``OURS`` (saved and finalized by orbax_pathways) with
``ocp.v1.load``; writes its 'a', 'b', 'c' leaves and 'opt.mu' (bfloat16, as uint16 bits) to
``OUT_NPZ``; then saves two stock partial saves at ``STOCK`` and finalizes them.
"""

from __future__ import annotations

import sys


def main() -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  ours, npz, p = sys.argv[1:4]
  out = ocp.v1.load(ours)
  assert 'orbax_pathways' not in sys.modules
  assert sorted(out) == ['a', 'b', 'c', 'opt'], sorted(out)
  np.savez(npz, a=np.asarray(out['a']), b=np.asarray(out['b']), c=np.asarray(out['c']),
           mu=np.asarray(out['opt']['mu']).view(np.uint16))
  ocp.v1.partial.save(p, {'x': np.arange(10.0)})
  ocp.v1.partial.save(p, {'y': np.arange(6, dtype=np.int32).reshape(2, 3)})
  ocp.v1.partial.finalize(p)


if __name__ == '__main__':
  main()
