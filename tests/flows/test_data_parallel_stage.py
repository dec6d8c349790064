"""The reward and PPO tasks on two CPU processes (torchrun, gloo): one set of versions, logs streamed."""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.rlhf_pipeline import rlhf_pipeline

SMOKE = str(Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def test_two_process_stages_register_exactly_one_set_of_versions(prefect_harness, tmp_path, mlflow_uri, caplog):
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", "run.num_processes=2"]
    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    rewards = sorted(
        (int(v.version), v.tags["step"]) for v in client.search_model_versions("name = 'smoke-reward-model'")
    )
    assert [step for _, step in rewards] == ["2", "4"]
    policies = sorted(client.search_model_versions("name = 'smoke-policy'"), key=lambda v: int(v.version))
    assert [(v.tags["stage"], v.tags["step"]) for v in policies] == [
        ("sft", "8"),
        ("ppo", "1"),
        ("ppo", "2"),
        ("export", "2"),
    ]
    assert summary["reward_model_uri"] == f"models:/smoke-reward-model/{rewards[-1][0]}"
    # one MLflow run per stage: the second process never opened one
    parent = client.get_run(summary["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.info.run_name for r in children) == ["data", "export", "ppo", "reward", "sft"]
    # the processes' log went through the task's logger
    messages = [r.getMessage() for r in caplog.records]
    assert any("reward stage on 2 processes: " in m and "torchrun" in m for m in messages)
    assert any(m.startswith("[rank 0] reward checkpoint 4 is models:/smoke-reward-model/") for m in messages)


def test_two_process_grpo_stage_registers_each_checkpoint_once_and_logs_once_per_step(
    prefect_harness, tmp_path, mlflow_uri
):
    overrides = [
        f"run.output_dir={tmp_path / 'out'}",
        f"tracking.uri={mlflow_uri}",
        "run.num_processes=2",
        "rl.algorithm=grpo",
        "grpo.rewards=[{name: vader, function: 'rlhf_core.reward_functions:vader_compound'}]",
    ]
    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    policies = sorted(client.search_model_versions("name = 'smoke-policy'"), key=lambda v: int(v.version))
    assert [(v.tags["stage"], v.tags["step"]) for v in policies] == [
        ("sft", "8"),
        ("grpo", "1"),
        ("grpo", "2"),
        ("export", "2"),
    ]
    parent = client.get_run(summary["mlflow_run_id"])
    [grpo_run] = client.search_runs([parent.info.experiment_id], "attributes.run_name = 'grpo'")
    # one writer: one value per step; with 2 processes of 8 completions each, 16 x 6 tokens at most
    assert [m.step for m in client.get_metric_history(grpo_run.info.run_id, "rewards/vader/mean")] == [1, 2]
    lengths = client.get_metric_history(grpo_run.info.run_id, "completions/mean_length")
    assert [m.step for m in lengths] == [1, 2] and all(1.0 <= m.value <= 6.0 for m in lengths)
