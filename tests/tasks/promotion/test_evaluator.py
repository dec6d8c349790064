"""promote.evaluator resolved for a candidate: each fault a user can make refused in one sentence, before generation."""

from types import SimpleNamespace

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from rlhf_core.config import load_config
from rlhf_core.config.errors import UserError
from rlhf_core.config.evaluation import Evaluator, PairwiseJudge
from rlhf_core.rewards.remote import RemoteRewardError
from tasks.promotion.evaluator import check_approval_server, check_judge_columns, resolve

TEMPLATE = "{prompt} ({topic})\nA: {completion_a}\nB: {completion_b}"


def candidate(reward_model: str | None = None):
    tags = {"reward_model_version": reward_model} if reward_model else {}
    return SimpleNamespace(version="4", tags=tags, description="")


def judge(**extra) -> PairwiseJudge:
    return PairwiseJudge(url="http://j/v1", judge_model="j", template=TEMPLATE, labels={"A": 1.0, "B": 0.0}, **extra)


def test_a_reward_model_that_does_not_resolve_is_named(mlflow_uri):
    from tasks import tracking

    tracking.store.configure(mlflow_uri)
    with pytest.raises(UserError, match=r"^promote.evaluator.reward_model does not resolve: .*models:/rm@gold"):
        resolve(Evaluator("reward_model", "score", reward_model="models:/rm@gold"), candidate())


def test_the_training_reward_needs_the_candidates_reward_model():
    plan = Evaluator("training_reward", "score")
    assert resolve(plan, candidate("models:/rm/2")).reward_model == "models:/rm/2"
    with pytest.raises(UserError, match="version 4 names none"):
        resolve(plan, candidate())


def test_a_metric_function_that_does_not_import_is_named():
    with pytest.raises(UserError, match="promote.evaluator.metrics") as err:
        resolve(Evaluator("metrics", "nope", metrics=("no_such_module:nope",)), candidate())
    assert "\n" not in str(err.value)
    ok = resolve(Evaluator("metrics", "exact_match", metrics=("rlhf_core.rewards.functions:exact_match",)), candidate())
    assert ok.reward_model is None and ok.judge is None


def test_a_judge_needs_its_credentials_and_the_columns_it_names(monkeypatch):
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    with pytest.raises(RemoteRewardError, match="environment variable JUDGE_KEY"):
        resolve(Evaluator("judge", None, judge=judge(api_key_env="JUDGE_KEY")), candidate())
    judging = resolve(Evaluator("judge", None, judge=judge()), candidate())
    check_judge_columns(judging, {"topic"})
    with pytest.raises(UserError, match="judge's template names topic, which the held-out prompt rows do not have"):
        check_judge_columns(judging, {"answer"})


def test_approval_needs_a_prefect_server_the_approver_can_open(tmp_path):
    cfg = load_config("configs/demo.yaml", ["promote.approval=required"])
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        with pytest.raises(UserError, match="promote.approval is required, but no Prefect server is set"):
            check_approval_server(cfg)
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        check_approval_server(cfg)
    check_approval_server(load_config("configs/demo.yaml"))  # approval none: no server needed
