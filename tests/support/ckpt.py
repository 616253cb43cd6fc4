"""The library's install state around a block, and saves with unchanged CheckpointManager code.

Tests compare orbax_pathways with stock Orbax and with non-default ``Options`` in one process; the
autouse fixture in ``tests/conftest.py`` puts the default install back after every test, and these
helpers put it back at the end of their block, so a test can go on with the defaults.
``assert_stock_reads_same`` restores in a fresh interpreter that never imports orbax_pathways.
"""

from __future__ import annotations

import contextlib

import orbax.checkpoint as ocp

import orbax_pathways
from support import procs
from support.workers import stock_reads_same_worker


def install_defaults() -> None:
  """What ``import orbax_pathways`` installs (options from the environment)."""
  orbax_pathways.install(orbax_pathways.Options.from_env())


@contextlib.contextmanager
def options(**kwargs):
  """orbax_pathways installed with ``Options(**kwargs)`` inside the block (yields the handler);
  the defaults after it."""
  handler = orbax_pathways.install(orbax_pathways.Options(**kwargs))
  try:
    yield handler
  finally:
    install_defaults()


@contextlib.contextmanager
def stock_orbax():
  """Stock Orbax inside the block (orbax_pathways uninstalled); the defaults after it."""
  orbax_pathways.uninstall()
  try:
    yield
  finally:
    install_defaults()


def save(directory, state, step: int = 0, **manager_kwargs) -> None:
  """Saves ``state`` as ``step`` with a CheckpointManager on ``directory`` and waits for it."""
  with ocp.CheckpointManager(directory, **manager_kwargs) as mngr:
    mngr.save(step, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()


def save_tier_entry(tier, root, state, step: int = 1):
  """Installs ``Options(tier_dir=tier, coalesce_bytes=0)`` (small arrays chunked per shard),
  saves ``state`` as ``step`` of ``root`` and waits for its node-local tier copy; returns that
  copy's one entry (``tier/store.Entry``). The install stays for the rest of the test (the
  autouse fixture puts the defaults back)."""
  from orbax_pathways.tier import store as tier_store  # pylint: disable=g-import-not-at-top
  orbax_pathways.install(orbax_pathways.Options(tier_dir=str(tier), coalesce_bytes=0))
  save(root, state, step)
  tier_store.flush()
  (entry,) = tier_store.entries(str(tier), str(root))
  return entry


def save_with_options(directory, state, step: int = 0, **kwargs) -> None:
  """``save`` under ``Options(**kwargs)``, then the default options again."""
  with options(**kwargs):
    save(directory, state, step)


def assert_stock_reads_same(dir_a, dir_b, step: int = 0) -> None:
  """Stock Orbax, in a fresh interpreter that never imports orbax_pathways, restores ``step``
  of both checkpoint directories to identical leaves."""
  procs.run_worker(stock_reads_same_worker, dir_a, dir_b, step)


def drop_host_leaf_records(item) -> None:
  """Deletes an item's numpy and scalar leaf records and re-merges its index from the arrays'
  records alone: the item as a step saved by Orbax's own host-leaf handlers (or by a version
  that did not record them) looks. Caches cleared, so the next read sees it."""
  from orbax_pathways.format import records as records_lib  # pylint: disable=g-import-not-at-top
  from orbax_pathways.storage import index as index_lib  # pylint: disable=g-import-not-at-top
  from orbax_pathways.storage import meta_io  # pylint: disable=g-import-not-at-top
  for f in (item / records_lib.DIRNAME).glob('*.msgpack'):
    if f.name.startswith(('numpy.', 'scalar.', 'index.')):
      f.unlink()
  index_lib.merge_item(item)  # the index of the arrays' records only
  meta_io.clear_cache()
