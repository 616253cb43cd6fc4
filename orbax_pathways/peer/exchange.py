"""Who holds what of the node-local tiers, through jax's key-value store: the job's peer secret,
and per restored item each process's server address and entries, and its holder keys.

Who calls what, on which host (multi-controller JAX, every process):

- ``transports/in_process.read`` makes an ``Exchange`` per restore (jax's key-value client, this
  process's index, the process count, ``Options.tier_peer_timeout_s``) and reads the job's
  secret through it (``Exchange.secret`` -> ``job_secret``: once per process, then cached), then
  hands it to ``fleet/chain.for_restore``, which calls ``peer/server.serve`` (starts this
  process's server once, with that secret: ``cached_secret``) and ``Exchange.publish`` (one
  holder key per writer whose chunks this node's usable entries hold, by the index's writer
  column, then one key: this server's address and the (writer, save id) of the entries this
  node holds of the item that the committed index records).
- The restore's peer source (``peer/client.PeerSource``, in the chain) reads a writer's holder
  keys (``Exchange.holders``: one directory read per writer and restore) and asks them in
  ``to_ask``'s order. A writer without a holder key sends it to every process's key once
  (``Exchange.gather``, one deadline for all): lost, or late? An index without the writer
  column, and the relay (``fleet/relay.py``: who is live), take that full look at once.

What grows with what: each process publishes one key per restored item, of constant size in
the fleet (its address and the save ids of the entries its node holds, one per writer on the
node), one holder key per writer whose chunks it holds, and reads the job's secret once in its
life. A reader reads one holder key per writer whose chunks it lacks; only a writer that no
survivor holds (or an index without the column, or the relay) costs one read of every
process's key. The per-chunk lists are never in the key-value store (they travel over the
peer channel: ``peer/client.py``). Keys of the restore before last are deleted by their
publisher (holder keys: the directory, by every process). ``lookup_counts`` says what this
process's restores read.

No jax here: the key-value client arrives as an object with ``key_value_set`` (which refuses
to overwrite a key), ``blocking_key_value_get``, ``key_value_try_get``, ``key_value_delete``
and, where it has one, ``key_value_dir_get`` (every key already published, in one request).
"""

from __future__ import annotations

import collections
import hashlib
import json
import secrets
import threading
from typing import Any, Iterable, Mapping

from orbax_pathways.coord import rounds
from orbax_pathways.peer import wire


# ---- the job's secret: one per job, through jax's key-value store ------------------------------

SECRET_KEY = rounds.SECRET_KEY
_secret: tuple[Any, bytes] | None = None  # (the key-value client it was read through, secret)
_secret_lock = threading.Lock()


def cached_secret() -> bytes | None:
  """The secret this process last read (``job_secret``), or None: what ``peer/server.serve``
  serves with when it is given none."""
  with _secret_lock:
    return _secret[1] if _secret is not None else None


def job_secret(client: Any, timeout_s: float) -> bytes:
  """The job's 32-byte peer secret: read once per process (and key-value client) and kept for
  the process's life. The first process to get here creates it (``secrets.token_bytes``) and
  publishes it with set-if-absent semantics (jax's ``key_value_set`` refuses to overwrite a
  key); one that loses the race reads the winner's. So: one read (or one write, or a write and
  a read) per process for the whole job, whatever the fleet, and no process waits for another
  to restore. ``wire.PeerError`` if the store cannot give one within ``timeout_s``."""
  global _secret
  with _secret_lock:
    if _secret is not None and _secret[0] is client:
      return _secret[1]
    raw = rounds.try_read(client, SECRET_KEY)
    if not raw:
      mine = secrets.token_bytes(wire.SECRET_BYTES).hex()
      try:
        rounds.put(client, SECRET_KEY, mine, overwrite=False)
        raw = mine
      except Exception:  # pylint: disable=broad-except  (ALREADY_EXISTS: another process won)
        try:
          raw = rounds.wait_for(client, SECRET_KEY, timeout_s)
        except Exception as e:  # pylint: disable=broad-except
          raise wire.PeerError(f'the job\'s peer secret ({SECRET_KEY!r} in jax\'s key-value store) '
                               f'could not be published or read within {timeout_s:g} s: '
                               f'{type(e).__name__}: {e}') from e
    try:
      value = bytes.fromhex(raw)
    except (TypeError, ValueError):
      value = b''
    if len(value) != wire.SECRET_BYTES:
      raise wire.PeerError(f'the job\'s peer secret ({SECRET_KEY!r} in jax\'s key-value store) is '
                           f'not {wire.SECRET_BYTES} hex-encoded bytes; something else wrote '
                           'that key')
    _secret = (client, value)
    return value


# ---- the key-value exchange: who serves what, per restored item ---------------------------------

HOLDERS = 'h'  # beside a round, its holder keys: <round>.h/<writer>/<process>

# What this process's restores asked of the exchange since it started (``lookup_counts``).
counts: collections.Counter[str] = collections.Counter()


