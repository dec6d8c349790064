"""rlhf_core/config/errors.py: a bad config is one sentence naming the field: type words, allowed values,
did-you-mean for unknown keys, TRL's names translated, removed fields naming their replacement."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_core.config import (
    ConfigError,
    load_config,
)

REPO = Path(__file__).resolve().parents[3]


DEMO_YAML = REPO / "configs" / "demo.yaml"


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(DEMO_YAML, list(overrides))
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["ppo.kl_coeff=0.1"],
            "unknown config field `ppo.kl_coeff` (did you mean `ppo.kl_coef`?); the fields allowed in ppo are: kl_coef,",
        ),
        (["nonsense.x=1"], "unknown config field `nonsense`"),
        (
            ["rl.algorithm=kto"],
            "`rl.algorithm` got 'kto': allowed values are 'ppo', 'grpo', 'rloo', 'reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'dpo' or 'online_dpo'",
        ),
        (["grpo.loss_type=sum"], "allowed values are 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo' or 'sapo'"),
        (["grpo.importance_sampling_level=seq"], "allowed values are 'token' or 'sequence'"),
        (["grpo.multi_objective_aggregation=mean"], "allowed values are 'sum_then_normalize' or 'normalize_then_sum'"),
        (["grpo.top_entropy_quantile=1.5"], "`grpo.top_entropy_quantile` got 1.5"),
        (["grpo.delta=0.5"], "`grpo.delta` got 0.5"),
        (
            ["rl.algorithm=grpo", "rl.gradient_accumulation_steps=2", "grpo.steps_per_generation=3"],
            "grpo.steps_per_generation 3 must be a multiple of rl.gradient_accumulation_steps 2",
        ),
        (
            ["rl.algorithm=grpo", "rl.missing_eos_penalty=1", "grpo.multi_objective_aggregation=normalize_then_sum"],
            "rl.missing_eos_penalty is subtracted from the summed reward",
        ),
        (
            ["rl.algorithm=grpo", "grpo.sync_ref_model=true", "grpo.beta=0"],
            "grpo.sync_ref_model needs a reference model, but grpo.beta is 0",
        ),
        (
            ["rl.algorithm=grpo", "grpo.sync_ref_model=true", "grpo.beta=0.1", "model.lora.enabled=true"],
            "grpo.sync_ref_model needs a reference copy",
        ),
        (["rl.algorithm=grpo", "grpo.loss_type=cispo", "grpo.delta=2"], "grpo.delta applies to the clipped losses"),
        (["rl.missing_eos_penalty=1", "rl.stop_token=none"], "missing_eos_penalty needs a stop token"),
        (
            ["rl.algorithm=rloo", "grpo.loss_type=grpo"],
            "grpo.loss_type applies to rl.algorithm grpo and reinforce_plus_plus and reinforce_plus_plus_baseline, not 'rloo'",
        ),
        (
            ["rl.algorithm=grpo", "grpo.normalize_advantages=true"],
            "grpo.normalize_advantages applies to rl.algorithm rloo, not 'grpo'",
        ),
        (
            ["rl.algorithm=reinforce_plus_plus_baseline", "grpo.scale_rewards=group", "grpo.gamma=0.9"],
            "grpo.gamma applies to rl.algorithm reinforce_plus_plus, not 'reinforce_plus_plus_baseline'",
        ),
        (
            ["rl.algorithm=rloo", "grpo.scale_rewards=group", "grpo.reward_clip_range=[2, 1]"],
            "grpo.reward_clip_range [2.0, 1.0] must be [low, high]",
        ),
        (
            ["rl.algorithm=ppo", "grpo.dynamic_sampling.enabled=true"],
            "grpo.dynamic_sampling drops groups of completions",
        ),
        (
            [
                "rl.algorithm=rloo",
                "grpo.scale_rewards=group",
                "grpo.num_generations=8",
                "grpo.generation_batch_size=12",
            ],
            "grpo.generation_batch_size 12 must be a multiple of grpo.num_generations 8",
        ),
        (["ppo.cliprange=-1"], "`ppo.cliprange` got -1: Input should be greater than 0"),
        (
            ["rl.algorithm=dpo", "dpo.loss_type=[sigmoid, kto]"],
            "dpo.loss_type 'kto' is unknown; TRL 1.16's are sigmoid",
        ),
        (["rl.algorithm=dpo", "dpo.loss_type=[exo_pair]"], "dpo.label_smoothing must be above 0 for exo_pair"),
        (["dpo.beta=0.5"], "dpo.beta applies to rl.algorithm dpo and online_dpo, not 'ppo'; remove it"),
        (
            ["rl.algorithm=dpo", "rl.batch_size=10", "rl.gradient_accumulation_steps=4"],
            "rl.batch_size 10 must be a multiple of rl.gradient_accumulation_steps 4",
        ),
        (["run.seed=abc"], "`run.seed` must be an integer, but got 'abc' (a string)"),
        (
            ["rl.algorithm=grpo", "grpo.num_generations=8", "grpo.generation_batch_size=null", "rl.batch_size=12"],
            "rl.batch_size 12 must be a multiple of grpo.num_generations 8",
        ),
        (
            [
                "rl.algorithm=grpo",
                "grpo.generation_batch_size=null",
                "rl.batch_size=8",
                "grpo.num_generations=4",
                "rl.gradient_accumulation_steps=2",
                "grpo.steps_per_generation=16",
            ],
            "rl.batch_size 8 (the generation batch) must be a multiple of grpo.steps_per_generation 16",
        ),
        (
            ["rl.algorithm=grpo", "grpo.generation_batch_size=8", "rl.gradient_accumulation_steps=16"],
            "grpo.generation_batch_size 8 (the generation batch) must be a multiple of rl.gradient_accumulation_steps 16",
        ),
        (["data.prompts.split=validation"], "`data.prompts`: split 'validation' does not exist in the demo world"),
        (["grpo.rewards=[{name: x}]"], "reward 'x' must set exactly one of model or function"),
        (["grpo.rewards=[{name: x, function: nocolon}]"], "must be written 'package.module:function'"),
        (["sft.enabled=false", "init.policy=sft"], "init.policy is 'sft' but the SFT stage is off"),
        (["data.max_prompt_length=64", "data.max_length=32"], "max_prompt_length 64 must be below max_length 32"),
    ],
)
def test_bad_config_is_one_sentence_naming_the_field(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "demo.yaml", overrides)
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rl.total_steps=true", "config field `rl.total_steps` must be an integer, but got true (a boolean)"),
        ("run.seed=false", "config field `run.seed` must be an integer, but got false (a boolean)"),
        ("data.max_length=48.5", "config field `data.max_length` must be an integer, but got 48.5 (a float)"),
        ("ppo.num_ppo_epochs=2.0", "config field `ppo.num_ppo_epochs` must be an integer, but got 2.0 (a float)"),
        ("rl.temperature=true", "config field `rl.temperature` must be a number, but got true (a boolean)"),
        ("ppo.adaptive_kl=1", "config field `ppo.adaptive_kl` must be true or false, but got 1 (an integer)"),
        ("run.name=3", "config field `run.name` must be a string (quote it in YAML), but got 3 (an integer)"),
        (
            "grpo.rewards=[{name: r, model: reward_stage, weight: true}]",
            "`grpo.rewards.0.weight` must be a number, but got true",
        ),
    ],
)
def test_types_are_strict(override, expected):
    assert expected in error_of(override)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("ppo.kl_coeff=0.1", "unknown config field `ppo.kl_coeff` (did you mean `ppo.kl_coef`?)"),
        ("trackng.uri=x", "unknown config field `trackng` (did you mean `tracking`?)"),
        ("rl.response_len=3", "(did you mean `rl.response_length`?)"),
        ("rl.num_generations=4", "(did you mean `grpo.num_generations`?)"),
        ("grpo.rewards=[{name: r, model: reward_stage, weigth: 2}]", "(did you mean `grpo.rewards[0].weight`?)"),
    ],
)
def test_unknown_keys_get_did_you_mean(override, expected):
    message = error_of(override)
    assert expected in message
    assert "the fields allowed in" in message


@pytest.mark.parametrize(
    "override, field",
    [
        ("rl.max_completion_length=32", "`rl.response_length`"),
        ("max_completion_length=32", "`rl.response_length`"),
        ("grpo.reward_funcs=[a.b:c]", "`grpo.rewards`"),
        ("grpo.reward_weights=[1.0]", "`grpo.rewards[].weight`"),
        ("rl.logging_steps=5", "`rl.log_steps`"),
        ("sft.logging_steps=5", "`sft.log_steps`"),
        ("rl.per_device_train_batch_size=8", "`rl.batch_size`"),
        ("reward.per_device_train_batch_size=8", "`reward.batch_size`"),
        ("rl.num_train_epochs=1", "`rl.total_steps` here, steps, not epochs)"),
        ("rl.max_steps=10", "`rl.total_steps`"),
        ("ppo.learning_rate=1e-5", "`sft.learning_rate`, `reward.learning_rate` or `rl.learning_rate`"),
        ("grpo.kl_coef=0.04", "`grpo.beta`"),
        ("ppo.beta=0.04", "`ppo.kl_coef`"),
        ("rl.max_prompt_length=64", "`data.max_prompt_length`"),
        ("rl.stop_token_id=2", "`rl.stop_tokens`"),
        ("rl.lr_scheduler_type=cosine", "`rl.lr_scheduler`"),
        ("model.model_name_or_path=gpt2", "`model.base`"),
        ("model.lora_r=8", "`model.lora.r`"),
    ],
)
def test_trl_names_are_translated(override, field):
    key = override.split("=")[0].rsplit(".", 1)[-1]
    message = error_of(override)
    assert f"(TRL's `{key}` is {field}" in message


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "rl.skip_nonfinite_steps=false",
            "(`rl.skip_nonfinite_steps` was replaced by `rl.max_nonfinite_steps_in_a_row`: 0 stops at the first non-finite step",
        ),
        ("reward.skip_nonfinite_steps=true", "replaced by `reward.max_nonfinite_steps_in_a_row`"),
    ],
)
def test_removed_fields_name_their_replacement(override, expected):
    message = error_of(override)
    assert expected in message
    assert "the fields allowed in" in message


def test_trl_generation_batch_names_point_at_rl_batch_size():
    expected = "(TRL's `generation_batch_size` is `grpo.generation_batch_size` or `rl.batch_size` here, per process"
    assert expected in error_of("rl.generation_batch_size=64")
    assert "completions per RL step" in error_of("rl.per_device_train_batch_size=8")


def test_a_config_error_is_a_user_error_and_a_value_error():
    from rlhf_core.config.errors import UserError

    assert issubclass(ConfigError, UserError) and issubclass(UserError, ValueError)
    with pytest.raises(UserError, match="^config field `rl.total_steps` must be an integer"):
        load_config(DEMO_YAML, ["rl.total_steps=1.5"])
