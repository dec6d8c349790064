"""The completions table by hand: one row per completion, NaN scores as None, per-token advantages averaged over
each completion's real tokens; and when a step writes it."""

import math

import torch

from rlhf_core.rl.advantages.estimators import Estimate
from rlhf_core.rl.completions import completions_due, completions_table, float_or_none
from rlhf_core.rollout.collect import Rollout, RolloutBatch
from rlhf_core.rollout.episodes import EpisodeRecord

NAN = float("nan")


def batch(resp_mask: torch.Tensor, scores: torch.Tensor) -> RolloutBatch:
    n, length = resp_mask.shape
    rollout = Rollout(
        query_ids=torch.ones(n, 2, dtype=torch.long),
        query_mask=torch.ones(n, 2, dtype=torch.long),
        responses=torch.ones(n, length, dtype=torch.long),
        resp_mask=resp_mask,
        last_index=resp_mask.sum(1) - 1,
        logprobs=None,
        ref_logprobs=None,
        has_stop=torch.ones(n, dtype=torch.bool),
    )
    rows = [{"prompt": f"p{i // 2}", "other": i} for i in range(n)]
    return RolloutBatch(rollout, scores, rows=rows, completions=[f"c{i}" for i in range(n)])


def test_one_row_per_completion_with_each_sources_score_and_none_where_nan():
    b = batch(torch.ones(3, 2, dtype=torch.long), torch.tensor([[1.0, NAN], [0.5, 2.0], [NAN, NAN]]))
    estimate = Estimate(torch.tensor([0.25, -0.25, 0.0]), stats={"my_rewards": torch.tensor([1.0, 1.5, NAN])})
    table = completions_table(4, b, estimate, ["judge", "length"])
    assert table == [
        {"step": 4, "prompt": "p0", "completion": "c0", "advantage": 0.25, "reward": 1.0, "judge": 1.0, "length": None},
        {"step": 4, "prompt": "p0", "completion": "c1", "advantage": -0.25, "reward": 1.5, "judge": 0.5, "length": 2.0},
        {
            "step": 4,
            "prompt": "p1",
            "completion": "c2",
            "advantage": 0.0,
            "reward": None,
            "judge": None,
            "length": None,
        },
    ]


def test_per_token_advantages_are_averaged_over_each_completions_real_tokens():
    b = batch(torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.tensor([[1.0], [0.0]]))
    per_token = torch.tensor([[1.0, 3.0, 100.0], [-2.0, 100.0, 100.0]])  # padding never counts
    estimate = Estimate(per_token, stats={"my_rewards": torch.tensor([1.0, 0.0])})
    assert [row["advantage"] for row in completions_table(1, b, estimate, ["r"])] == [2.0, -2.0]


def test_due_every_log_completions_steps_and_at_the_last_step():
    assert [s for s in range(1, 8) if completions_due(s, 3, 7)] == [3, 6, 7]
    assert [s for s in range(1, 5) if completions_due(s, 1, 4)] == [1, 2, 3, 4]


def test_float_or_none():
    assert float_or_none(torch.tensor(0.5)) == 0.5 and float_or_none(torch.tensor(NAN)) is None
    assert math.isinf(float_or_none(torch.tensor(float("inf"))))


def test_a_tool_episode_is_one_line_in_the_table():
    b = batch(torch.ones(1, 2, dtype=torch.long), torch.tensor([[1.0]]))
    call = {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    transcript = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "f", "content": "2"},
    ]
    b.rollout.episodes = EpisodeRecord(
        [[*transcript, {"role": "assistant", "content": "2"}]], [1], [0], [2], [False], []
    )
    estimate = Estimate(torch.tensor([0.5]), stats={"my_rewards": torch.tensor([1.0])})
    [row] = completions_table(1, b, estimate, ["r"])
    assert row["completion"] == '-> f {"a": 1} ⏎ <- f: 2 ⏎ 2'  # MLflow's table shows a cell's first line only
