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

from orbax_pathways._compat import orbax as compat

from support.conformance import TransportConformance

# An exception nobody could raise (a callback into a closed event loop) or a coroutine never
# awaited fails the test (issue 26, item 13).
pytestmark = [pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning'),
              pytest.mark.filterwarnings('error:coroutine .* was never awaited:RuntimeWarning')]


class TestLocal(TransportConformance):
  transport = 'local'


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

  # Found by this suite, left for a fix in the package (strict: each entry goes once fixed).
  # 1. With Orbax's default ArrayMetadata store a persistence save never commits: the v0 front
  #    door writes no ArrayMetadata when the transport's layouts are not exact
  #    (frontends/orbax_v0.py, ``write_mds``), and Orbax's commit requires one per process.
  # 2. With 1 changed, three more still fail: the plugin's writes (after ``await ready()``)
  #    meet Orbax still creating or renaming the item directory ('File exists:
  #    .../default.orbax-checkpoint-tmp', a vanished '.zarray.__lock').
  _NO_ARRAY_METADATA = ("a persistence save does not commit: Orbax's commit finds no "
                        'ArrayMetadata for process_index=0 (frontends/orbax_v0.py writes none '
                        'when layouts_exact is False)')
  _AND_THE_ITEM_DIRECTORY = (_NO_ARRAY_METADATA + '; then the plugin writes race the item '
                             "directory's creation (File exists: default.orbax-checkpoint-tmp)")
  known_failures = {
      'test_every_dtype_round_trips_with_and_without_a_target': _NO_ARRAY_METADATA,
      'test_every_sharding_kind_round_trips_and_is_written_once': _NO_ARRAY_METADATA,
      'test_stats_and_the_info_line_name_the_transport': _NO_ARRAY_METADATA,
      'test_restores_onto_fewer_and_more_devices': _AND_THE_ITEM_DIRECTORY,
      'test_checksums_are_recorded_and_a_flipped_byte_is_caught': _AND_THE_ITEM_DIRECTORY,
      'test_stock_orbax_reads_the_tree': _AND_THE_ITEM_DIRECTORY,
  }

  def fake(self, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, 'persistence_write_arrays', fake_persistence_plugin)


def test_every_registered_transport_runs_the_suite():
  """A transport added to the registry without a subclass here fails this."""
  from orbax_pathways.transports import registry  # pylint: disable=g-import-not-at-top
  covered = {c.transport for c in TransportConformance.__subclasses__()}
  assert covered == set(registry.NAMES), (covered, registry.NAMES)
  assert jax.device_count() == 8
