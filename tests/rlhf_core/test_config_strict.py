"""Strict types (no `true` for an integer) and unknown keys answered with the field this config means."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_core.config import ConfigError, PipelineConfig, load_config

REPO = Path(__file__).resolve().parents[2]
DEMO_YAML = REPO / "configs" / "demo.yaml"


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(DEMO_YAML, list(overrides))
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("override, expected", [
    ("rl.total_steps=true", "config field `rl.total_steps` must be an integer, but got true (a boolean)"),
    ("run.seed=false", "config field `run.seed` must be an integer, but got false (a boolean)"),
    ("data.max_length=48.5", "config field `data.max_length` must be an integer, but got 48.5 (a float)"),
    ("ppo.num_ppo_epochs=2.0", "config field `ppo.num_ppo_epochs` must be an integer, but got 2.0 (a float)"),
    ("rl.temperature=true", "config field `rl.temperature` must be a number, but got true (a boolean)"),
    ("ppo.adaptive_kl=1", "config field `ppo.adaptive_kl` must be true or false, but got 1 (an integer)"),
    ("run.name=3", "config field `run.name` must be a string (quote it in YAML), but got 3 (an integer)"),
    ("grpo.rewards=[{name: r, model: reward_stage, weight: true}]", "`grpo.rewards.0.weight` must be a number, but got true"),
])
def test_types_are_strict(override, expected):
    assert expected in error_of(override)


def test_an_integer_is_a_fine_float_and_strings_are_paths(tmp_path):
    cfg = load_config(DEMO_YAML, ["rl.temperature=1", "rl.learning_rate=1", "ppo.kl_coef=0", f"run.output_dir={tmp_path}",
                                  f"export.output_dir={tmp_path / 'x'}"])
    assert cfg.rl.temperature == 1.0 and isinstance(cfg.rl.temperature, float)
    assert cfg.run.output_dir == tmp_path and cfg.export.output_dir == tmp_path / "x"


def test_assignment_is_strict_too():
    cfg = load_config(DEMO_YAML)
    with pytest.raises(ValueError):
        cfg.rl.total_steps = True
    cfg.run.output_dir = "elsewhere"  # a path field still takes a string
    assert cfg.run.output_dir == Path("elsewhere")


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("**/*.yaml")
                                        if "accelerate" not in p.parts))
def test_every_shipped_config_loads_and_round_trips_through_json(path):
    cfg = load_config(REPO / path)
    assert PipelineConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # as tasks.distributed does


@pytest.mark.parametrize("override, expected", [
    ("ppo.kl_coeff=0.1", "unknown config field `ppo.kl_coeff` (did you mean `ppo.kl_coef`?)"),
    ("trackng.uri=x", "unknown config field `trackng` (did you mean `tracking`?)"),
    ("rl.response_len=3", "(did you mean `rl.response_length`?)"),
    ("rl.num_generations=4", "(did you mean `grpo.num_generations`?)"),
    ("grpo.rewards=[{name: r, model: reward_stage, weigth: 2}]", "(did you mean `grpo.rewards[0].weight`?)"),
])
def test_unknown_keys_get_did_you_mean(override, expected):
    message = error_of(override)
    assert expected in message
    assert "the fields allowed in" in message


@pytest.mark.parametrize("override, field", [
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
])
def test_trl_names_are_translated(override, field):
    key = override.split("=")[0].rsplit(".", 1)[-1]
    message = error_of(override)
    assert f"(TRL's `{key}` is {field}" in message


@pytest.mark.parametrize("override, expected", [
    ("rl.skip_nonfinite_steps=false",
     "(`rl.skip_nonfinite_steps` was replaced by `rl.max_nonfinite_steps_in_a_row`: 0 stops at the first non-finite step"),
    ("reward.skip_nonfinite_steps=true", "replaced by `reward.max_nonfinite_steps_in_a_row`"),
])
def test_removed_fields_name_their_replacement(override, expected):
    message = error_of(override)
    assert expected in message
    assert "the fields allowed in" in message


def test_trl_generation_batch_names_point_at_rl_batch_size():
    assert "(TRL's `generation_batch_size` is `rl.batch_size` here, per process" in error_of("rl.generation_batch_size=64")
    assert "completions per RL step" in error_of("rl.per_device_train_batch_size=8")
