"""Orbax's ``jax.monitoring`` telemetry (what dashboards are built on) is recorded with the
package installed as without it: every metric stock's save and restore record, by name."""

import json

from support import procs
from support.workers import metrics_probe_worker


def _names(path, ours):
  out = procs.run_worker(metrics_probe_worker, 'ours' if ours else 'stock', path,
                         env={} if ours else {'ORBAX_PATHWAYS_DISABLE': '1'})
  return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_every_orbax_metric_stock_records_is_recorded(tmp_path):
  stock = _names(tmp_path / 'stock', False)
  ours = _names(tmp_path / 'ours', True)
  assert '/jax/orbax/write/worker/io/requested/gbytes' in stock  # the probe sees stock's metrics
  assert stock - ours == set(), sorted(stock - ours)
