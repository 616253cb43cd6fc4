"""Keys one restoring process reads to find the peers that hold the chunks it lacks, at 64, 1,024
and 16,384 simulated processes.

What runs: the package's own ``peer/exchange.Exchange`` (publish, ``gather``, ``holders``)
and ``peer/exchange.to_ask`` (which holders a reader lists), every simulated process publishing
into one in-memory key-value store with the semantics of jax's coordination service (set,
blocking get, directory get, delete). jax's service itself cannot hold 16,384 processes on this
machine; the store counts what a reader asks of it and the keys it gets back. No chunk moves:
the chunk lists and gets are the same whichever way the peers were found.

The case: a job of N processes (one writer each, ``tier_scope='written'``) restarts onto N - 1
after one node was lost; each process then restores a layout whose regions straddle two
writers' chunks (its own and its neighbour's), so a reader lacks the chunks of one surviving
writer, and (for process N - 2, the lost node's neighbour) one lost writer. Reported per reader:

- ``before``: the lookup without the index's writer column (every process's key, then a list
  from every peer that holds a usable entry: what a reader did before this change);
- ``survivor``: a reader that lacks only a surviving writer's chunks: one holder key, one list;
- ``lost``: a reader that also lacks the lost writer's chunks: that writer's holder keys are
  empty, and only every process's key (read once per restored item) tells lost from late.

Run: ``python benchmarks/peer_lookup.py`` (a few seconds; writes nothing).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

from orbax_pathways.peer import exchange

FLEETS = (64, 1024, 16384)


class FleetKV:
  """One key-value store for every simulated process (jax's service semantics: a set refuses
  to overwrite unless told, a directory get returns every key under the prefix). ``view(me)``
  is process ``me``'s client; only the reader's requests are counted."""

  def __init__(self) -> None:
    self.store: dict[str, str] = {}
    self.calls: collections.Counter[str] = collections.Counter()
    self.returned = 0
    self.counting = False

  def _count(self, kind: str, keys: int = 0) -> None:
    if self.counting:
      self.calls[kind] += 1
      self.returned += keys

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
    if not allow_overwrite and key in self.store:
      raise RuntimeError(f'ALREADY_EXISTS: {key}')
    self.store[key] = value
    self._count('set')

  def key_value_try_get(self, key: str) -> str:
    self._count('try_get', 1)
    if key not in self.store:
      raise RuntimeError(f'NOT_FOUND: {key}')
    return self.store[key]

  def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
    self._count('blocking_get', 1)
    if key not in self.store:  # every process published before the reader looks: never waits
      raise RuntimeError(f'DEADLINE_EXCEEDED: {key}')
    return self.store[key]

  def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
    found = [(k, v) for k, v in self.store.items() if k.startswith(prefix)]
    self._count('dir_get', len(found))
    return found

  def key_value_delete(self, key: str) -> None:
    for k in [k for k in self.store if k == key or k.startswith(key + '/')]:
      del self.store[k]


def _fleet(n: int) -> tuple[FleetKV, list[exchange.Exchange], str, dict[str, str]]:
  """N - 1 survivors of an N-process job, each holding its own writer's entry of one item, all
  published into one store. Writer ``p<n-1>``'s node is lost."""
  kv = FleetKV()
  item = f'/ckpt/{n}/1/default'
  save_ids = {f'p{w}': f'id{w}' for w in range(n)}
  exchanges, prefix = [], ''
  for me in range(n - 1):
    ex = exchange.Exchange(kv, me, n - 1, timeout_s=1.0)
    prefix = ex.prefix(item) if me == 0 else prefix
    ex.publish(prefix, f'10.0.{me // 256}.{me % 256}:7000', [(f'p{me}', f'id{me}')],
               holds={f'p{me}': [(f'p{me}', f'id{me}')]})
    exchanges.append(ex)
  return kv, exchanges, prefix, save_ids


def _measure(kv: FleetKV, fn) -> dict:
  kv.calls.clear()
  kv.returned = 0
  kv.counting = True
  t0 = time.perf_counter()
  lists = fn()
  took = time.perf_counter() - t0
  kv.counting = False
  return {'requests': sum(kv.calls.values()), 'keys_read': kv.returned, 'lists': lists,
          'ms': round(took * 1e3, 2)}


def run(n: int) -> dict:
  kv, exchanges, prefix, save_ids = _fleet(n)
  reader = exchanges[0]  # lacks writer p1's chunks (its neighbour, alive)
  edge = exchanges[n - 2]  # lacks p<n-2>'s neighbour p<n-1>'s chunks (lost) and p<n-3>'s

  def before():
    found, _ = reader.gather(prefix)
    return sum(1 for v in found.values()
               if any(save_ids.get(w) == s for w, s in v['entries']))

  def survivor():
    return len(exchange.to_ask(reader.holders(prefix, 'p1'), save_ids, reader.me)[:1])

  def lost():
    asked = len(exchange.to_ask(edge.holders(prefix, f'p{n - 3}'), save_ids, edge.me)[:1])
    if not exchange.to_ask(edge.holders(prefix, f'p{n - 1}'), save_ids, edge.me):
      edge.gather(prefix)  # is p<n-1> late or lost: every process's key, once
      asked += len(exchange.to_ask(edge.holders(prefix, f'p{n - 1}'), save_ids, edge.me)[:1])
    return asked

  return {'processes': n, 'before': _measure(kv, before), 'survivor': _measure(kv, survivor),
          'lost': _measure(kv, lost)}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--fleets', type=int, nargs='*', default=list(FLEETS))
  ap.add_argument('--json', action='store_true')
  args = ap.parse_args(argv)
  rows = [run(n) for n in args.fleets]
  if args.json:
    print(json.dumps(rows, indent=1))
    return 0
  print('| processes | before: keys read / requests / lists | survivor: keys / requests / lists '
        '| lost writer: keys / requests / lists |')
  print('|---:|---|---|---|')
  for r in rows:
    cells = [f"{r[k]['keys_read']:,} / {r[k]['requests']} / {r[k]['lists']:,}"
             for k in ('before', 'survivor', 'lost')]
    print(f"| {r['processes']:,} | " + ' | '.join(cells) + ' |')
  return 0


if __name__ == '__main__':
  sys.exit(main())
