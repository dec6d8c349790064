"""The reward stage inside the pipeline: crash and resume, bad inputs, no duplicate versions."""

import dataclasses
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import flows.rlhf_pipeline
import tasks.registry
import tasks.reporting.background
import tasks.stages.reward_model
from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.models.loading import ModelSourceError

SMOKE = str(Path(__file__).resolve().parents[3] / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def reward_versions(client):
    versions = client.search_model_versions("name = 'smoke-reward-model'")
    return sorted((int(v.version), v.tags["step"]) for v in versions)


def test_a_crash_mid_training_resumes_without_duplicate_versions(prefect_harness, tmp_path, mlflow_uri, monkeypatch):
    # given a pipeline whose reward training crashes at step 3, after checkpoint-2 was registered
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", "reward.log_steps=1"]
    real = tasks.stages.reward_model.train_reward_model

    def crashing(*args, hooks, **kwargs):
        def log(metrics, step):
            hooks.on_log(metrics, step)
            if step == 3:
                raise RuntimeError("injected crash at step 3")

        return real(*args, hooks=dataclasses.replace(hooks, on_log=log), **kwargs)

    monkeypatch.setattr(tasks.stages.reward_model, "train_reward_model", crashing)
    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    assert state.is_failed()
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    assert reward_versions(client) == [(1, "2")]

    # when it runs again
    monkeypatch.setattr(tasks.stages.reward_model, "train_reward_model", real)
    summary = rlhf_pipeline(config_path=SMOKE, overrides=overrides)

    # then training continued from step 2 and each checkpoint is registered exactly once
    assert reward_versions(client) == [(1, "2"), (2, "4")]
    runs = client.search_runs(
        [client.get_experiment_by_name("rlhf-smoke").experiment_id],
        "attributes.run_name = 'reward'",
        order_by=["attributes.start_time ASC"],
    )
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]
    assert [m.step for m in client.get_metric_history(runs[1].info.run_id, "reward/loss")] == [3, 4]
    assert summary["reward_model_uri"] == "models:/smoke-reward-model/2"


def test_a_checkpoint_saved_but_not_registered_is_registered_on_the_next_run(
    prefect_harness, tmp_path, mlflow_uri, monkeypatch
):
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}"]
    real = tasks.registry.register_once

    def registry_down_at_step_4(path, name, *, tags, **kwargs):
        if tags.get("stage") == "reward" and tags["step"] == "4":
            raise ConnectionError("tracking server unreachable")
        return real(path, name, tags=tags, **kwargs)

    monkeypatch.setattr(tasks.registry, "register_once", registry_down_at_step_4)
    # the task's three retries (tasks/runtime/retry.py) and the registration thread's fail the same way: no back-off
    monkeypatch.setattr(
        flows.rlhf_pipeline, "reward_stage", tasks.stages.reward_model.reward_stage.with_options(retry_delay_seconds=0)
    )
    monkeypatch.setattr(tasks.reporting.background.BackgroundJobs, "backoff_s", 0.0)
    assert rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True).is_failed()
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    assert reward_versions(client) == [(1, "2")]

    monkeypatch.setattr(tasks.registry, "register_once", real)
    rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    assert reward_versions(client) == [(1, "2"), (2, "4")]


def test_a_missing_reward_base_fails_before_any_training(prefect_harness, tmp_path, mlflow_uri):
    overrides = [
        f"run.output_dir={tmp_path / 'out'}",
        f"tracking.uri={mlflow_uri}",
        f"reward.base={tmp_path / 'no-model'}",
    ]
    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    with pytest.raises(ModelSourceError, match=r"^reward.base: directory .*no-model does not exist$"):
        state.result()
    assert MlflowClient(mlflow_uri, registry_uri=mlflow_uri).search_registered_models() == []
    assert not (tmp_path / "out" / "sft").exists()


def test_a_reward_tokenizer_with_no_pad_and_no_eos_is_refused(prefect_harness, tmp_path, mlflow_uri, smoke_world):
    base = tmp_path / "no-pad-model"
    shutil.copytree(smoke_world.base_model, base)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    tokenizer.save_pretrained(base)
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", f"reward.base={base}"]
    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    with pytest.raises(ModelSourceError, match="has no pad token and no eos token to borrow"):
        state.result()
    assert MlflowClient(mlflow_uri, registry_uri=mlflow_uri).search_model_versions("name = 'smoke-reward-model'") == []


def test_a_worker_without_the_output_directory_reuses_the_registered_reward_model(
    prefect_harness, tmp_path, mlflow_uri, monkeypatch
):
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}"]
    first = rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    before = reward_versions(client)
    # another machine, or a wiped disk: the stage's checkpoints are gone, the registry still has them
    shutil.rmtree(tmp_path / "out" / "reward")

    def must_not_train(*args, **kwargs):
        raise AssertionError("the registered reward model should have been reused")

    monkeypatch.setattr(tasks.stages.reward_model, "train_reward_model", must_not_train)
    again = rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    assert again["reward_model_uri"] == first["reward_model_uri"]
    assert reward_versions(client) == before
    assert again["metrics"]["reward/eval_accuracy"] == pytest.approx(first["metrics"]["reward/eval_accuracy"], abs=1e-4)
