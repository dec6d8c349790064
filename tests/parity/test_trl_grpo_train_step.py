"""GRPO parity with TRL 1.16: the training loop (helpers in tests/parity/trl_grpo_common.py).

One real `train_grpo` step with fixed reward values (None included): the advantages in its completions
table and the reward statistics it logs == what TRL's `_generate_and_score_completions` computes and logs for
the same rewards.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.config import GRPOConfig as OurGRPOConfig
from rlhf_core.config import RLConfig, RunConfig
from rlhf_core.rewards.sources import function_reward
from rlhf_core.rl.grpo import train_grpo
from rlhf_core.rl.inputs import rl_inputs
from tests.parity.trl_grpo_common import MAX_COMPLETION, NAN, build_policy, drive_trl_scoring

# ------------------------------------------------------------------------------------------
# the training loop: one real train_grpo step against TRL's scoring of the same rewards
# ------------------------------------------------------------------------------------------

LOOP_REWARDS = {  # 16 completions, groups of 4; None = the function returned None
    "length": [1.0, 2.0, None, 4.0, None, None, None, 2.0, 3.0, 3.0, 3.0, 3.0, None, None, None, None],
    "odd": [0.5, None, None, 1.0, 2.0, None, 1.0, None, None, 1.0, 2.0, 0.0, None, None, None, None],
}
LOOP_WEIGHTS = {"length": 1.0, "odd": -0.5}


@pytest.mark.parametrize(
    "aggregation,scale_rewards",
    [
        ("sum_then_normalize", "group"),
        ("sum_then_normalize", "batch"),
        ("sum_then_normalize", "none"),
        ("normalize_then_sum", "group"),
    ],
)
def test_train_grpo_step_advantages_and_reward_metrics_match_trl(
    make_trainer, tokenizer, tmp_path, aggregation, scale_rewards
):
    """One `train_grpo` step (tiny policy, two reward functions returning fixed values with None) ->
    the advantages in its completions table and its logged `reward`, `reward_std`,
    `frac_reward_zero_std`, `rewards/<name>/mean|std` == TRL's `_generate_and_score_completions`
    output and `_metrics` for the same rewards (docs/algorithms.md: GRPO, "Metrics with TRL's names").
    Tolerance atol 1e-5, rtol 1e-5 (the loop's metrics pass through floats)."""

    def source(name):
        def fn(prompts, completions, **_):
            assert len(completions) == 16
            return list(LOOP_REWARDS[name])

        return function_reward(name, LOOP_WEIGHTS[name], fn)

    logs, tables = [], []
    rows = [{"prompt": p} for p in ("w3 w4 w5", "w6 w7 w8", "w9 w10 w11", "w12 w13 w14")]
    train_grpo(
        rl_inputs(
            build_policy(seed=0),
            tokenizer,
            rows,
            tmp_path / "grpo",
            reference=None,
            rewards=[source("length"), source("odd")],
            rl=RLConfig(
                algorithm="grpo",
                total_steps=1,
                batch_size=16,
                response_length=MAX_COMPLETION,
                temperature=0.7,
                learning_rate=1e-3,
            ),
            grpo=OurGRPOConfig(num_generations=4, multi_objective_aggregation=aggregation, scale_rewards=scale_rewards),
            run=RunConfig(device="cpu", seed=3),
            max_prompt_length=8,
            on_log=lambda m, s: logs.append(m),
            on_completions=lambda table, s: tables.append(table),
            show_progress=False,
        )
    )
    table = tables[0]
    assert [[r["length"], r["odd"]] for r in table] == [list(v) for v in zip(*LOOP_REWARDS.values())]

    per_source = torch.tensor([[NAN if v is None else v for v in col] for col in LOOP_REWARDS.values()]).T
    trainer = make_trainer(
        reward_names=list(LOOP_REWARDS),
        reward_weights=list(LOOP_WEIGHTS.values()),
        scale_rewards=scale_rewards,
        multi_objective_aggregation=aggregation,
    )
    out = drive_trl_scoring(trainer, per_source)
    torch.testing.assert_close(torch.tensor([r["advantage"] for r in table]), out["advantages"], atol=1e-5, rtol=1e-5)

    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    keys = ["reward", "reward_std", "frac_reward_zero_std"] + [
        f"rewards/{n}/{s}" for n in LOOP_REWARDS for s in ("mean", "std")
    ]
    mismatches = {
        k: (logs[0][k], trl_metrics[k])
        for k in keys
        if not math.isclose(logs[0][k], trl_metrics[k], rel_tol=1e-5, abs_tol=1e-5)
    }
    assert not mismatches, f"ours vs TRL's logged metric: {mismatches}"
