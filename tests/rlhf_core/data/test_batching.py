"""Epoch shuffles shared out over processes, resumable at their position; micro-batches by rows or tokens."""

from __future__ import annotations

import pytest

from rlhf_core.data.batching import ShardedBatches, epoch_batches, micro_batch_plan


def test_each_process_gets_its_own_batch_and_one_process_keeps_the_old_order():
    alone = ShardedBatches(10, 2, seed=1, rank=0, world=1)
    assert [alone.next() for _ in range(5)] == epoch_batches(10, 2, 1, 0)
    assert alone.epoch == 1 and alone.position == 0
    ranks = [ShardedBatches(10, 2, seed=1, rank=r, world=2) for r in (0, 1)]
    steps = [[shard.next() for shard in ranks] for _ in range(2)]
    assert [batch for step in steps for batch in step] == epoch_batches(10, 2, 1, 0)[
        :4
    ]  # 5 batches: the 5th is dropped
    assert ranks[0].epoch == 1 and ranks[0].position == 0  # a third step would need 2 more batches: next epoch
    resumed = ShardedBatches(10, 2, seed=1, rank=1, world=2, epoch=0, position=2)
    assert resumed.next() == steps[1][1]
    with pytest.raises(ValueError, match="fewer than the 4 processes"):
        ShardedBatches(6, 2, seed=1, rank=0, world=4)


def test_micro_batches_by_rows_keep_the_order_and_a_short_last_one():
    assert micro_batch_plan([5, 9, 3, 7, 2], 2) == [[0, 1], [2, 3], [4]]
    assert micro_batch_plan([5, 9, 3], 8) == [[0, 1, 2]]


def test_a_token_budget_packs_the_longest_first_each_within_rows_times_its_longest():
    lengths = [10, 40, 12, 25, 11, 30, 9]
    plan = micro_batch_plan(lengths, 2, max_tokens=60)
    # longest first: 40 alone (40 + 30 > 60 as 2 x 40), then 30 + 25 (2 x 30), then 12, 11, 10, 9 (4 x 12 = 48)
    assert plan == [[1], [3, 5], [0, 2, 4, 6]]
    assert all(len(m) * max(lengths[i] for i in m) <= 60 for m in plan)
    assert sorted(i for m in plan for i in m) == list(range(len(lengths)))
    assert micro_batch_plan([70, 5], 2, max_tokens=60) == [[0], [1]]  # a row over the budget goes alone


def test_every_process_gets_as_many_micro_batches_the_largest_halved_first():
    plan = micro_batch_plan([10, 40, 12, 25, 11, 30, 9], 2, max_tokens=60, count=5)
    assert plan == [[1], [3], [5], [0, 2], [4, 6]]
    assert micro_batch_plan([3, 3], 2, count=5) == [[0], [1]]  # no more rows to split
