"""The leader's verdict of the node steps round (``plan/node_verdict.decide``, pure): which
steps every process can restore, from its own node, from the copy a partner keeps, or onto the
current layout from the parts the live nodes hold, and who fetches what from whom."""

from __future__ import annotations

import json

from orbax_pathways.plan import node_verdict


def _verdict(*values: str) -> dict:
  return json.loads(node_verdict.decide(list(values)))


def test_steps_every_node_holds_need_no_fetch():
  v = _verdict(node_verdict.holdings(0, [7, 9], {}, ''), node_verdict.holdings(1, [9, 7], {}, ''))
  assert v == {'steps': [9, 7], 'fetch': {}, 'elastic': {}}


def test_a_lost_nodes_part_comes_from_the_copy_its_partner_keeps():
  """Process 1's node is new (it holds nothing); process 2 keeps its copies of 9 and 7, but
  nobody keeps process 0's copy of 5: 9 and 7 can be restored (process 1 fetching from process
  2's server), 5 cannot."""
  v = _verdict(node_verdict.holdings(0, [9, 7, 5], {}, ''),
               node_verdict.holdings(1, [], {}, ''),
               node_verdict.holdings(2, [9, 7, 5], {1: [9, 7]}, '10.0.0.3:4000'))
  assert v == {'steps': [9, 7], 'fetch': {'9': {'1': [2, '10.0.0.3:4000']},
                                          '7': {'1': [2, '10.0.0.3:4000']}},
               'elastic': {}}


def test_a_copy_whose_keeper_serves_nothing_is_not_counted():
  """A copy offered without a server address (its node could not serve it), or a process's
  copy of its own step, does not make a step restorable."""
  v = _verdict(node_verdict.holdings(0, [9], {1: [9]}, ''),
               node_verdict.holdings(1, [], {1: [9]}, '10.0.0.2:1'))
  assert v == {'steps': [], 'fetch': {}, 'elastic': {}}


def test_a_step_another_process_saved_on_a_members_node_counts_after_its_own_and_copies():
  """Process 1 runs on a node process 2 saved 9 and 7 on (a restart onto fewer processes): 9 is
  restorable, process 1 restoring that node's step, no fetch; where a copy of process 1's own
  step is kept (7), it is fetched instead."""
  v = _verdict(node_verdict.holdings(0, [9, 7], {}, ''),
               node_verdict.holdings(1, [], {}, '', other=[9, 7]),
               node_verdict.holdings(2, [9, 7], {1: [7]}, '10.0.0.3:4000'))
  assert v == {'steps': [9, 7], 'fetch': {'7': {'1': [2, '10.0.0.3:4000']}}, 'elastic': {}}


def test_a_step_saved_by_more_processes_is_restored_onto_the_layout_from_the_live_nodes_parts():
  """Four processes saved 9 and 7; two run now, on nodes holding parts 0 and 3 (a copy) and
  parts 2 and 1 (a copy) of 9, and of 7 only parts 0 and 2. Both are restored onto the current
  layout; the verdict names one saving process whose part a live node serves (0: where a
  process whose node holds no part reads the step's metadata), whatever the fleet: who holds
  which part each holder publishes beside the round. A process that needs part 1 or 3 of 7
  fails its restore and every process passes the step over; a state whole in every slice
  needs one slice's parts only."""
  v = _verdict(
      node_verdict.holdings(0, [9, 7], {3: [9]}, '10.0.0.1:1', parts={9: [0, 3], 7: [0]},
                          counts={9: 4, 7: 4}),
      node_verdict.holdings(1, [], {1: [9]}, '10.0.0.3:3', other=[9, 7], parts={9: [1, 2], 7: [2]},
                          counts={9: 4, 7: 4}))
  assert v == {'steps': [9, 7], 'fetch': {}, 'elastic': {'9': 0, '7': 0}}


def test_a_step_saved_by_as_many_processes_is_restored_as_saved_when_it_can_be():
  """Same process count, every part on its own node or with a copy for the new node: the step
  is restored as it was saved (no gathering); a member that would restore another process's
  step on its node (its processes moved between nodes) gets the step restored onto the
  layout."""
  as_saved = _verdict(
      node_verdict.holdings(0, [9], {}, '', parts={9: [0]}, counts={9: 2}),
      node_verdict.holdings(1, [9], {0: [9]}, 'a:1', parts={9: [1, 0]}, counts={9: 2}))
  assert as_saved == {'steps': [9], 'fetch': {}, 'elastic': {}}
  moved = _verdict(
      node_verdict.holdings(0, [], {}, 'a:0', other=[9], parts={9: [1]}, counts={9: 2}),
      node_verdict.holdings(1, [], {}, 'a:1', other=[9], parts={9: [0]}, counts={9: 2}))
  assert moved == {'steps': [9], 'fetch': {}, 'elastic': {'9': 0}}
