import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.data.rows import DataValidationError
from rlhf_core.models.card import read_front_matter
from tasks.stages.rl.evaluation_report import kl_guide
from tests.flows.test_secrets import prefect_records

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def child_runs(client, parent_id):
    parent = client.get_run(parent_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    return {r.info.run_name: r for r in runs}


def test_pipeline_runs_registers_and_reuses_finished_stages(prefect_harness, tmp_path, mlflow_uri):
    # given
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}"]
    # when
    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    # then
    assert state.is_completed()
    summary = state.result()
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    assert client.get_run(summary["mlflow_run_id"]).info.status == "FINISHED"
    stages = child_runs(client, summary["mlflow_run_id"])
    assert {name: r.info.status for name, r in stages.items()} == {
        "data": "FINISHED",
        "sft": "FINISHED",
        "reward": "FINISHED",
        "ppo": "FINISHED",
        "export": "FINISHED",
    }
    assert client.get_metric_history(stages["sft"].info.run_id, "sft/loss")[-1].step == 8
    # each stage run carries its config section as parameters: two runs compare on them in the UI
    assert stages["ppo"].data.params["ppo.kl_coef"] and stages["ppo"].data.params["rl.learning_rate"]
    assert "sft.learning_rate" in stages["sft"].data.params and "reward.max_steps" in stages["reward"].data.params
    assert not any(k.startswith(("sft.", "reward.")) for k in stages["ppo"].data.params)
    # every logged model, also those the background registration thread logs, is in the run's experiment
    experiment = client.get_run(summary["mlflow_run_id"]).info.experiment_id
    logged = client.search_logged_models([experiment, "0"], max_results=100)
    assert len(logged) == 6 and {m.experiment_id for m in logged} == {experiment}
    ppo_model = next(m for m in logged if m.name == "ppo-step-2")
    assert ppo_model.params["ppo.kl_coef"] == stages["ppo"].data.params["ppo.kl_coef"]
    assert "sft_loss.png" in [a.path for a in client.list_artifacts(stages["sft"].info.run_id)]
    assert stages["data"].data.tags["data_fingerprint"] == summary["data_fingerprint"]

    reward_versions = sorted(client.search_model_versions("name = 'smoke-reward-model'"), key=lambda v: int(v.version))
    assert [(v.tags["stage"], v.tags["step"]) for v in reward_versions] == [("reward", "2"), ("reward", "4")]
    assert reward_versions[-1].tags["base_model"] == "models:/smoke-policy/1"
    assert float(reward_versions[-1].tags["eval_accuracy"]) == pytest.approx(
        summary["metrics"]["reward/eval_accuracy"], abs=1e-4
    )
    assert summary["reward_model_uri"] == "models:/smoke-reward-model/2"
    eval_history = client.get_metric_history(stages["reward"].info.run_id, "eval_accuracy")
    assert [m.step for m in eval_history] == [2, 4]

    policy_versions = sorted(client.search_model_versions("name = 'smoke-policy'"), key=lambda v: int(v.version))
    assert [(v.tags["stage"], v.tags["step"]) for v in policy_versions] == [
        ("sft", "8"),
        ("ppo", "1"),
        ("ppo", "2"),
        ("export", "2"),
    ]
    sft_version, ppo_version = policy_versions[0], policy_versions[2]
    assert sft_version.tags["data_fingerprint"] == summary["data_fingerprint"]
    assert "algorithm" not in ppo_version.tags and "- algorithm: `ppo`" in ppo_version.description  # the stage says it
    assert ppo_version.tags["reward_model_version"] == "models:/smoke-reward-model/2"
    assert ppo_version.tags["base_model"] == "models:/smoke-policy/1"
    assert ppo_version.tags["run_label"] == "smoke-ppo-seed7"
    # the training KL estimate is read on the version's page, not filtered on: its description has it
    kl = re.search(r"training KL estimate at this step \(k1, sampled, nats\): `([-\d.]+)`", ppo_version.description)
    assert "kl" not in ppo_version.tags and float(kl[1]) == pytest.approx(summary["metrics"]["objective/kl"], abs=1e-3)
    for version in policy_versions + reward_versions:  # a few tags a person filters on, none empty
        assert len(version.tags) <= 10 and "" not in version.tags.values(), version.tags
        assert (  # the first line plain text: MLflow's list of versions shows it raw
            version.description.startswith(f"{version.tags['stage']} checkpoint at step")
            or version.tags["stage"] == "export"
        )
    policy_model = client.get_registered_model("smoke-policy").description
    assert policy_model.startswith("The policies of the RLHF pipeline's runs named `smoke-<algorithm>-seed<seed>`")
    reward_model = client.get_registered_model("smoke-reward-model").description
    assert reward_model.startswith("The reward models of the RLHF pipeline's runs named `smoke-<algorithm>-seed<seed>`")
    assert summary["policy_model_uri"] == "models:/smoke-policy/3"
    ppo_run = stages["ppo"].info.run_id
    assert [m.step for m in client.get_metric_history(ppo_run, "objective/scores")] == [1, 2]
    assert [m.step for m in client.get_metric_history(ppo_run, "eval/vader_compound_mean")] == [0, 1, 2]
    artifacts = [a.path for a in client.list_artifacts(ppo_run, "eval")]
    # one table per evaluation, each with its step, nothing overwritten: CSV, which MLflow's UI shows
    tables = [f"eval/completions_step_00000{i}.csv" for i in range(3)]
    assert sorted(artifacts) == sorted([*tables, "eval/eval_curves.png"])
    for step in (1, 2):
        local = client.download_artifacts(ppo_run, tables[step], str(tmp_path / f"t{step}"))
        table = pd.read_csv(local)
        assert set(table["step"]) == {step} and len(table) == 8
        assert {"prompt", "completion", "score", "vader_compound", "kl", "length"} <= set(table.columns)
        # the user's text where a person reads it; the templated prompt the policy saw beside it
        assert not table["prompt"].str.contains("<|im_start|>", regex=False).any()
        assert table["rendered_prompt"].str.contains("<|im_start|>", regex=False).all()
    out = tmp_path / "out"
    [parquet] = (out / "ppo").glob("*/eval/eval_step_000002.parquet")
    frame = pd.read_parquet(parquet)
    assert len(frame) == 8 and frame["vader_compound"].mean() == pytest.approx(
        summary["eval_history"][2]["eval/vader_compound_mean"]
    )

    # the export: a version with the alias candidate that MLflow loads as a text-generation pipeline
    assert summary["export_dir"] == str((out / "export").resolve())
    assert summary["candidate_uri"] == "models:/smoke-policy/4"
    candidate = client.get_model_version_by_alias("smoke-policy", "candidate")
    assert str(candidate.version) == "4" and candidate.tags["stage"] == "export"
    # the candidate carries the numbers that justify it: the export run's metrics (also its logged model's),
    # a description with the before/after table and the guard's verdict, and the pipeline run links to it
    export_run = client.get_run(stages["export"].info.run_id)
    assert export_run.data.metrics["eval/vader_compound_mean"] == pytest.approx(
        summary["eval_history"][2]["eval/vader_compound_mean"], abs=1e-5
    )
    model_id = candidate.source.removeprefix("models:/")
    assert "eval/vader_compound_mean" in {m.key for m in client.get_logged_model(model_id).metrics}
    assert "| before (step 0) | after (step 2) |" in candidate.description and "Guard: " in candidate.description
    assert f"- config hash: `{client.get_run(summary['mlflow_run_id']).data.tags['rlhf.config_hash']}`" in (
        candidate.description
    )
    assert candidate.description.startswith("PPO policy of run smoke-ppo-seed7, exported at step 2")
    assert "eval_length_mean" not in candidate.tags and "eval_vader_compound_mean" in candidate.tags
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.data.tags["rlhf.candidate"] == "models:/smoke-policy/4"
    assert "| before (step 0) | after (step 2) |" in parent.data.tags["mlflow.note.content"]  # its description
    assert model_id in [o.model_id for o in parent.outputs.model_outputs]
    assert parent.info.run_name.startswith("smoke-ppo-seed7-")
    # each stage run says what the stage did, with its numbers, on its page
    notes = {
        name: run.data.tags.get("mlflow.note.content", "")
        for name, run in child_runs(client, parent.info.run_id).items()
    }
    assert notes["data"].startswith("Prepared 5 tables") and notes["sft"].startswith("Fine-tuned `demo`")
    assert "held-out accuracy" in notes["reward"] and "Held-out evaluation, step 0 -> step 2: " in notes["ppo"]
    assert kl_guide("ppo") in notes["ppo"]  # which of its four KL metrics to read
    assert (
        notes["export"].startswith("Exported step 2 of the PPO policy to ")
        and "`models:/smoke-policy/4`" in notes["export"]
    )
    # what the Prefect UI shows: no library noise in the logs, no file:// link an http page cannot open
    records = prefect_records()
    assert "LOAD_GLOBAL" not in records and "RESUME" not in records
    assert "file://" not in records
    assert '"key":"rlhf-summary"' in records and "| before (step 0) | after (step 2) |" in records
    assert f'"name":"{parent.info.run_name}"' in records  # the flow run's name is the MLflow run's: one per run
    assert "- source checkpoint: `models:/smoke-policy/3`" in candidate.description
    card = read_front_matter(out / "export" / "README.md")  # the root base, not the SFT version URI
    assert card["base_model"] == "demo" and card["base_model_relation"] == "finetune" and card["datasets"] == ["demo"]
    assert "models:/smoke-policy/3" in (out / "export" / "README.md").read_text()  # the lineage is in the body
    generator = mlflow.transformers.load_model("models:/smoke-policy@candidate")
    generated = generator("the movie was", max_new_tokens=4, do_sample=False)
    assert isinstance(generated[0]["generated_text"], str) and generated[0]["generated_text"].startswith(
        "the movie was"
    )
    for table in ("preference", "preference_eval", "prompts", "eval_prompts", "sft"):
        assert (out / "data" / f"{table}.jsonl").stat().st_size > 0
    weights = out / "sft" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns

    # a second run with the same config and data trains nothing and registers nothing new
    again = rlhf_pipeline(config_path=SMOKE, overrides=overrides)
    assert weights.stat().st_mtime_ns == stamp
    assert len(client.search_model_versions("name = 'smoke-policy'")) == 4
    assert len(client.search_model_versions("name = 'smoke-reward-model'")) == 2
    assert again["reward_model_uri"] == summary["reward_model_uri"]
    assert again["policy_model_uri"] == "models:/smoke-policy/3"
    assert again["candidate_uri"] == "models:/smoke-policy/4"
    assert again["data_fingerprint"] == summary["data_fingerprint"]

    # a run directory moved elsewhere (another disk, a renamed folder) resumes there: nothing trains again
    moved = tmp_path / "moved"
    out.rename(moved)
    elsewhere = rlhf_pipeline(config_path=SMOKE, overrides=[f"run.output_dir={moved}", f"tracking.uri={mlflow_uri}"])
    assert (moved / "sft" / "model.safetensors").stat().st_mtime_ns == stamp
    assert len(client.search_model_versions("name = 'smoke-policy'")) == 4
    assert (elsewhere["policy_model_uri"], elsewhere["candidate_uri"]) == (
        "models:/smoke-policy/3",
        "models:/smoke-policy/4",
    )
    assert not out.exists()


