"""``batching.coalesce_micro_batches``: consecutive planned micro-batches share a forward up to a token budget
counted as right-padded rows (samples x longest sample); order and membership of the samples are kept."""

from __future__ import annotations

import pytest

from miles.trainer.batching import coalesce_micro_batches, plan_micro_batches


def test_merges_consecutive_micro_batches_within_the_padded_budget() -> None:
    lengths = [5, 3, 8, 2, 4, 6]
    plan = plan_micro_batches(lengths, micro_batch_size=1)
    # 3 x 8 = 24 fits 24; adding a fourth sample would be 4 x 8 = 32
    assert coalesce_micro_batches(plan, lengths, 24) == [[0, 1, 2], [3, 4, 5]]
    assert coalesce_micro_batches(plan, lengths, 10) == [[0, 1], [2], [3, 4], [5]]    # [2, 4] then 3 x 6 > 10
    assert coalesce_micro_batches(plan, lengths, 1000) == [[0, 1, 2, 3, 4, 5]]


def test_keeps_planned_groups_whole_and_never_splits_an_oversized_one() -> None:
    lengths = [10, 10, 3, 3, 3, 3]
    plan = plan_micro_batches(lengths, micro_batch_size=2)                   # [[0, 1], [2, 3], [4, 5]]
    assert coalesce_micro_batches(plan, lengths, 15) == [[0, 1], [2, 3, 4, 5]]  # [0, 1] is 20 > 15: alone
    out = coalesce_micro_batches(plan, lengths, 1)
    assert out == plan                                                       # nothing fits: the plan as it was
    assert sorted(i for g in out for i in g) == list(range(len(lengths)))


def test_empty_plan_and_bad_budget() -> None:
    assert coalesce_micro_batches([], [], 16) == []
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        coalesce_micro_batches([[0]], [3], 0)
