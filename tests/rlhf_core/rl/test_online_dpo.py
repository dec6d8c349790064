"""Online DPO: pairs ordered by reward as TRL's online trainer orders them, and short runs on the smoke world with a
reward function: the pairs it trains on are separated, TRL's metric names, a crash and rerun on the same weights."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.config import DPOConfig, RLConfig, RunConfig
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.rl.inputs import rl_inputs
from rlhf_core.rl.online_dpo import pair_order, train_online_dpo
from tests.rlhf_core.rl.test_grpo import make_reward, prompt_rows, setup

NAN = math.nan


def test_the_higher_reward_is_chosen_the_first_on_a_tie_and_nan_counts_zero():
    rewards = torch.tensor([1.0, 2.0, 3.0, 3.0, NAN, 0.5, -1.0, NAN])
    order = pair_order(rewards)
    # pairs (0, 1): 2 > 1; (2, 3): a tie, the first; (4, 5): 0 < 0.5; (6, 7): -1 < 0
    assert order.tolist() == [1, 2, 5, 7, 0, 3, 4, 6]
    loop = [max((2 * k, 2 * k + 1), key=lambda i: (torch.nan_to_num(rewards)[i].item(), -i)) for k in range(4)]
    assert order[:4].tolist() == loop


RL = dict(learning_rate=3e-3, response_length=6, temperature=1.0, save_steps=2, log_steps=1, missing_eos_penalty=1.0)


def run(world, out, steps=4, on_log=None, **dpo):
    tok, policy = setup(world)
    logs = []

    def log(metrics, step):
        logs.append((step, metrics))
        if on_log:
            on_log(metrics, step)

    dpo = DPOConfig(**dpo)
    result = train_online_dpo(
        rl_inputs(
            policy,
            tok,
            prompt_rows(world),
            out,
            reference=None if dpo.reference_free else load_causal_lm(str(world.base_model)),
            rewards=[make_reward(tok)],
            rl=RLConfig(algorithm="online_dpo", total_steps=steps, batch_size=16, gradient_accumulation_steps=2, **RL),
            dpo=dpo,
            run=RunConfig(device="cpu", seed=5),
            max_prompt_length=12,
            on_log=log,
            show_progress=False,
        )
    )
    return policy, result, logs


def test_a_short_run_trains_on_its_own_ranked_pairs_and_logs_trl_names(tmp_path, smoke_world):
    _, before = setup(smoke_world)
    policy, result, logs = run(smoke_world, tmp_path / "o", steps=4)
    names = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"}
    names |= {"objective/scores", "objective/scores_margin", "objective/kl", "val/contain_eos_token", "loss"}
    assert names <= set(logs[-1][1])
    first = logs[0][1]
    assert abs(first["rewards/margins"]) < 1e-6 and abs(first["objective/kl"]) < 1e-6  # the policy is the reference
    assert all(m["objective/scores_margin"] >= 0 for _, m in logs)  # chosen never scores below rejected
    assert 0.0 <= first["val/contain_eos_token"] <= 1.0 and result.step == 4
    changed = [
        n for (n, a), (_, b) in zip(policy.named_parameters(), before.named_parameters()) if not torch.equal(a, b)
    ]
    assert changed


def test_a_crash_and_rerun_ends_on_the_same_weights(tmp_path, smoke_world):
    straight, _, _ = run(smoke_world, tmp_path / "a", steps=3)

    def crash(metrics, step):
        if step == 3:
            raise RuntimeError("injected crash")

    with pytest.raises(RuntimeError, match="injected crash"):
        run(smoke_world, tmp_path / "b", steps=3, on_log=crash)
    resumed, result, _ = run(smoke_world, tmp_path / "b", steps=3)
    assert result.resumed_from == 2
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} differs after the rerun")