def test_bad_data_fails_the_flow_and_the_mlflow_run_with_nothing_registered(prefect_harness, tmp_path, mlflow_uri):
    bad = tmp_path / "prefs.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "chosen": "same", "rejected": "same"}) + "\n")
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", f"data.preference.path={bad}"]

    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)

    assert state.is_failed()
    assert (
        state.message.startswith("stage 'data' failed: DataValidationError: ") and "prefs.jsonl row 1" in state.message
    )
    with pytest.raises(DataValidationError, match=r"prefs.jsonl row 1: `chosen` is identical to `rejected`"):
        state.result()
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    [run] = client.search_runs(
        [client.get_experiment_by_name("rlhf-smoke").experiment_id], "attributes.run_name LIKE 'smoke-ppo-seed7-%'"
    )
    assert run.info.status == "FAILED"
    assert client.search_registered_models() == []


def test_an_unknown_stop_token_fails_in_the_data_stage_before_any_training(prefect_harness, tmp_path, mlflow_uri):
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", "rl.stop_tokens=['<|eot_id|>']"]

    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)

    assert state.is_failed()
    assert state.message.startswith(
        "stage 'data' failed: ModelSourceError: rl.stop_tokens[0]: '<|eot_id|>' is not a "
        "token of the policy's tokenizer"
    )
    assert not list((tmp_path / "out").glob("sft")) and not list((tmp_path / "out").glob("reward"))


