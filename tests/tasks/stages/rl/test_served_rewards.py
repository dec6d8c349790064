"""Rewards served elsewhere, in the pipeline (docs/served-rewards.md):

- the demo's reward model served by `mlflow models serve` (the stage serves this run's version itself) gives
  GRPO the same rewards, step by step, and on the same seed the same final weights as the in-process one, bit
  for bit (`make served-rewards` shows it at the demo's size, 40 steps);
- a judge on a local OpenAI-compatible server (tests/fixtures/scorers.py) scores a GRPO run end to end, its
  scores in the evaluation table, its requests and latencies logged, its bearer token nowhere;
- faults (tests/tasks/stages/rl/test_served_reward_faults.py).
"""

import os
from pathlib import Path

import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from flows.rlhf_pipeline import rlhf_pipeline
from tests.fixtures.scorers import Behaviour, scorer_in_thread

REPO = Path(__file__).resolve().parents[4]
SMOKE = str(REPO / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
SERVED_RM = "grpo.rewards=[{name: reward_model, kind: reward_model, model: reward_stage}]"
TOKEN = "sk-judge-7f3a9c"  # the judge's bearer token: in the environment only


def grpo_run(client: MlflowClient, summary: dict):
    parent = client.get_run(summary["mlflow_run_id"])
    query = f"attributes.run_name = 'grpo' and tags.mlflow.parentRunId = '{parent.info.run_id}'"
    [run] = client.search_runs([parent.info.experiment_id], query)
    return run


def history(client: MlflowClient, run, name: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)]


def supervised_servers() -> list[int]:
    """Processes whose command names the server supervisor and this test process as its owner."""
    alive = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"rlhf_vllm_supervisor.py") for a in args) and str(os.getpid()).encode() in args:
            alive.append(int(cmdline.parent.name))
    return alive


def test_a_served_reward_model_gives_the_in_process_rewards_and_weights(prefect_harness, tmp_path, mlflow_uri):
    common = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", "rl.algorithm=grpo", "run.seed=42"]
    common += ["rl.total_steps=3", "eval.every_steps=3"]
    in_process = rlhf_pipeline(config_path=SMOKE, overrides=common)
    weights_a = load_file(Path(in_process["export_dir"]) / "model.safetensors")  # the next run exports there too
    served = rlhf_pipeline(config_path=SMOKE, overrides=[*common, SERVED_RM])
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    a, b = grpo_run(client, in_process), grpo_run(client, served)
    assert (
        a.info.run_id != b.info.run_id
    )  # a stage of its own (its own key), from the same reused SFT and reward stages
    rewards_a, rewards_b = (
        history(client, a, "rewards/reward_model/mean"),
        history(client, b, "rewards/reward_model/mean"),
    )
    # the same ids laid out in the same widths, in one pass: the served scores are the in-process ones bit for bit
    assert len(rewards_a) == 3 and rewards_a == rewards_b
    assert history(client, b, "rewards/reward_model/requests")[0] >= 1  # it did go over HTTP
    assert history(client, b, "rewards/reward_model/failures") == [0.0, 0.0, 0.0]
    assert history(client, b, "rewards/reward_model/latency_p50_s")[0] > 0
    weights_b = load_file(Path(served["export_dir"]) / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_b[name], weights_a[name]), name
    assert supervised_servers() == []  # the stage's `mlflow models serve` is gone with it


def test_a_judge_on_an_openai_compatible_server_scores_a_grpo_run(prefect_harness, tmp_path, mlflow_uri, monkeypatch):
    monkeypatch.setenv("JUDGE_TOKEN", TOKEN)
    with scorer_in_thread(Behaviour(token=TOKEN)) as (url, behaviour):
        judge = (
            "grpo.rewards=[{name: judge, kind: judge, url: '" + url + "/v1', judge_model: demo-judge, "
            "api_key_env: JUDGE_TOKEN, score_range: [0, 10], "
            "template: 'How positive is this reply to {prompt}? Answer 0 to 10. Completion: {completion}'}]"
        )
        overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", "rl.algorithm=grpo", judge]
        summary = rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    run = grpo_run(client, summary)
    assert summary["reward_model_uri"] is None  # a judge needs no reward stage
    assert len(history(client, run, "rewards/judge/mean")) == 2
    requests = history(client, run, "rewards/judge/requests")
    assert requests == [8.0, 8.0]  # 2 prompts x 4 generations per step
    assert behaviour.seen[0]["path"] == "/v1/chat/completions" and behaviour.seen[0]["body"]["temperature"] == 0.0
    assert all(r["headers"]["Authorization"] == f"Bearer {TOKEN}" for r in behaviour.seen)
    # the evaluation table carries the judge's score of each held-out completion
    evals = [a.path for a in client.list_artifacts(run.info.run_id, "eval")]
    table = client.download_artifacts(run.info.run_id, next(p for p in evals if p.endswith(".csv")), str(tmp_path))
    frame = pd.read_csv(table)
    assert "reward_judge" in frame.columns and frame["reward_judge"].between(0, 10).all()
    # the token: in the requests only
    needle = TOKEN.encode()
    assert [p for p in (tmp_path / "out").rglob("*") if p.is_file() and needle in p.read_bytes()] == []
    params = client.get_run(run.info.run_id).data.params
    assert TOKEN not in str(params) and "JUDGE_TOKEN" in str(params)
