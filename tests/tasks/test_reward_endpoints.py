"""tasks/reward_endpoints.py: what a served source leaves out of the stage key (and what older in-process keys
keep), the preflight's first request and its sentences, a judge template's columns, this run's reward version."""

import pytest

from rlhf_core.config import load_config
from rlhf_core.config.errors import UserError
from tasks.reward_endpoints import check_template_columns, keyed_rewards, preflight_problems, probe_body, version_uri
from tests.fixtures.scorers import Behaviour, scorer_in_thread


def grpo(*rewards: str, algorithm: str = "grpo"):
    return load_config(None, [f"rl.algorithm={algorithm}", "grpo.rewards=[" + ", ".join(rewards) + "]"])


HTTP = "{name: h, kind: http, url: 'URL/score', max_retries: 0}"
JUDGE = "{name: j, kind: judge, url: 'URL/v1', judge_model: m, labels: {'yes': 1}, template: 'Q {topic}: {completion}'}"


def test_the_key_leaves_out_where_a_scorer_is_reached_and_keeps_in_process_keys_as_they_were():
    a = keyed_rewards(grpo(HTTP.replace("URL", "http://a:1"), "{name: f, function: 'm:f'}"))
    b = keyed_rewards(grpo(HTTP.replace("URL", "http://b:2").replace("max_retries: 0", "timeout_s: 99")))
    assert a[0] == b[0] and "url" not in a[0] and a[0]["kind"] == "http" and a[0]["score_path"] == "score"
    # an in-process source is keyed by the fields it had before served sources existed: older stages resume
    assert a[1] == {"name": "f", "model": None, "function": "m:f", "weight": 1.0, "arguments": {}}
    assert keyed_rewards(grpo(HTTP.replace("URL", "http://a:1").replace("}", ", on_failure: drop_group}")))[0] != a[0]


def test_preflight_asks_each_endpoint_once_and_names_what_fails(monkeypatch):
    with scorer_in_thread() as (url, behaviour):
        assert preflight_problems(grpo(HTTP.replace("URL", url), JUDGE.replace("URL", url))) == []
        assert [s["path"] for s in behaviour.seen] == ["/score", "/v1/chat/completions"]
        assert "(topic)" in behaviour.seen[1]["body"]["messages"][0]["content"]
    with scorer_in_thread(Behaviour(mode="500")) as (url, _):
        [problem] = preflight_problems(grpo(HTTP.replace("URL", url)))
    assert (
        problem
        == f'grpo.rewards[0] (h) at {url}/score did not answer a first request: HTTP 500: {{"error": "boom"}} (on the first attempt)'
    )
    monkeypatch.delenv("NOPE_KEY", raising=False)
    [missing] = preflight_problems(grpo(HTTP.replace("URL", "http://x").replace("}", ", api_key_env: NOPE_KEY}")))
    assert missing == "grpo.rewards[0]: environment variable NOPE_KEY (for the Authorization header) is not set"
    assert (
        preflight_problems(grpo(HTTP.replace("URL", "http://x"), algorithm="ppo")) == []
    )  # PPO reads its reward model


def test_a_template_column_the_prompts_lack_is_refused_in_one_sentence():
    cfg = grpo(JUDGE.replace("URL", "http://x"))
    check_template_columns(cfg, {"prompt", "topic"})
    with pytest.raises(UserError, match=r"grpo.rewards\[0\].template names \{topic\}, which the prompt rows lack"):
        check_template_columns(cfg, {"prompt", "answer"})


def test_the_reward_stage_is_served_only_when_registered_and_probes_fit_each_kind():
    source = grpo("{name: rm, kind: reward_model, model: reward_stage}").grpo.rewards[0]
    assert version_uri(None, source, "models:/reward/3", field="f") == "models:/reward/3"
    with pytest.raises(UserError, match="this run's reward model is not registered"):
        version_uri(None, source, "reward:abc", field="f")
    assert probe_body(source) == {
        "dataframe_records": [{"prompt": "(preflight prompt)", "completion": "(preflight completion)"}]
    }
