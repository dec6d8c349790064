"""RLVR in the pipeline: the arithmetic world (data.demo.world arithmetic) with a verifier as the only reward.

No preference tables and no reward stage; a group algorithm whose name has underscores (stage, directories,
artifact keys, version tags); the eval's accuracy, pass@k and maj@n; promotion gated on exact match."""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.promote import rlhf_promote
from flows.rlhf_pipeline import rlhf_pipeline

SMOKE = str(Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
EXACT = "rlhf_core.rewards.functions:exact_match"
ARITHMETIC = [
    "data.demo.world=arithmetic",
    "data.demo.num_labelled=64",
    "data.demo.num_train_prompts=32",
    "data.demo.num_eval_prompts=8",
    "data.max_length=16",
    "data.max_prompt_length=8",
    "rl.response_length=5",
    f"grpo.rewards=[{{name: exact_match, function: '{EXACT}'}}]",
    f"eval.metrics=['{EXACT}']",
    "eval.greedy=true",
    "eval.samples_per_prompt=4",
    "eval.pass_at_k=[1, 2]",
    f"promote.evaluator.metrics=['{EXACT}']",
]


def test_a_verifier_only_run_skips_the_reward_stage_and_reports_accuracy_pass_at_k_and_maj_at_n(
    prefect_harness, tmp_path, mlflow_uri
):
    overrides = [
        f"run.output_dir={tmp_path / 'out'}",
        f"tracking.uri={mlflow_uri}",
        "rl.algorithm=reinforce_plus_plus_baseline",
        *ARITHMETIC,
    ]
    summary = rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    assert summary["reward_model_uri"] is None and summary["algorithm"] == "reinforce_plus_plus_baseline"
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    assert client.search_model_versions("name = 'smoke-reward-model'") == []
    versions = sorted(client.search_model_versions("name = 'smoke-policy'"), key=lambda v: int(v.version))
    assert [v.tags["stage"] for v in versions[1:]] == ["reinforce_plus_plus_baseline"] * 2 + ["export"]
    assert "- algorithm: `reinforce_plus_plus_baseline`" in versions[3].description
    parent = client.get_run(summary["mlflow_run_id"])
    runs = {r.info.run_name: r for r in client.search_runs([parent.info.experiment_id])}
    assert "reward" not in runs and {"data", "sft", "reinforce_plus_plus_baseline", "export"} <= set(runs)
    rl_metrics = runs["reinforce_plus_plus_baseline"].data.metrics
    for name in ("eval/exact_match_mean", "eval/pass_at_1_mean", "eval/pass_at_2_mean", "eval/maj_at_4_mean"):
        assert 0.0 <= rl_metrics[name] <= 1.0, name
    assert rl_metrics["eval/pass_at_2_mean"] >= rl_metrics["eval/pass_at_1_mean"]
    data_inputs = {i.dataset.name for i in client.get_run(runs["data"].info.run_id).inputs.dataset_inputs}
    assert not any(name.startswith("data.preference") for name in data_inputs), data_inputs

    promoted = rlhf_promote(config_path=SMOKE, overrides=[*overrides, "promote.min_value=0.0"])
    assert promoted["candidate"] == str(versions[-1].version)
    judged = promoted["candidate_summary"]  # evaluated as the RL stage evaluates: with the answers, and sampled
    assert 0.0 <= judged["eval/exact_match_mean"] <= 1.0 and "eval/maj_at_4_mean" in judged
