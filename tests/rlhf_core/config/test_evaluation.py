"""The evaluation section: the sampled evaluation's columns, its pass@k bounds and its verifier."""

import pytest

from rlhf_core.config import ConfigError, EvalConfig, PipelineConfig, validate_config


def test_sampled_columns_exist_only_with_several_samples():
    assert EvalConfig().sampled_columns() == []
    cfg = EvalConfig(samples_per_prompt=8, pass_at_k=[1, 4])
    assert cfg.sampled_columns() == ["pass_at_1", "pass_at_4", "maj_at_8"]


def test_pass_at_k_must_fit_the_samples():
    with pytest.raises(ValueError, match="eval.pass_at_k 9 must be between 1 and eval.samples_per_prompt 8"):
        EvalConfig(samples_per_prompt=8, pass_at_k=[9])


def test_the_verifier_is_the_first_metric_unless_named_and_must_be_one():
    metrics = ["rlhf_core.rewards.functions:exact_match"]
    cfg = PipelineConfig.model_validate({"eval": {"metrics": metrics, "samples_per_prompt": 4, "pass_at_k": [2]}})
    assert cfg.verifier() == "exact_match"
    assert cfg.metric_names() == ["exact_match", "pass_at_2", "maj_at_4"]  # promotion and the guard may name them
    with pytest.raises(
        ConfigError, match="eval.verifier 'accuracy', which is not an eval metric; allowed: 'exact_match'"
    ):
        validate_config({"eval": {"metrics": metrics, "samples_per_prompt": 4, "verifier": "accuracy"}})
