#!/usr/bin/env python3
"""What one process asks of jax's key-value store to resume from node steps and to agree on a
preemption step, at 64, 1,024 and 16,384 simulated processes.

What runs: the package's own agreements, unchanged: ``multitier/node_round.agreed`` (the node
steps every node holds) and ``multitier/resume.all_processes_ok`` (every process restored
the step) — the two rounds of a resume from node steps — and
``preemption/decision._kv_agreement`` (every ``agreement_interval`` steps with jax's preemption
service off), against jax's real coordination service (its service and a client of this
process's own on 127.0.0.1, with the job simulated around it: ``tests/support/kv_fleet.py``).
The process under test plays process ``me`` of ``N``; the other ``N - 1`` cannot
run here, so their keys are written into the same service before the process under test first
touches a round (uncounted), and, when ``me`` is not the leader, the leader's verdict too.
Every call of the process under test is counted, with the values the service sent back.

A local-only save on the nodes is not here: it makes no key-value call at all, at any fleet
size (its manager is this process's alone; ``tests/tier/test_node_steps.py`` counts 0 calls
on every process of a 4-process job).

``gathered by all`` is the same round as every member gathering everyone's values (a
``coord.rounds.Round`` publish and gather on each process), the way the preemption and resume
agreements ran before ``coord.rounds.agree``: run side by side for the ratio.

Run: ``python benchmarks/agreement_scale.py [--fleets 64,1024,16384] [--json-out F]``
(about a minute on 2 cores; writes nothing else).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import types
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'tests'))
from support import kv_fleet  # pylint: disable=g-import-not-at-top,wrong-import-position

FLEETS = (64, 1024, 16384)


def _cases() -> dict[str, tuple[Callable[[str, int | None], str], Callable[[int], Any]]]:
  from orbax_pathways.coord import agreement  # pylint: disable=g-import-not-at-top
  from orbax_pathways.coord import rounds  # pylint: disable=g-import-not-at-top
  from orbax_pathways.multitier import node_round  # pylint: disable=g-import-not-at-top
  from orbax_pathways.plan import node_verdict  # pylint: disable=g-import-not-at-top
  from orbax_pathways.preemption import decision  # pylint: disable=g-import-not-at-top
  from orbax_pathways.multitier import resume as recovery  # pylint: disable=g-import-not-at-top
  from orbax_pathways.coord import participants  # pylint: disable=g-import-not-at-top
  from orbax_pathways._compat import jax_distributed  # pylint: disable=g-import-not-at-top
  from orbax_pathways._compat import orbax_manager_state as _oms  # pylint: disable=g-import-not-at-top
  agreement.configure(agreement.Agreement(timeout_s=60.0))
  mngr = types.SimpleNamespace(directory='/nonexistent/agreement_scale')

  options = types.SimpleNamespace(tier_dir=None, tier_peer_timeout_s=60.0)

  def resume(n: int) -> Any:
    steps = node_round.agreed(mngr, options, [9, 7], {}, timeout_s=60.0)
    return steps, recovery.all_processes_ok(mngr, True, 9)

  def resume_values(rnd: str, p: int | None) -> str:
    if 'node_steps' not in rnd:  # the step restored: every process did
      return '1'
    return (node_verdict.holdings(p, [9, 7], {}, '') if p is not None  # every node holds 9 and 7
            else json.dumps({'steps': [9, 7], 'fetch': {}}))

  # Onto another layout: a job of n processes restarting from node step 9 that 2n processes
  # saved (half its nodes lost; each live node holds its own part and its partner's copy).
  saved_by: dict[str, int] = {}

  def elastic_member(p: int, n: int) -> str:
    return node_verdict.holdings(p, [9], {p + n: [9]}, f'10.0.{p // 256}.{p % 256}:4000',
                               parts={9: [p, p + n]}, counts={9: 2 * n})

  def elastic_values(rnd: str, p: int | None) -> str:
    n = saved_by['n']
    if 'node_steps' not in rnd:
      return '1'
    if p is not None:
      return elastic_member(p, n)
    return node_verdict.decide([elastic_member(q, n) for q in range(n)])

  def elastic(n: int) -> Any:
    saved_by['n'] = n
    me = _oms.process_index()
    # No tier here (so no server, and no part keys published): the round alone. A process
    # restoring reads one key per part its node lacks (node_gather), whatever the fleet.
    return (node_round.agreed(
        mngr, options, [9], {me + n: [9]}, timeout_s=60.0, parts={9: [me, me + n]},
        counts={9: 2 * n}), recovery.all_processes_ok(mngr, True, 9))

  def preemption(n: int) -> Any:
    return decision._kv_agreement(  # pylint: disable=protected-access
        1000 + 2 * n + _oms.process_index(), participants.Participants(None, 0),
        decision.Agreement(interval=1, timeout_s=60.0))

  def gathered_by_all(n: int) -> Any:
    client = jax_distributed.distributed_client()
    me = _oms.process_index()
    out = []
    for name in ('node_steps_all', 'resume_all'):  # the resume's two rounds
      rnd = rounds.Round(client, rounds.round_key(f'bench/{name}/{me}', n), me=me,
                         members=range(n), count=n, what='orbax_pathways: benchmark')
      rnd.publish('1')
      out.append(len(rnd.gather(60.0)))
    return out

  return {'resume (2 rounds)': (resume_values, resume),
          'resume onto another layout': (elastic_values, elastic),
          'preemption agreement': (lambda rnd, p: '0', preemption),
          'resume, gathered by all': (lambda rnd, p: '1', gathered_by_all)}


def run(fleets: tuple[int, ...]) -> list[dict]:
  from orbax_pathways.preemption import decision  # pylint: disable=g-import-not-at-top
  with kv_fleet.Service() as service:
    return _rows(service.client, fleets, decision)


def _rows(client: Any, fleets: tuple[int, ...], decision: Any) -> list[dict]:
  rows = []
  for name, (value, fn) in _cases().items():
    for n in fleets:
      for role, me in (('member', 1), ('leader', 0)):
        fleet = kv_fleet.Fleet(client, me, n, value,
                               verdict=None if me == 0 else functools.partial(value, p=None))
        kv_fleet.as_process(fleet)
        decision.reset()  # no answer of an earlier case remembered
        began = time.perf_counter()
        fn(n)
        rows.append({'case': name, 'n': n, 'role': role, 'requests': sum(fleet.calls.values()),
                     'values_read': fleet.values_read, 'bytes_read': fleet.bytes_read,
                     'calls': dict(fleet.calls),
                     'seconds': round(time.perf_counter() - began - fleet.fill_s, 4)})
  return rows


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--fleets', default=','.join(map(str, FLEETS)))
  ap.add_argument('--json-out')
  a = ap.parse_args(argv)
  rows = run(tuple(int(x) for x in a.fleets.split(',')))
  print(f'{"case":26} {"N":>6} {"role":7} {"requests":>8} {"values read":>11} '
        f'{"bytes read":>11} {"s":>7}')
  for r in rows:
    print(f'{r["case"]:26} {r["n"]:>6} {r["role"]:7} {r["requests"]:>8} '
          f'{r["values_read"]:>11} {r["bytes_read"]:>11} {r["seconds"]:>7.3f}')
  if a.json_out:
    with open(a.json_out, 'w') as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
