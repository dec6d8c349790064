"""The rollout phase: what a rollout batch carries, the missing-stop penalty, TRL's completion statistics,
and which forward passes `collect_rollout` runs."""

import pytest
import torch

from rlhf_core.models.loading import load_causal_lm
from rlhf_core.rollout.collect import (
    Passes,
    RolloutBatch,
    SamplingSpec,
    collect_rollout,
    completion_metrics,
    missing_stop_penalty,
)
from rlhf_core.rollout.sampling import SamplingSettings
from tests.fixtures.small_models import batch, rollout_of


def test_the_missing_stop_penalty_falls_on_responses_that_never_stopped_and_comes_off_the_score():
    rollout = rollout_of([[1, 1, 0], [1, 1, 1], [1, 0, 0]], [True, False, True])
    assert missing_stop_penalty(rollout, None) is None
    penalty = missing_stop_penalty(rollout, 2.5)
    assert penalty.tolist() == [0.0, 2.5, 0.0]
    scored = RolloutBatch(rollout, torch.tensor([[1.0], [1.0], [-0.5]]), penalty)
    assert len(scored) == 3
    assert scored.sequence_scores().tolist() == [1.0, -1.5, -0.5]
    assert RolloutBatch(rollout, torch.tensor([[1.0], [1.0], [-0.5]])).sequence_scores().tolist() == [1.0, 1.0, -0.5]


def test_completion_statistics_by_hand():
    # lengths 2, 3 (never stopped) and 1: mean 2, min 1, max 3; one in three clipped; stopped ones average 1.5
    metrics = completion_metrics(rollout_of([[1, 1, 0], [1, 1, 1], [1, 0, 0]], [True, False, True]))
    assert {k: round(float(v), 6) for k, v in metrics.items()} == {
        "completions/mean_length": 2.0,
        "completions/min_length": 1.0,
        "completions/max_length": 3.0,
        "completions/clipped_ratio": round(1 / 3, 6),
        "completions/mean_terminated_length": 1.5,
    }
    nothing_stopped = completion_metrics(rollout_of([[1, 1], [1, 1]], [False, False]))
    assert float(nothing_stopped["completions/mean_terminated_length"]) == 0.0


@pytest.mark.parametrize("need_logprobs,need_reference", [(True, True), (False, True), (True, False)])
def test_collect_rollout_runs_only_the_forward_passes_asked_for(smoke_world, need_logprobs, need_reference):
    tok, ids, mask = batch(smoke_world, n=3)
    policy = load_causal_lm(str(smoke_world.base_model)).eval()
    reference = load_causal_lm(str(smoke_world.base_model)).eval()
    torch.manual_seed(0)
    rollout = collect_rollout(
        policy,
        reference,
        ids,
        mask,
        SamplingSpec(SamplingSettings(response_length=4), tok.pad_token_id, (tok.eos_token_id,)),
        passes=Passes(policy=need_logprobs, reference=need_reference),
    )
    assert rollout.responses.shape == (3, 4) and rollout.resp_mask.shape == (3, 4)
    assert (rollout.logprobs is not None) == need_logprobs
    assert (rollout.ref_logprobs is not None) == need_reference
    if need_logprobs and need_reference:  # the same weights: the reference reads what the policy read
        torch.testing.assert_close(rollout.logprobs, rollout.ref_logprobs)


def test_a_tool_rollouts_lengths_count_the_models_tokens_and_its_tool_statistics():
    from rlhf_core.rollout.collect import Rollout, tool_metrics
    from rlhf_core.rollout.episodes import EpisodeRecord

    resp_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0]])
    model_tokens = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0]])  # row 0: 2 of its 6 are the tool's
    record = EpisodeRecord([[], []], [3, 0], [1, 0], [2, 1], [True, False], [])
    rollout = Rollout(
        torch.zeros(2, 1, dtype=torch.long),
        torch.ones(2, 1, dtype=torch.long),
        torch.zeros_like(resp_mask),
        resp_mask,
        torch.tensor([5, 1]),
        None,
        None,
        torch.tensor([True, True]),
        model_tokens=model_tokens,
        episodes=record,
    )
    assert completion_metrics(rollout)["completions/max_length"] == 4
    assert torch.equal(rollout.trained_mask(False), model_tokens)
    metrics = {k: float(v) for k, v in tool_metrics(rollout).items()}
    assert metrics == {
        "tools/call_frequency": 1.5,
        "tools/failure_frequency": pytest.approx(1 / 3),
        "tools/failures": 1.0,
        "tools/turns": 1.5,
        "tools/hit_max_calls": 0.5,
        "tools/token_share": 0.25,
    }


def test_a_token_budget_generates_whole_groups_at_a_time_within_it(smoke_world):
    from rlhf_core.rollout.collect import sample
    from rlhf_core.rollout.engines import LoopEngine

    tok, ids, mask = batch(smoke_world, n=3)
    ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)  # three groups of two
    policy = load_causal_lm(str(smoke_world.base_model)).eval()
    calls = []

    class Counting(LoopEngine):
        def generate(self, policy, query_ids, *args, **kwargs):
            calls.append(query_ids.shape[0])
            return super().generate(policy, query_ids, *args, **kwargs)

    settings = SamplingSettings(response_length=5)
    width = ids.shape[1] + 5
    spec = SamplingSpec(settings, tok.pad_token_id, (tok.eos_token_id,), prompt_repeats=2, max_tokens=4 * width + 3)
    sampled = sample(Counting(), policy, ids, mask, spec)
    assert calls == [4, 2]  # two groups fit, then the third
    assert sampled.responses.shape[0] == 6 and sampled.responses.shape[1] <= 5 and (sampled.resp_mask.sum(1) >= 1).all()
    calls.clear()
    sample(Counting(), policy, ids, mask, SamplingSpec(settings, tok.pad_token_id, (tok.eos_token_id,), 2))
    assert calls == [6]
