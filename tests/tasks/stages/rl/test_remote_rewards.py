"""tasks/stages/rl/remote_rewards.py: what a served source leaves out of the stage key (and what older in-process keys
keep), a judge template's columns, this run's reward version."""

import pytest

from rlhf_core.config.errors import UserError
from tasks.stages.rl.remote_rewards import check_template_columns, keyed_rewards, version_uri
from tests.tasks.checks.test_reward_urls import HTTP, JUDGE, grpo


def test_the_key_leaves_out_where_a_scorer_is_reached_and_keeps_in_process_keys_as_they_were():
    a = keyed_rewards(grpo(HTTP.replace("URL", "http://a:1"), "{name: f, function: 'm:f'}"))
    b = keyed_rewards(grpo(HTTP.replace("URL", "http://b:2").replace("max_retries: 0", "timeout_s: 99")))
    assert a[0] == b[0] and "url" not in a[0] and a[0]["kind"] == "http" and a[0]["score_path"] == "score"
    # an in-process source is keyed by the fields it had before served sources existed: older stages resume
    assert a[1] == {"name": "f", "model": None, "function": "m:f", "weight": 1.0, "arguments": {}}
    assert keyed_rewards(grpo(HTTP.replace("URL", "http://a:1").replace("}", ", on_failure: drop_group}")))[0] != a[0]


def test_a_template_column_the_prompts_lack_is_refused_in_one_sentence():
    cfg = grpo(JUDGE.replace("URL", "http://x"))
    check_template_columns(cfg, {"prompt", "topic"})
    with pytest.raises(UserError, match=r"grpo.rewards\[0\].template names \{topic\}, which the prompt rows lack"):
        check_template_columns(cfg, {"prompt", "answer"})


def test_the_reward_stage_is_served_only_when_registered():
    source = grpo("{name: rm, kind: reward_model, model: reward_stage}").grpo.rewards[0]
    assert version_uri(None, source, "models:/reward/3", field="f") == "models:/reward/3"
    with pytest.raises(UserError, match="this run's reward model is not registered"):
        version_uri(None, source, "reward:abc", field="f")
