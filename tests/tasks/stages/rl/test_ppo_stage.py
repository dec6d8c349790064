"""The PPO stage inside the pipeline: resume without duplicate versions, and refusals before any RL work."""

import dataclasses
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import tasks.stages.rl.stage
from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.config import load_config
from rlhf_core.demo.world import build_demo_world
from rlhf_core.models.loading import ModelSourceError

SMOKE = str(Path(__file__).resolve().parents[4] / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def ppo_versions(client):
    versions = client.search_model_versions("name = 'smoke-policy'")
    return sorted((int(v.version), v.tags["stage"], v.tags["step"]) for v in versions if v.tags["stage"] == "ppo")


def test_a_crash_in_ppo_resumes_from_the_last_checkpoint_without_duplicate_versions(
    prefect_harness, tmp_path, mlflow_uri, monkeypatch
):
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", "rl.total_steps=3"]
    real = tasks.stages.rl.stage.TRAINERS["ppo"]

    def crashing(inputs):
        def log(metrics, step):
            inputs.hooks.on_log(metrics, step)
            if step == 2:
                raise RuntimeError("injected crash at step 2")

        return real(dataclasses.replace(inputs, hooks=dataclasses.replace(inputs.hooks, on_log=log)))

    monkeypatch.setitem(tasks.stages.rl.stage.TRAINERS, "ppo", crashing)
    assert rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True).is_failed()
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    assert [s for _, _, s in ppo_versions(client)] == ["1"]

    monkeypatch.setitem(tasks.stages.rl.stage.TRAINERS, "ppo", real)
    summary = rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    assert [s for _, _, s in ppo_versions(client)] == ["1", "2", "3"]
    runs = client.search_runs(
        [client.get_experiment_by_name("rlhf-smoke").experiment_id],
        "attributes.run_name = 'ppo'",
        order_by=["attributes.start_time ASC"],
    )
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]
    assert [m.step for m in client.get_metric_history(runs[1].info.run_id, "objective/kl")] == [2, 3]
    assert summary["policy_model_uri"] == f"models:/smoke-policy/{ppo_versions(client)[-1][0]}"


def test_prompts_and_responses_longer_than_the_context_are_refused(prefect_harness, tmp_path, mlflow_uri):
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", "rl.response_length=60"]
    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    with pytest.raises(
        ValueError,
        match=r"data.max_prompt_length 20 \+ rl.response_length 60 = 80 tokens exceeds the policy's context of 64",
    ):
        state.result()
    assert ppo_versions(MlflowClient(mlflow_uri, registry_uri=mlflow_uri)) == []


def test_a_reward_model_with_another_tokenizer_is_refused(prefect_harness, tmp_path, mlflow_uri):
    cfg = load_config(SMOKE)
    other = build_demo_world(
        tmp_path / "other", 99, cfg.data.demo.model_copy(update={"num_sentences": 80}), cfg.model.demo
    )
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", f"reward.base={other.base_model}"]
    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    with pytest.raises(
        ModelSourceError, match="reward model's tokenizer .* does not match the policy's .*: their vocabularies differ"
    ):
        state.result()
    assert ppo_versions(MlflowClient(mlflow_uri, registry_uri=mlflow_uri)) == []
