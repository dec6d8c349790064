"""The reward and PPO tasks on two CPU processes (torchrun, gloo): one set of versions, logs streamed.
(GRPO on two processes, under torchrun and Ray: tests/distributed/test_ray_launcher.py.)"""

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