def test_prefect_settings_honour_the_user_environment():
    code = (
        "import flows; from prefect.settings import get_current_settings as g; s = g(); "
        "print(s.api.url, s.server.ephemeral.startup_timeout_seconds)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    default = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=REPO
    )
    assert default.stdout.split() == ["None", "180"]
    env.update(PREFECT_API_URL="http://127.0.0.1:4999/api", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="45")
    user = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=REPO)
    assert user.stdout.split() == ["http://127.0.0.1:4999/api", "45"]


@pytest.mark.parametrize(
    "sets, expected",
    [
        (["rl.batch_size=64"], "has 32 usable prompts, fewer than the 64 one RL step takes (rl.batch_size)"),
        (
            ["rl.algorithm=grpo", "grpo.num_generations=4", "rl.batch_size=160"],
            "fewer than the 40 one RL step takes (rl.batch_size / grpo.num_generations); lower rl.batch_size",
        ),
        (
            ["data.overlong=drop", "data.max_prompt_length=2"],
            "is over data.max_prompt_length (2 tokens) and data.overlong is 'drop'; raise data.max_prompt_length",
        ),
    ],
)
def test_a_prompt_set_one_step_cannot_use_fails_before_any_training(
    prefect_harness, tmp_path, mlflow_uri, sets, expected
):
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", *sets]

    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)

    assert state.is_failed()
    assert state.message.startswith("stage 'data' failed: DataValidationError: data.") and expected in state.message
    assert not (tmp_path / "out" / "sft").exists()
    assert MlflowClient(mlflow_uri, registry_uri=mlflow_uri).search_registered_models() == []


def test_each_flow_run_is_named_for_its_config_and_start_and_a_bad_config_still_gets_a_name(monkeypatch):
    from datetime import datetime
    from types import SimpleNamespace

    from flows import rlhf_pipeline as module

    clock = iter([datetime(2026, 11, 26, 9, 50, 12), datetime(2026, 11, 26, 9, 58, 3), datetime(2026, 11, 27)])
    monkeypatch.setattr("tasks.tracking.runs.datetime", SimpleNamespace(now=lambda: next(clock)))

    def named(**parameters):
        monkeypatch.setattr(module, "prefect_flow_run", SimpleNamespace(parameters=parameters))
        return module.flow_run_name()

    grpo = {"config_path": SMOKE, "overrides": ["rl.algorithm=grpo", "run.seed=3"]}
    assert [named(**grpo), named(**grpo)] == ["smoke-grpo-seed3-20261126-095012", "smoke-grpo-seed3-20261126-095803"]
    assert named(config_path=SMOKE, overrides=["rl.no_such_field=1"]) == "smoke"
    assert named(config_path=None) == "rlhf-ppo-seed42-20261127-000000"  # no file: the defaults
