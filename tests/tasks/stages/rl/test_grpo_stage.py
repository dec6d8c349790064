"""GRPO inside the pipeline: callable rewards skip the reward stage; versions, completions tables, resume."""

from contextlib import chdir
from pathlib import Path

import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.rewards.functions import RewardFunctionError

SMOKE = str(Path(__file__).resolve().parents[4] / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
VADER_ONLY = "grpo.rewards=[{name: vader, function: 'rlhf_core.rewards.functions:vader_compound'}]"


def test_grpo_with_only_callable_rewards_runs_without_a_reward_model(prefect_harness, tmp_path, mlflow_uri):
    overrides = [
        f"run.output_dir={tmp_path / 'out'}",
        f"tracking.uri={mlflow_uri}",
        "rl.algorithm=grpo",
        VADER_ONLY,
        "grpo.log_completions_steps=1",
    ]
    summary = rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    assert client.search_model_versions("name = 'smoke-reward-model'") == []
    versions = sorted(client.search_model_versions("name = 'smoke-policy'"), key=lambda v: int(v.version))
    assert [(v.tags["stage"], v.tags["step"]) for v in versions] == [
        ("sft", "8"),
        ("grpo", "1"),
        ("grpo", "2"),
        ("export", "2"),
    ]
    assert "algorithm" not in versions[2].tags and "- algorithm: `grpo`" in versions[2].description
    # no reward model: no reward_model_version tag, and the description says none
    assert "reward_model_version" not in versions[3].tags and "- reward model: none" in versions[3].description
    assert (
        versions[3].description.startswith("GRPO policy of run ")
        and summary["candidate_uri"] == "models:/smoke-policy/4"
    )
    assert summary["reward_model_uri"] is None and summary["algorithm"] == "grpo"

    parent = client.get_run(summary["mlflow_run_id"])
    [grpo_run] = client.search_runs([parent.info.experiment_id], "attributes.run_name = 'grpo'")
    assert [m.step for m in client.get_metric_history(grpo_run.info.run_id, "rewards/vader/mean")] == [1, 2]
    tables = [a.path for a in client.list_artifacts(grpo_run.info.run_id, "completions")]
    assert tables == ["completions/completions_step_000001.csv", "completions/completions_step_000002.csv"]
    local = client.download_artifacts(grpo_run.info.run_id, tables[0], str(tmp_path))
    frame = pd.read_csv(local)
    assert list(frame.columns) == ["step", "prompt", "completion", "advantage", "reward", "vader"] and len(frame) == 8


def test_a_reward_function_that_cannot_be_imported_stops_before_rl(prefect_harness, tmp_path, mlflow_uri):
    overrides = [
        f"run.output_dir={tmp_path / 'out'}",
        f"tracking.uri={mlflow_uri}",
        "rl.algorithm=grpo",
        "grpo.rewards=[{name: bad, function: 'no_such_module:score'}]",
    ]
    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    with pytest.raises(
        RewardFunctionError, match=r"grpo.rewards\[0\].function: could not import module 'no_such_module'"
    ):
        state.result()
    # the preflight check refuses it before any stage: not even the SFT warm start ran
    assert MlflowClient(mlflow_uri, registry_uri=mlflow_uri).search_model_versions("name = 'smoke-policy'") == []
    assert not (tmp_path / "out").exists()


def test_a_lora_run_exports_adapter_and_merged_model_and_registers_the_merged_one(
    prefect_harness, tmp_path, mlflow_uri
):
    from peft import AutoPeftModelForCausalLM

    from rlhf_core.models.card import read_front_matter

    overrides = [
        f"run.output_dir={tmp_path / 'out'}",
        f"tracking.uri={mlflow_uri}",
        "rl.algorithm=grpo",
        VADER_ONLY,
        "model.lora.enabled=true",
        "export.merge=true",
        f"export.output_dir={tmp_path / 'shipped'}",
    ]
    summary = rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    shipped = tmp_path / "shipped"
    assert summary["export_dir"] == str(shipped.resolve())
    assert (shipped / "model.safetensors").is_file() and (shipped / "adapter" / "adapter_model.safetensors").is_file()
    card = read_front_matter(shipped / "README.md")
    assert card["tags"] == ["rlhf", "grpo", "lora"]
    assert card["base_model"] == "demo" and card["base_model_relation"] == "finetune"
    ids = {"input_ids": torch.tensor([[5, 6, 7]])}
    merged = AutoModelForCausalLM.from_pretrained(shipped)
    with chdir(shipped / "adapter"):  # adapter_config.json names the local base relative to adapter/
        adapter = AutoPeftModelForCausalLM.from_pretrained(".")
    with torch.no_grad():
        torch.testing.assert_close(merged(**ids).logits, adapter(**ids).logits, atol=1e-4, rtol=1e-4)
    candidate = MlflowClient(mlflow_uri, registry_uri=mlflow_uri).get_model_version_by_alias(
        "smoke-policy", "candidate"
    )
    assert candidate.tags["stage"] == "export" and summary["candidate_uri"].endswith(f"/{candidate.version}")
