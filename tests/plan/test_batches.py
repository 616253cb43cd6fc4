"""``plan/batches.in_order``: consecutive batches by size (pure)."""

from __future__ import annotations

from orbax_pathways.plan import batches


def test_items_are_cut_in_order_at_the_limit_and_a_big_one_stands_alone():
  assert batches.in_order([3, 3, 3, 9, 1], 6) == [[0, 1], [2], [3], [4]]
  assert batches.in_order([1, 1, 1], 2) == [[0, 1], [2]]


def test_no_limit_is_one_batch_and_no_items_none():
  assert batches.in_order([5, 7], None) == [[0, 1]] == batches.in_order([5, 7], 0)
  assert batches.in_order([], 4) == [] == batches.in_order([], None)
