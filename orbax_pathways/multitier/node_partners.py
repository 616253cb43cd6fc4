"""Partner copies of node steps (``Options.local_copies=2``), the multi-controller side: which
process keeps this process's copies, the copy sent after each node save, the copies a node
keeps, and a copy fetched back at a resume (the bytes move in ``fleet/node_copy.py``).

Who calls what, on which host (every process of a job with node steps and two copies):

- ``copy_to_partner``: ``multitier/local_steps.py``'s background thread of a node step, once
  saved;
- ``copies_held`` and ``fetch``: ``node_steps.resume``, before and after the round that decides
  which steps every process can restore.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any
import weakref

import jax

from orbax_pathways._compat import jax_distributed
from orbax_pathways._compat import orbax_manager_state as _oms
from orbax_pathways._util import said
from orbax_pathways.coord import rounds
from orbax_pathways.fleet import node_copy
from orbax_pathways.fleet import partner_copy
from orbax_pathways.fleet import partners
from orbax_pathways.multitier import node_layout
from orbax_pathways.peer import exchange
from orbax_pathways.sharding import layout
from orbax_pathways.tier import fsafe

log = logging.getLogger('orbax_pathways')


class _Partners:
  """This process's partner per manager (worked out once: it walks every device), the address
  of its server per key-value client (read once per job, read again after a copy failed), and
  the partners a copy already failed to."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.of: 'weakref.WeakKeyDictionary[Any, int | None]' = weakref.WeakKeyDictionary()
    self.addresses: dict[tuple[int, int], str] = {}
    self.failed: set[int] = set()


_partners = _Partners()


def partner(mngr: Any, options: Any) -> int | None:
  """The process of another slice that keeps this process's copies of ``mngr``'s node steps
  (``fleet/partners.py``, among the manager's processes), or None (one process, one slice,
  ``Options.local_copies`` < 2). Worked out at the manager's first copy, not at every save."""
  n = jax_distributed.process_count()
  if getattr(options, 'local_copies', 1) < 2 or n < 2:
    return None
  with _partners.lock:
    if mngr in _partners.of:
      return _partners.of[mngr]
  found = _partner_of(mngr, options, n)
  with _partners.lock:
    _partners.of[mngr] = found
  return found


def _partner_of(mngr: Any, options: Any, n: int) -> int | None:
  part = _oms.manager_participants(mngr)
  slices = layout.slice_of_processes(jax.devices(), num_slices=options.num_slices)
  slices = {p: s for p, s in slices.items() if part.includes(p, n)}
  me = _oms.process_index()
  if me not in slices:
    return None
  found = partners.partner_of(me, slices)
  if found is None:
    said.once(logging.WARNING, ('node-steps-no-partner',),
              'orbax_pathways: Options.local_copies=2, but every process is in one slice: node '
              'steps keep one copy. Set ORBAX_PATHWAYS_NUM_SLICES (Options.num_slices) if the '
              'platform does not tell the slices apart.')
  return found


def copy_to_partner(mngr: Any, options: Any, step: int, keep: int) -> bool:
  """Sends this process's node step ``step`` of ``mngr`` to its partner's node
  (``fleet/node_copy.send``), on the node step's background thread once its save ended; one
  warning per partner when it cannot (the step keeps one copy). Whether the copy landed. The
  first copy of a job starts this process's server, which takes its own partner's copies
  (``partner_copy.ready``: the job's secret and this server's address, one key-value request
  each per job), and reads its partner's address (one more); later copies ask nothing of the
  key-value store."""
  to = partner(mngr, options)
  client = jax_distributed.distributed_client()
  cfg = node_layout.tier(options, mngr)
  if to is None or client is None or cfg is None:
    return False
  me, timeout_s = _oms.process_index(), options.tier_peer_timeout_s
  step_dir = os.path.join(node_layout.directory(mngr, cfg.tier_dir), str(step))
  try:
    partner_copy.ready(cfg, client, me, timeout_s)
    key = (id(client), to)
    with _partners.lock:
      address = _partners.addresses.get(key)
    if address is None:
      address = str(rounds.wait_for(client, rounds.partner_address_key(to), timeout_s))
    why = node_copy.send(step_dir, node_layout.digest_of(mngr), node_copy.writer_name(me), step,
                         node_layout.kept(keep), address, exchange.cached_secret() or b'',
                         timeout_s)
  except Exception as e:  # pylint: disable=broad-except  (a copy never fails training)
    address, why = None, f'{type(e).__name__}: {e}'
  with _partners.lock:
    if why is None and address is not None:
      _partners.addresses[(id(client), to)] = address
      return True
    _partners.addresses.pop((id(client), to), None)
    first = to not in _partners.failed
    _partners.failed.add(to)
  log.log(logging.WARNING if first else logging.INFO,
          'orbax_pathways: the partner copy of node step %d of %s (to process %d) was not made: '
          '%s. The step keeps one copy, this node\'s.%s', step, mngr.directory, to, why,
          ' Later failures to that partner are logged at INFO.' if first else '')
  return False


def copies_held(root: str, digest: str, newest_storage: int | None) -> dict[int, list[int]]:
  """process -> the steps newer than ``newest_storage`` of which this node keeps a copy."""
  base = node_layout.copies_dir(root, digest)
  out: dict[int, list[int]] = {}
  for writer in fsafe.subdirs(base):
    if writer[1:].isdigit() and writer.startswith('p'):
      steps = [int(n) for n in fsafe.subdirs(os.path.join(base, writer)) if n.isdigit()]
      steps = [s for s in steps if newest_storage is None or s > newest_storage]
      if steps:
        out[int(writer[1:])] = sorted(steps, reverse=True)
  return out


def fetch(mngr: Any, options: Any, root: str, step: int, keeper: tuple[int, str],
          timeout_s: float) -> None:
  """This process's copy of node step ``step`` from ``keeper`` (process, address) into its
  node (a step of another process's saving there first removed); raises why not."""
  client = jax_distributed.distributed_client()
  secret = exchange.job_secret(client, timeout_s)
  into = os.path.join(node_layout.directory(mngr, root), str(step))
  fsafe.remove_tree(into)
  why = node_copy.fetch(keeper[1], secret, node_layout.digest_of(mngr),
                        node_copy.writer_name(_oms.process_index()), step, into,
                        options.tier_peer_timeout_s)
  if why is not None:
    raise RuntimeError(f'orbax_pathways: this process\'s copy of node step {step} could not be '
                       f'fetched from process {keeper[0]} ({keeper[1]}): {why}')
  log.info('orbax_pathways.preemption.resume: node step %d fetched from the copy process %d '
           'keeps (this node did not hold it).', step, keeper[0])


def drop_copies(root: str, digest: str, copies: dict[int, list[int]], above: int | None) -> None:
  """Removes this node's copies of ``copies`` newer than ``above`` (the step a resume chose;
  None: all): a rolled-back run's."""
  base = node_layout.copies_dir(root, digest)
  for q, steps in copies.items():
    for s in steps:
      if above is None or s > above:
        fsafe.remove_tree(os.path.join(base, node_copy.writer_name(q), str(s)))
