"""The leader's verdict of the node steps round (``multitier/node_steps._decide``, pure): which
steps every process can restore, from its own node or from the copy a partner keeps, and who
fetches what from whom."""

from __future__ import annotations

import json

from orbax_pathways.multitier import node_steps


def _verdict(*values: str) -> dict:
  return json.loads(node_steps._decide(list(values)))  # pylint: disable=protected-access


def test_steps_every_node_holds_need_no_fetch():
  v = _verdict(node_steps.holdings(0, [7, 9], {}, ''), node_steps.holdings(1, [9, 7], {}, ''))
  assert v == {'steps': [9, 7], 'fetch': {}}


def test_a_lost_nodes_part_comes_from_the_copy_its_partner_keeps():
  """Process 1's node is new (it holds nothing); process 2 keeps its copies of 9 and 7, but
  nobody keeps process 0's copy of 5: 9 and 7 can be restored (process 1 fetching from process
  2's server), 5 cannot."""
  v = _verdict(node_steps.holdings(0, [9, 7, 5], {}, ''),
               node_steps.holdings(1, [], {}, ''),
               node_steps.holdings(2, [9, 7, 5], {1: [9, 7]}, '10.0.0.3:4000'))
  assert v == {'steps': [9, 7], 'fetch': {'9': {'1': [2, '10.0.0.3:4000']},
                                          '7': {'1': [2, '10.0.0.3:4000']}}}


def test_a_copy_whose_keeper_serves_nothing_is_not_counted():
  """A copy offered without a server address (its node could not serve it), or a process's
  copy of its own step, does not make a step restorable."""
  v = _verdict(node_steps.holdings(0, [9], {1: [9]}, ''),
               node_steps.holdings(1, [], {1: [9]}, '10.0.0.2:1'))
  assert v == {'steps': [], 'fetch': {}}


def test_a_step_another_process_saved_on_a_members_node_counts_after_its_own_and_copies():
  """Process 1 runs on a node process 2 saved 9 and 7 on (a restart onto fewer processes): 9 is
  restorable, process 1 restoring that node's step, no fetch; where a copy of process 1's own
  step is kept (7), it is fetched instead."""
  v = _verdict(node_steps.holdings(0, [9, 7], {}, ''),
               node_steps.holdings(1, [], {}, '', other=[9, 7]),
               node_steps.holdings(2, [9, 7], {1: [7]}, '10.0.0.3:4000'))
  assert v == {'steps': [9, 7], 'fetch': {'7': {'1': [2, '10.0.0.3:4000']}}}
