"""tasks/checks/reward_urls.py: the preflight's first request to each reward served elsewhere, its sentences, and
a probe that fits each kind."""

from rlhf_core.config import load_config
from tasks.checks.reward_urls import preflight_problems, probe_body
from tests.fixtures.scorers import Behaviour, scorer_in_thread


def grpo(*rewards: str, algorithm: str = "grpo"):
    return load_config(None, [f"rl.algorithm={algorithm}", "grpo.rewards=[" + ", ".join(rewards) + "]"])


HTTP = "{name: h, kind: http, url: 'URL/score', max_retries: 0}"
JUDGE = "{name: j, kind: judge, url: 'URL/v1', judge_model: m, labels: {'yes': 1}, template: 'Q {topic}: {completion}'}"


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


def test_a_probe_fits_the_reward_models_kind():
    source = grpo("{name: rm, kind: reward_model, model: reward_stage}").grpo.rewards[0]
    assert probe_body(source) == {
        "dataframe_records": [{"prompt": "(preflight prompt)", "completion": "(preflight completion)"}]
    }
