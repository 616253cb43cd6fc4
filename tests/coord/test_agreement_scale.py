"""What a process asks of jax's real coordination service per agreement, at 4, 64 and 1,024
simulated processes (``benchmarks/agreement_scale.py`` in a process of its own: it starts
``jax.distributed`` there). A member's requests and the values it reads stay the same at every
size; only the leader reads one value per member. ``test_rounds.py`` covers late and silent
members, on the same real service (``support/kv_fleet.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support import procs

BENCH = os.path.join(os.path.dirname(__file__), '..', '..', 'benchmarks', 'agreement_scale.py')
FLEETS = (4, 64, 1024)


def test_a_members_requests_do_not_grow_with_the_fleet_on_the_real_service(tmp_path):
  out = tmp_path / 'rows.json'
  r = subprocess.run([sys.executable, BENCH, '--fleets', ','.join(map(str, FLEETS)),
                      '--json-out', str(out)], capture_output=True, text=True, timeout=600,
                     env=procs.child_env(), check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = {(row['case'], row['role'], row['n']): row for row in json.loads(out.read_text())}
  for n in FLEETS:
    # Two rounds (the node steps every process can restore, the step restored): a member
    # publishes and reads the verdict in each.
    member = rows[('resume (2 rounds)', 'member', n)]
    assert (member['requests'], member['values_read']) == (4, 2), member
    leader = rows[('resume (2 rounds)', 'leader', n)]
    assert leader['requests'] <= 6 and leader['values_read'] == 2 * (n - 1), leader
    # Onto another layout (a step twice as many processes saved): the verdict a member reads
    # is the same size at every fleet (who holds which part is published beside the round).
    member = rows[('resume onto another layout', 'member', n)]
    assert (member['requests'], member['values_read']) == (4, 2), member
    assert member['bytes_read'] == rows[('resume onto another layout', 'member', 4)]['bytes_read']
    member = rows[('preemption agreement', 'member', n)]
    assert (member['requests'], member['values_read']) == (2, 1), member
    leader = rows[('preemption agreement', 'leader', n)]
    assert leader['requests'] <= 3 and leader['values_read'] == n - 1, leader
    # The same rounds gathered by every member, as before: each reads every value.
    every = rows[('resume, gathered by all', 'member', n)]
    assert every['values_read'] >= 2 * (n - 1), every
