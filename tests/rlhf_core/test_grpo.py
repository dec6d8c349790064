import math

import pytest
import torch

from rlhf_core.config import GRPOConfig, RLConfig, RunConfig
from rlhf_core.grpo import (
    combine_rewards, function_reward, group_advantages, grpo_token_loss, reduce_loss, train_grpo,
)
from rlhf_core.models import load_causal_lm, load_tokenizer
from rlhf_core.rewards import RewardFunctionError


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0])  # two groups of two
    adv, std = group_advantages(rewards, 2, "none")
    assert adv.tolist() == [-1.0, 1.0, 0.0, 0.0]
    assert std[0].item() == pytest.approx(math.sqrt(2)) and std[1].item() == 0.0
    adv, _ = group_advantages(rewards, 2, "group")
    assert adv[0].item() == pytest.approx(-1 / (math.sqrt(2) + 1e-4)) and adv[2].item() == 0.0
    adv, _ = group_advantages(rewards, 2, "batch")
    assert adv[1].item() == pytest.approx(1 / (rewards.std().item() + 1e-4))


def test_reward_weighting_leaves_out_none():
    per_source = torch.tensor([[1.0, float("nan")], [2.0, 4.0]])
    assert combine_rewards(per_source, torch.tensor([0.5, 2.0])).tolist() == [0.5, 9.0]


def test_token_loss_clips_asymmetrically():
    old = torch.zeros(2, 1)
    new = torch.log(torch.tensor([[1.5], [0.5]]))
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 1)
    loss, stats = grpo_token_loss(new, old, adv, mask, GRPOConfig(epsilon=0.2, epsilon_high=0.28))
    # row 1: -min(1.5, 1.28) = -1.28 ; row 2: -min(-0.5, -0.8) = 0.8
    torch.testing.assert_close(loss, torch.tensor([[-1.28], [0.8]]))
    assert stats["high_clipped"].tolist() == [[1.0], [0.0]] and stats["low_clipped"].tolist() == [[0.0], [1.0]]
    ref = torch.log(torch.tensor([[1.0], [1.0]]))
    plain_kl = GRPOConfig(epsilon=0.2, epsilon_high=0.28, beta=0.1, use_bias_correction_kl=False)
    with_kl, stats = grpo_token_loss(new, old, adv, mask, plain_kl, ref_logp=ref)
    k3 = torch.expm1(ref - new) - (ref - new)
    torch.testing.assert_close(with_kl, loss + 0.1 * k3)
    # TRL 1.16's default: the KL term times the importance ratio (1.5 and 0.5 here)
    corrected, _ = grpo_token_loss(new, old, adv, mask, plain_kl.model_copy(update={"use_bias_correction_kl": True}), ref_logp=ref)
    torch.testing.assert_close(corrected, loss + 0.1 * k3 * torch.tensor([[1.5], [0.5]]))


def test_each_loss_type_normalizes_as_its_paper():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert reduce_loss(per_token, mask, "grpo", max_completion_length=3, total_tokens=8).item() == pytest.approx((2.0 + 4.0) / 2)
    assert reduce_loss(per_token, mask, "bnpo", max_completion_length=3, total_tokens=8).item() == pytest.approx(10 / 4)
    assert reduce_loss(per_token, mask, "dr_grpo", max_completion_length=3, total_tokens=8).item() == pytest.approx(10 / 6)
    assert reduce_loss(per_token, mask, "dapo", max_completion_length=3, total_tokens=8).item() == pytest.approx(10 / 8)


def test_bad_reward_functions_are_named():
    rollout = None
    wrong_length = function_reward("short", 1.0, lambda prompts, completions, **kw: [1.0])
    with pytest.raises(RewardFunctionError, match="reward function short returned 1 values for 2 completions"):
        wrong_length.score(["a", "b"], ["x", "y"], rollout, [{"prompt": "a"}, {"prompt": "b"}])
    not_number = function_reward("text", 1.0, lambda prompts, completions, **kw: ["good", 1.0])
    with pytest.raises(RewardFunctionError, match=r"reward function text returned 'good' \(a str\) for completion 0"):
        not_number.score(["a", "b"], ["x", "y"], rollout, [{"prompt": "a"}, {"prompt": "b"}])
    columns = function_reward("cols", 1.0, lambda prompts, completions, answer, **kw: [float(a == c) for a, c in zip(answer, completions)])
    assert columns.score(["a", "b"], ["x", "y"], rollout, [{"prompt": "a", "answer": "x"}, {"prompt": "b", "answer": "z"}]) == [1.0, 0.0]


