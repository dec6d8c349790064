"""rlhf_core/config/rewards.py: grpo.rewards entries, in-process and served: the shape scripts rely on, each
kind's own fields refused on another, credentials only as environment variable names (never echoed), and the
template's placeholders."""

import pytest

from rlhf_core.config import ConfigError, RewardSource
from rlhf_core.config.loading import validate_config
from rlhf_core.config.rewards import template_fields


def grpo_with(entry: dict):
    return validate_config({"rl": {"algorithm": "grpo"}, "grpo": {"rewards": [entry]}})


def test_the_documented_shape_of_a_served_reward_model():
    cfg = grpo_with({"name": "rm", "kind": "reward_model", "url": "http://host:5001/invocations", "weight": 1.0})
    source = cfg.grpo.rewards[0]
    assert source.remote and not source.served_by_stage and source.on_failure == "fail" and source.token_ids
    stage = RewardSource(name="rm", kind="reward_model", model="models:/reward@champion")
    assert stage.served_by_stage and not cfg.trains_reward_model()
    assert grpo_with({"name": "rm", "kind": "reward_model", "model": "reward_stage"}).trains_reward_model()


@pytest.mark.parametrize(
    ("entry", "sentence"),
    [
        (
            {"name": "r", "function": "m:f", "url": "http://x"},
            "reward 'r' sets url, which only kind reward_model or judge or http takes",
        ),
        (
            {"name": "r", "kind": "http", "url": "http://x", "template": "{completion}"},
            "sets template, which only kind judge takes",
        ),
        (
            {"name": "r", "kind": "reward_model", "url": "http://x", "model": "models:/a/1"},
            "exactly one of url or model",
        ),
        ({"name": "r", "kind": "reward_model", "model": "/some/dir"}, "'reward_stage' or a models:/ URI"),
        ({"name": "r", "kind": "http"}, "needs the url of its endpoint"),
        (
            {"name": "r", "kind": "judge", "url": "http://x", "template": "{completion}"},
            "needs judge_model and template",
        ),
        (
            {
                "name": "r",
                "kind": "judge",
                "url": "http://x",
                "judge_model": "j",
                "template": "{prompt}",
                "labels": {"y": 1.0},
            },
            "must show {completion}, what it judges",
        ),
        (
            {"name": "r", "kind": "judge", "url": "http://x", "judge_model": "j", "template": "{completion}"},
            "exactly one of score_range or labels",
        ),
        (
            {"name": "r", "kind": "http", "url": "http://x", "on_failure": "score"},
            "failure_score is set exactly when on_failure is score",
        ),
        ({"name": "r", "kind": "http", "url": "ftp://x"}, "must be an http:// or https:// URL"),
    ],
)
def test_each_kind_takes_its_own_fields(entry, sentence):
    with pytest.raises(
        ConfigError, match=sentence.replace("(", r"\(").replace(")", r"\)").replace("{", r"\{").replace("}", r"\}")
    ):
        grpo_with(entry)


@pytest.mark.parametrize(
    ("entry", "secret"),
    [
        ({"name": "r", "kind": "http", "url": "http://x", "api_key_env": "sk-live-abc123"}, "sk-live-abc123"),
        ({"name": "r", "kind": "http", "url": "http://x", "headers_env": {"X-Key": "tok en!"}}, "tok en!"),
        ({"name": "r", "kind": "http", "url": "http://user:hunter2@x/score"}, "hunter2"),
    ],
)
def test_a_credential_in_the_config_is_refused_without_being_echoed(entry, secret):
    with pytest.raises(ConfigError) as refused:
        grpo_with(entry)
    assert secret not in str(refused.value)
    assert "environment variable" in str(refused.value) or "api_key_env" in str(refused.value)


def test_template_fields_in_order_without_literal_braces():
    assert template_fields("{{json}} {prompt} {answer.x} {completion} {prompt}") == ["prompt", "answer", "completion"]
