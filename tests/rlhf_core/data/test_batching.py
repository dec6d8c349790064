"""Epoch shuffles shared out over processes, resumable at their position."""

from __future__ import annotations

import pytest

from rlhf_core.data.batching import ShardedBatches, epoch_batches


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
