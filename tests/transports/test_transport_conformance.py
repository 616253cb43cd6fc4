"""Every transport passes the conformance suite (``support/conformance.py``).

One subclass per transport; a new transport adds one here (``docs/architecture.md``, "Adding a
transport"). ``local`` and ``colocated`` run for real (colocated Python runs in this process on
the CPU backend). ``persistence`` needs Pathways' persistence plugin, which only a Pathways
server runs: its subclass fakes only that plugin (``_compat.orbax.persistence_write_arrays``),
writing each array as the plugin does, one zarr directory per array under the item; the request
building, grouping, limit checks, records, fallback and restores are the transport's own.
"""

from __future__ import annotations

import concurrent.futures
import os

import jax
import numpy as np
import pytest
import tensorstore as ts

from orbax_pathways import options
from orbax_pathways._compat import orbax as compat

from support.conformance import TransportConformance

# An exception nobody could raise (a callback into a closed event loop) or a coroutine never
# awaited fails the test.
pytestmark = [pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning'),
              pytest.mark.filterwarnings('error:coroutine .* was never awaited:RuntimeWarning')]


class TestInProcess(TransportConformance):
  transport = 'in_process'


class TestColocated(TransportConformance):
  transport = 'colocated'


def fake_persistence_plugin(location, names, arrays, timeout):
  """What Pathways' plugin does with one bulk write request: each array written as a zarr (v2,
  uncompressed, one chunk per shard) directory ``location/name``, each distinct shard once.
  Returns a finished future, as the plugin's call returns one."""
  del timeout
  for name, arr in zip(names, arrays):
    shape = tuple(arr.shape)
    chunks = [max(1, c) for c in arr.sharding.shard_shape(shape)]
    t = ts.open({'driver': 'zarr', 'kvstore': {'driver': 'file', 'path': os.path.join(location, name)},
                 'dtype': np.dtype(arr.dtype).name,
                 'metadata': {'shape': list(shape), 'chunks': chunks, 'compressor': None}},
                create=True, open=True).result()
    if 0 in shape:
      continue
    for shard in arr.addressable_shards:
      if shard.replica_id == 0:
        t[shard.index].write(np.asarray(shard.data)).result()
  done: concurrent.futures.Future = concurrent.futures.Future()
  done.set_result(None)
  return done


class TestPersistence(TransportConformance):
  transport = 'persistence'
  restore_transport = 'colocated'  # restores read through colocated Python
  use_ocdbt = False  # the plugin cannot write OCDBT
  records_checksums = False  # the plugin computes no checksums
  counts_written_bytes = False  # the workers' byte counts stay on the workers
  fallback = 'colocated'
  refusals = {
      'ocdbt': ['the checkpoint uses OCDBT, which the persistence plugin cannot write'],
      'cast': ["SaveArgs.dtype casts requested for ['f'], which the plugin cannot do"],
      'dtypes': ["dtypes the plugin cannot store: ['h (float16)', 'm (bool)']"],
  }

  def fake(self, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, 'persistence_write_arrays', fake_persistence_plugin)


def test_every_registered_transport_runs_the_suite():
  """A transport added to ``options.TransportName`` without a subclass here fails this."""
  covered = {c.transport for c in TransportConformance.__subclasses__()}
  assert covered == set(options.TRANSPORTS), (covered, options.TRANSPORTS)
  assert jax.device_count() == 8
