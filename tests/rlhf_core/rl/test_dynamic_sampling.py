"""DAPO's dynamic sampling: which groups have zero spread, joining and cutting rollouts by group, filling a
batch; and in a short GRPO run, the counts it logs, that only groups with spread are trained on when there
are enough, and resume after a crash."""

import pytest
import torch

from rlhf_core.config import GRPOConfig
from rlhf_core.data.chat import completion_text
from rlhf_core.rl.dynamic_sampling import GroupFiller, group_rows, join_batches, select_rows, zero_spread_groups
from rlhf_core.rl_math import INVALID_LOGPROB
from rlhf_core.rollout.collect import RolloutBatch
from tests.fixtures.small_models import rollout_of
from tests.rlhf_core.rl.test_grpo import run

NAN = float("nan")


def test_zero_spread_means_equal_scorable_rewards_or_fewer_than_two():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 2.0, NAN, 2.0, NAN, 3.0, NAN, NAN, 0.5, 0.5, 0.5, 0.5])
    assert zero_spread_groups(rewards, 4).tolist() == [False, True, True, True]
    assert group_rows(torch.tensor([0, 2]), 3).tolist() == [0, 1, 2, 6, 7, 8]


def batch_of(widths: list[int], query_width: int, scores: list[float], tag: int) -> RolloutBatch:
    mask = torch.tensor([[1] * w + [0] * (max(widths) - w) for w in widths])
    rollout = rollout_of(mask, logprobs=torch.full(mask.shape, -0.5) * mask + INVALID_LOGPROB * (1 - mask))
    rollout.query_ids = torch.full((len(widths), query_width), tag)
    rollout.query_mask = torch.ones(len(widths), query_width, dtype=torch.long)
    rows = [{"prompt": f"p{tag}-{i}"} for i in range(len(widths))]
    return RolloutBatch(rollout, torch.tensor(scores).view(-1, 1), rows=rows, completions=[str(s) for s in scores])


def test_joined_batches_pad_queries_left_and_responses_right():
    a, b = batch_of([2, 1], 1, [0.0, 1.0], tag=7), batch_of([3, 3], 2, [2.0, 3.0], tag=8)
    joined = join_batches([a, b], pad_token_id=0)
    assert joined.rollout.query_ids.tolist() == [[0, 7], [0, 7], [8, 8], [8, 8]]
    assert joined.rollout.query_mask.tolist() == [[0, 1], [0, 1], [1, 1], [1, 1]]
    assert joined.rollout.resp_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]]
    assert joined.rollout.logprobs[0].tolist() == [-0.5, -0.5, INVALID_LOGPROB]
    assert joined.rollout.last_index.tolist() == [1, 0, 2, 2] and joined.rollout.ref_logprobs is None
    assert [r["prompt"] for r in joined.rows] == ["p7-0", "p7-1", "p8-0", "p8-1"]
    picked = select_rows(joined, torch.tensor([3, 0]))
    assert picked.scores.view(-1).tolist() == [3.0, 0.0] and picked.completions == ["3.0", "0.0"]


def test_filler_keeps_groups_with_spread_and_fills_a_short_batch_with_dropped_ones():
    filler = GroupFiller(wanted=3, num_generations=2)
    first = batch_of([1] * 6, 1, [0.0, 1.0, 2.0, 2.0, 5.0, 5.0], tag=1)  # one group with spread, two without
    filler.add(first, first.scores.view(-1))
    assert (filler.kept_groups, filler.dropped_groups, filler.missing) == (1, 2, 2)
    second = batch_of([1] * 6, 1, [1.0, 0.0, 3.0, 3.0, 4.0, 4.0], tag=2)
    filler.add(second, second.scores.view(-1))
    full, filled = filler.batch(pad_token_id=0)
    assert filled == 1 and filler.dropped_groups == 4
    assert full.scores.view(-1).tolist() == [0.0, 1.0, 1.0, 0.0, 2.0, 2.0]  # spread, spread, then a dropped group
    enough = GroupFiller(wanted=1, num_generations=2)
    enough.add(second, second.scores.view(-1))
    assert enough.batch(pad_token_id=0)[1] == 0


def half_flat_reward(prompts, completions, **_):
    """Constant for prompts of even length (those groups have zero spread), the completion's length otherwise.
    (The smoke world's prompts are conversational: message lists, as TRL hands them.)"""
    return [
        1.0 if len(str(p)) % 2 == 0 else float(len(completion_text(c).split())) for p, c in zip(prompts, completions)
    ]


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_a_run_with_dynamic_sampling_logs_its_rounds_and_resumes_identically(tmp_path, smoke_world, algorithm):
    from rlhf_core.rewards.sources import function_reward

    grpo = GRPOConfig(num_generations=4, log_completions_steps=1, dynamic_sampling={"enabled": True, "max_rounds": 2})
    settings = dict(algorithm=algorithm, grpo=grpo)
    rewards = [function_reward("half_flat", 1.0, half_flat_reward)]
    straight, _, logs, _, completions = run(smoke_world, tmp_path / "a", rewards=rewards, **settings)
    for _, metrics in logs:
        assert metrics["dynamic_sampling/rounds"] <= 2
        if metrics["dynamic_sampling/filled_groups"] == 0:
            assert metrics["frac_reward_zero_std"] == 0.0
    assert sum(m["dynamic_sampling/zero_spread_groups"] for _, m in logs) > 0
    # the tabled completions of a full batch come only from groups whose rewards have spread
    for step, rows in completions:
        if dict(logs)[step]["dynamic_sampling/filled_groups"] == 0:
            groups = [[r["reward"] for r in rows[i : i + 4]] for i in range(0, len(rows), 4)]
            assert all(len(set(g)) > 1 for g in groups), groups

    def crash(metrics, step):
        if step == 3:
            raise RuntimeError("injected crash")

    with pytest.raises(RuntimeError):
        run(smoke_world, tmp_path / "b", on_log=crash, rewards=rewards, **settings)
    resumed, result, _, _, _ = run(smoke_world, tmp_path / "b", rewards=rewards, **settings)
    assert result.resumed_from == 2
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} differs after resume")
