"""rlhf_core/config/training.py: the optimizer, SFT, reward, RL, PPO and GRPO sections: TRL's defaults, non-finite patience."""

from __future__ import annotations

import pytest

from rlhf_core.config import (
    ConfigError,
    PipelineConfig,
    load_config,
)


def test_defaults_follow_trl():
    cfg = PipelineConfig()
    assert (cfg.ppo.kl_coef, cfg.ppo.cliprange, cfg.ppo.vf_coef, cfg.ppo.cliprange_value) == (0.05, 0.2, 0.1, 0.2)
    assert (cfg.ppo.gamma, cfg.ppo.lam, cfg.ppo.num_ppo_epochs) == (1.0, 0.95, 4)
    assert (cfg.grpo.num_generations, cfg.grpo.epsilon, cfg.grpo.loss_type, cfg.grpo.scale_rewards) == (
        8,
        0.2,
        "dapo",
        "group",
    )
    assert cfg.reward.center_rewards_coefficient is None
    assert cfg.rl.algorithm == "ppo"


def test_every_optimizer_section_limits_nonfinite_steps_in_a_row():
    cfg = PipelineConfig()
    assert (
        cfg.sft.max_nonfinite_steps_in_a_row,
        cfg.reward.max_nonfinite_steps_in_a_row,
        cfg.rl.max_nonfinite_steps_in_a_row,
    ) == (3, 3, 3)
    assert load_config(None, ["rl.max_nonfinite_steps_in_a_row=0"]).rl.max_nonfinite_steps_in_a_row == 0
    with pytest.raises(ConfigError, match="`rl.max_nonfinite_steps_in_a_row` got -1"):
        load_config(None, ["rl.max_nonfinite_steps_in_a_row=-1"])
