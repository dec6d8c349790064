"""rlhf_core/config/training.py: the optimizer, SFT, reward, RL, PPO and GRPO sections: TRL's defaults, non-finite patience,
the sections as the RL stage's key takes them."""

from __future__ import annotations

import hashlib
import json

import pytest

from rlhf_core.config import (
    ConfigError,
    PipelineConfig,
    load_config,
)
from rlhf_core.config.training import keyed_sections


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


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (
            [
                "rl.algorithm=grpo",
                "grpo.dynamic_sampling.enabled=true",
                "grpo.dynamic_sampling.max_rounds=2",
                "rollout.engine=vllm",
                "rollout.correction.mode=token_truncate",
                "rollout.correction.cap=2.0",
                "rollout.correction.min=0.5",
            ],
            "baed6bf160b6002e",
        ),
        ([], "a1ad8bbee27fee73"),
        (["rl.algorithm=rloo", "rollout.max_staleness=1"], "5c1e4cd4839a44f3"),
        (["grpo.dynamic_sampling.max_rounds=5"], "12e2f338ca4e2fa9"),  # ppo: its key held rl.dynamic_sampling too
    ],
)
def test_the_rl_stage_keys_its_sections_as_before_dynamic_sampling_and_the_correction_moved(sets, key):
    """What the RL stage's key (tasks/stages/rl/stage.py `rl_key`) takes from rl, the algorithm's section and rollout,
    hashed as `stage_key` hashes it: each value computed by the code before grpo.dynamic_sampling was rl's and
    rollout.correction.* was rollout.vllm.correction*, so every run directory keeps its keys and resumes."""
    cfg = load_config(None, sets)
    rl, section = keyed_sections(cfg.rl, cfg.ppo, cfg.grpo)
    parts = {"rl": rl, cfg.rl.algorithm: section, "rollout": cfg.rollout.result_fields()}
    assert hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16] == key
    assert "dynamic_sampling" in rl and "dynamic_sampling" not in section