def setup(world):
    tok = load_tokenizer(str(world.tokenizer))
    return tok, load_causal_lm(str(world.base_model))


def make_reward(tok):
    """Easy reward: the share of completion words whose id is in the upper half of the vocabulary."""
    cut = len(tok) // 2

    def high_ids(prompts, completions, **_):
        out = []
        for text in completions:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            out.append(sum(i >= cut for i in ids) / len(ids) if ids else None)
        return out

    return function_reward("high_ids", 1.0, high_ids)


def prompt_rows(world):
    import json

    return [json.loads(line) for line in world.prompts("train").read_text().splitlines()]


RL = dict(batch_size=16, learning_rate=3e-3, response_length=6, temperature=1.0, save_steps=2, log_steps=1)


def run(world, out, steps=4, on_log=None, grpo=None, **rl):
    tok, policy = setup(world)
    logs, ckpts, completions = [], [], []

    def log(metrics, step):
        logs.append((step, metrics))
        if on_log:
            on_log(metrics, step)

    result = train_grpo(policy, None, [make_reward(tok)], tok, prompt_rows(world), RLConfig(total_steps=steps, algorithm="grpo", **{**RL, **rl}),
                        grpo or GRPOConfig(num_generations=4, log_completions_steps=2), RunConfig(device="cpu", seed=5),
                        max_prompt_length=12, output_dir=out, on_log=log, on_checkpoint=lambda p, s: ckpts.append(s),
                        on_completions=lambda rows, s: completions.append((s, rows)), show_progress=False)
    return policy, result, logs, ckpts, completions


def test_short_run_changes_parameters_logs_trl_metrics_and_completions(tmp_path, smoke_world):
    _, before = setup(smoke_world)
    policy, result, logs, ckpts, completions = run(smoke_world, tmp_path / "g")
    before_params = dict(before.named_parameters())
    for name, param in policy.named_parameters():
        assert not torch.equal(before_params[name], param), f"{name} did not change"
    names = set(logs[-1][1])
    assert {"reward", "reward_std", "rewards/high_ids/mean", "rewards/high_ids/std", "frac_reward_zero_std",
            "completions/mean_length", "completions/clipped_ratio", "entropy", "clip_ratio/region_mean",
            "perf/step_seconds"} <= names
    assert "kl" not in names  # beta 0: no reference at all
    assert ckpts == [2, 4] and not (result.checkpoint / "value").exists()
    assert [s for s, _ in completions] == [2, 4]
    row = completions[0][1][0]
    assert set(row) == {"step", "prompt", "completion", "advantage", "reward", "high_ids"} and len(completions[0][1]) == 16


def test_beta_uses_a_reference_and_logs_kl(tmp_path, smoke_world):
    tok, policy = setup(smoke_world)
    ref = load_causal_lm(str(smoke_world.base_model))
    logs = []
    train_grpo(policy, ref, [make_reward(tok)], tok, prompt_rows(smoke_world), RLConfig(total_steps=2, algorithm="grpo", **RL),
               GRPOConfig(num_generations=4, beta=0.04, loss_type="grpo", num_iterations=2), RunConfig(device="cpu", seed=5),
               max_prompt_length=12, output_dir=tmp_path / "b", on_log=lambda m, s: logs.append(m), show_progress=False)
    assert "kl" in logs[-1] and logs[-1]["kl"] >= 0


def test_resume_after_a_crash_matches(tmp_path, smoke_world):
    straight, full, _, _, _ = run(smoke_world, tmp_path / "a")

    def crash(metrics, step):
        if step == 3:
            raise RuntimeError("injected crash")

    with pytest.raises(RuntimeError):
        run(smoke_world, tmp_path / "b", on_log=crash)
    resumed, result, logs, ckpts, _ = run(smoke_world, tmp_path / "b")
    assert result.resumed_from == 2 and [s for s, _ in logs] == [3, 4] and ckpts == [4]
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} differs after resume")


@pytest.mark.slow
def test_reward_rises_with_an_easy_callable_reward(tmp_path, smoke_world):
    _, _, logs, _, _ = run(smoke_world, tmp_path / "learn", steps=30, batch_size=32, response_length=8, learning_rate=1e-2,
                           lr_scheduler="constant", save_steps=100, grpo=GRPOConfig(num_generations=8, log_completions_steps=100))
    rewards = [m["reward"] for _, m in logs]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.1, f"reward did not rise: {rewards}"
