"""Data parallelism: batch sharding by value, and two CPU processes (gloo, torchrun) training reward,
PPO and GRPO with the same weights after every step, one writer of checkpoints and logs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.training import ShardedBatches, epoch_batches

REPO = Path(__file__).resolve().parents[2]


def test_each_process_gets_its_own_batch_and_one_process_keeps_the_old_order():
    alone = ShardedBatches(10, 2, seed=1, rank=0, world=1)
    assert [alone.next() for _ in range(5)] == epoch_batches(10, 2, 1, 0)
    assert alone.epoch == 1 and alone.position == 0
    ranks = [ShardedBatches(10, 2, seed=1, rank=r, world=2) for r in (0, 1)]
    steps = [[shard.next() for shard in ranks] for _ in range(2)]
    assert [batch for step in steps for batch in step] == epoch_batches(10, 2, 1, 0)[:4]  # 5 batches: the 5th is dropped
    assert ranks[0].epoch == 1 and ranks[0].position == 0  # a third step would need 2 more batches: next epoch
    resumed = ShardedBatches(10, 2, seed=1, rank=1, world=2, epoch=0, position=2)
    assert resumed.next() == steps[1][1]
    with pytest.raises(ValueError, match="fewer than the 4 processes"):
        ShardedBatches(6, 2, seed=1, rank=0, world=4)


@pytest.mark.slow
def test_two_processes_train_reward_ppo_and_grpo_with_identical_weights(tmp_path, smoke_world):
    out = tmp_path / "dp"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2",
                           str(REPO / "tests" / "distributed" / "dp_worker.py"), str(smoke_world.root), str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    traces = [[json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    for stage, steps in (("reward", 3), ("ppo", 2), ("grpo", 2)):
        weights = [[e["weights"] for e in t if e["stage"] == stage and "step" in e] for t in traces]
        assert len(weights[0]) == steps and weights[0] == weights[1], f"{stage}: the processes disagree: {weights}"
        assert len(set(weights[0])) == steps, f"{stage}: the weights did not change every step"
        # metrics are logged by the main process only
        assert [e["log"] for e in traces[0] if e["stage"] == stage and "log" in e] == list(range(1, steps + 1))
        assert not [e for e in traces[1] if e["stage"] == stage and "log" in e]
    assert [e["metrics"] for e in traces[0] if e["stage"] == "reduce"] == [
        {"loss": 0.5, "tokens": 7.0}, {"low": 2.0, "high": 10.0, "mean": 0.5, "n": 2.0}]
    # identical weights, but each process samples with its own seed (run.seed + rank)
    assert [{e["sampling_seed"] for e in t if e["stage"] == "grpo" and "step" in e} for t in traces] == [{3}, {4}]
    # PPO's episode counts the prompts of both processes
    assert [e["episode"] for e in traces[0] if e["stage"] == "ppo" and "log" in e] == [8.0, 16.0]
    # one writer: each checkpoint exists once and no temporary directory is left behind
    assert sorted(p.name for p in (out / "reward").iterdir()) == ["checkpoint-3"]
    assert sorted(p.name for p in (out / "ppo").iterdir()) == ["checkpoint-2"]
    assert sorted(p.name for p in (out / "grpo").iterdir()) == ["checkpoint-2"]