def lookup_counts() -> dict[str, int]:
  """The peer lookups of this process's restores since it started: ``gathers`` (reads of every
  process's key of a restore: once per restored item that needed a writer with no holder, or
  whose index has no writer column), ``holder_reads`` (directory reads of one writer's
  holders), ``keys_read`` (the keys those returned) and ``lists`` (chunk lists asked of
  peers)."""
  return dict(counts)


def to_ask(holders: Mapping[int, Mapping[str, Any]], save_ids: Mapping[str, str],
           me: int) -> list[int]:
  """The processes to ask for one writer's chunks, in order: those whose holder key names an
  entry (its writer, its save id) that the committed index records (``save_ids``: writer ->
  committed save id), never this process. Pure."""
  return sorted(p for p, v in holders.items()
                if p != me and any(len(e) == 2 and save_ids.get(e[0]) == e[1]
                                   for e in v['entries']))


def _name(item_dir: str) -> str:
  """The rounds' name of one restored item: every process restores the same items."""
  return f'tier_peers/{hashlib.sha256(item_dir.encode()).hexdigest()[:16]}'


class Exchange:
  """One restore's view of the other processes, through jax's key-value store (one round per
  restored item: ``coord/rounds.py``). Made by the in-process transport (every process, every
  restore); ``publish`` once per item."""

  def __init__(self, client: Any, process_index: int, process_count: int, timeout_s: float):
    self.client = client
    self.me = process_index
    self.count = process_count
    self.timeout_s = timeout_s
    self._sequences: dict[str, rounds.Sequence] = {}  # a round's key -> its item's sequence

  def secret(self) -> bytes:
    """The job's peer secret (``job_secret``: read once per process, then cached)."""
    return job_secret(self.client, self.timeout_s)

  def prefix(self, item_dir: str) -> str:
    """The key of this restore's round for ``item_dir`` (one per call). Every process numbers
    its restores of one item alike (multi-controller JAX restores the same items everywhere)."""
    seq = rounds.sequence(_name(item_dir), keep=2)
    key = seq.next()
    self._sequences[key] = seq
    return key

  def _round(self, prefix: str) -> rounds.Round:
    return rounds.Round(self.client, prefix, me=self.me, members=range(self.count),
                        count=self.count, what=f'orbax_pathways: the tier peers of {prefix}')

  def publish(self, prefix: str, address: str, held: Iterable[tuple[str, str]],
              holds: Mapping[str, Iterable[tuple[str, str]]] | None = None) -> None:
    """Publishes, under ``prefix``, this process's server and the (writer, save id) of the
    entries its node holds of the item, and first, for each writer whose chunks those entries
    hold (``holds``: writer -> the entries holding its chunks; by the committed index's writer
    column), one holder key (``<round>.h/<writer>/<me>``) that readers lacking that writer's chunks
    read instead of every process's key. Then deletes its own keys of the restore before last
    (every process is past it: nobody reads them now)."""
    rnd = self._round(prefix)
    for writer, entries in sorted((holds or {}).items()):
      if wire.PART_RE.match(writer):
        rnd.publish_at(f'{HOLDERS}/{writer}', json.dumps(
            {'addr': address, 'entries': sorted(set(map(tuple, entries)))}))
    value = json.dumps({'addr': address, 'entries': sorted(set(map(tuple, held)))})
    rnd.publish(value, overwrite=False)
    seq = self._sequences.get(prefix)
    if seq is not None:
      seq.retire(self.client, self.me, whole=False, subdirs=(HOLDERS,))

  def holders(self, prefix: str, writer: str) -> dict[int, dict[str, Any]]:
    """The processes that published, under ``prefix``, a holder key for ``writer`` (one
    directory read: the holders of that writer's chunks, not the fleet), by process index."""
    if not wire.PART_RE.match(writer):
      return {}
    found = {}
    for p, raw in self._round(prefix).listing(f'{HOLDERS}/{writer}').items():
      try:
        v = json.loads(raw)
        found[p] = {'addr': str(v['addr']), 'entries': [tuple(e) for e in v['entries']]}
      except (ValueError, KeyError, TypeError):  # not what a peer publishes
        pass
    counts['keys_read'] += len(found)
    counts['holder_reads'] += 1
    return found

  def gather(self, prefix: str) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """The other processes' published values (one deadline for all, in total: a restore reads
    storage rather than wait longer), and the processes whose key did not appear in time. One
    request for every key already there (a directory read of the round), then one blocking
    read per process still missing."""
    others = [p for p in range(self.count) if p != self.me]
    got = self._round(prefix).gather(self.timeout_s, processes=others, on_silence=False,
                                     missing_ok=True)
    counts['gathers'] += 1
    counts['keys_read'] += len(got)
    found: dict[int, dict[str, Any]] = {}
    for p, raw in got.items():
      try:
        found[p] = json.loads(raw)
      except ValueError:  # not what a peer publishes: treated as not published
        pass
    return found, [p for p in others if p not in found]
