"""The MLflow record of a pipeline run, as a reviewer reads it: summary metrics and final samples on the
pipeline's run, each checkpoint version with its own step's evaluation, no empty nested runs on a re-run,
links back to the Prefect flow run, the data sets as dataset inputs (of the data stage, and of each stage that
trains on them), a named promotion run."""

import hashlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from flows.promote import rlhf_promote
from flows.rlhf_pipeline import rlhf_pipeline

SMOKE = str(Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
TABLES = {
    "data.preference": "preference",
    "data.preference_eval": "preference_eval",
    "data.prompts": "prompts",
    "data.eval_prompts": "eval_prompts",
    "sft.dataset": "sft",
}


@pytest.fixture(scope="module")
def record(prefect_harness, tmp_path_factory):
    """The smoke pipeline run twice on one run directory and tracking store, then a promotion."""
    root = tmp_path_factory.mktemp("record")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    overrides = [f"run.output_dir={root / 'out'}", f"tracking.uri={uri}"]
    first = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    second = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    promotion = rlhf_promote(config_path=SMOKE, overrides=overrides, return_state=True)
    assert first.is_completed() and second.is_completed() and promotion.is_completed()
    client = MlflowClient(uri, registry_uri=uri)
    return SimpleNamespace(
        root=root,
        client=client,
        experiment=client.get_experiment_by_name("rlhf-smoke").experiment_id,
        first=first.result(),
        second=second.result(),
        promotion=promotion.result(),
        flow_runs={
            "first": str(first.state_details.flow_run_id),
            "second": str(second.state_details.flow_run_id),
            "promotion": str(promotion.state_details.flow_run_id),
        },
    )


def children(record, parent_id: str, view=ViewType.ACTIVE_ONLY) -> dict:
    runs = record.client.search_runs(
        [record.experiment], f"tags.mlflow.parentRunId = '{parent_id}'", run_view_type=view
    )
    return {r.info.run_name: r for r in runs}


def history_at(client, run_id: str, key: str, step: int) -> float:
    [value] = [m.value for m in client.get_metric_history(run_id, key) if m.step == step]
    return value


def logged_model_id(version) -> str:
    return version.model_id or version.source.removeprefix("models:/")


def recorded_something(client, run) -> bool:
    return bool(
        run.data.metrics
        or run.data.params
        or (run.inputs and run.inputs.dataset_inputs)
        or (run.outputs and run.outputs.model_outputs)
        or client.list_artifacts(run.info.run_id)
    )


def test_the_pipeline_run_carries_summary_metrics_and_the_final_samples(record):
    client = record.client
    for summary in (record.first, record.second):
        parent = client.get_run(summary["mlflow_run_id"])
        stages = children(record, summary["mlflow_run_id"])
        ppo_run = children(record, record.first["mlflow_run_id"])["ppo"].info.run_id
        metrics = parent.data.metrics
        assert metrics["summary/gold"] == pytest.approx(history_at(client, ppo_run, "eval/vader_compound_mean", 2))
        assert metrics["summary/proxy"] == pytest.approx(history_at(client, ppo_run, "eval/score_mean", 2))
        kl_key = "eval/kl_exact_mean"  # exact over the vocabulary: what the guard reads
        assert metrics["summary/kl"] == pytest.approx(history_at(client, ppo_run, kl_key, 2))
        assert metrics["summary/reward_accuracy"] == pytest.approx(summary["metrics"]["reward/eval_accuracy"])
        assert metrics["summary/guard_triggers"] == stages["ppo"].data.metrics.get("guard/triggers", 0.0)
        assert [m.step for m in client.get_metric_history(parent.info.run_id, "summary/gold")] == [2]

        local = client.download_artifacts(
            parent.info.run_id, "final_samples.csv", str(record.root / parent.info.run_id)
        )
        table = pd.read_csv(local)
        # every held-out prompt, its completion by the initial policy beside the exported checkpoint's
        assert len(table) == 8 and set(table["step_before"]) == {0} and set(table["step_after"]) == {2}
        sides = {f"{c}_{side}" for c in ("completion", "score", "vader_compound") for side in ("before", "after")}
        assert {"prompt", *sides} <= set(table.columns) and table["completion_before"].notna().all()
        assert table["vader_compound_after"].mean() == pytest.approx(metrics["summary/gold"], abs=1e-3)
        step_0 = history_at(client, ppo_run, "eval/vader_compound_mean", 0)
        assert table["vader_compound_before"].mean() == pytest.approx(step_0, abs=1e-3)


def test_every_checkpoint_version_carries_the_evaluation_of_its_own_step(record):
    client = record.client
    ppo_run = children(record, record.first["mlflow_run_id"])["ppo"].info.run_id
    versions = {
        v.tags["step"]: v for v in client.search_model_versions("name = 'smoke-policy'") if v.tags["stage"] == "ppo"
    }
    assert sorted(versions) == ["1", "2"]
    for step, version in versions.items():
        expected = history_at(client, ppo_run, "eval/vader_compound_mean", int(step))
        assert float(version.tags["eval_vader_compound_mean"]) == pytest.approx(expected, abs=1e-4)
        proxy = re.search(r"held-out reward-model score \(the proxy\): `([-\d.]+)`", version.description)
        assert float(proxy[1]) == pytest.approx(history_at(client, ppo_run, "eval/score_mean", int(step)), abs=1e-4)
        model = client.get_logged_model(logged_model_id(version))
        linked = {m.key: m for m in model.metrics}
        assert linked["eval/vader_compound_mean"].step == int(step)
        assert linked["eval/vader_compound_mean"].value == pytest.approx(expected)
        assert linked["objective/kl"].step == int(step)
    [sft] = [v for v in client.search_model_versions("name = 'smoke-policy'") if v.tags["stage"] == "sft"]
    sft_metrics = {m.key: m.step for m in client.get_logged_model(logged_model_id(sft)).metrics}
    assert sft_metrics["sft/loss"] == 8


def test_a_rerun_adds_no_empty_nested_runs(record):
    client = record.client
    first = children(record, record.first["mlflow_run_id"])
    second = children(record, record.second["mlflow_run_id"])
    assert set(first) == {"data", "sft", "reward", "ppo", "export"}
    assert second and all(recorded_something(client, run) for run in second.values()), {
        name: run.info.run_id for name, run in second.items() if not recorded_something(client, run)
    }
    # the SFT warm start was reused whole: the parent says so instead of an empty nested run
    assert "sft" not in second
    tags = client.get_run(record.second["mlflow_run_id"]).data.tags
    assert tags["rlhf.stage.sft"].startswith("reused")
    every = children(record, record.second["mlflow_run_id"], ViewType.ALL)
    assert all(r.info.lifecycle_stage == "deleted" for name, r in every.items() if name not in second)


def test_each_flow_run_has_a_name_of_its_own_which_its_mlflow_run_shares(record):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        names = {label: prefect.read_flow_run(record.flow_runs[label]).name for label in ("first", "second")}
    assert names["first"] != names["second"] and all(n.startswith("smoke-ppo-seed7-") for n in names.values())
    for label in ("first", "second"):
        assert record.client.get_run(getattr(record, label)["mlflow_run_id"]).info.run_name == names[label]


def test_every_run_links_back_to_its_prefect_flow_run_and_says_what_it_is(record):
    client = record.client
    [promotion] = client.search_runs([record.experiment], "attributes.run_name = 'promote-smoke-policy-v4'")
    runs = {
        "first": (client.get_run(record.first["mlflow_run_id"]), "pipeline"),
        "second": (client.get_run(record.second["mlflow_run_id"]), "pipeline"),
        "promotion": (promotion, "promotion"),
    }
    for label, (parent, kind) in runs.items():
        flow_run_id = record.flow_runs[label]
        for run, expected_kind in [
            (parent, kind),
            *((c, "stage") for c in children(record, parent.info.run_id).values()),
        ]:
            tags = run.data.tags
            assert tags["rlhf.run_kind"] == expected_kind, run.info.run_name
            assert tags["prefect.flow_run_id"] == flow_run_id, run.info.run_name
            url = tags["prefect.flow_run_url"]
            assert url.startswith("http") and url.endswith(f"/runs/flow-run/{flow_run_id}"), url
    assert promotion.data.tags["promotion.decision"] == record.promotion["decision"]
    assert set(children(record, promotion.info.run_id)) == {"data"}


def test_the_data_stage_logs_every_prepared_table_as_a_dataset_input(record):
    data_run = children(record, record.first["mlflow_run_id"])["data"]
    inputs = {i.dataset.name: i for i in data_run.inputs.dataset_inputs}
    assert set(inputs) == set(TABLES)
    digests = {TABLES[name]: i.dataset.digest for name, i in inputs.items()}
    combined = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:16]
    assert combined == record.first["data_fingerprint"]  # the digests are the tables' fingerprints
    for name, dataset_input in inputs.items():
        tags = {t.key: t.value for t in dataset_input.tags}
        expected = "evaluation" if name in ("data.preference_eval", "data.eval_prompts") else "training"
        assert tags["mlflow.data.context"] == expected
        assert int(tags["rlhf.rows"]) > 0
        assert dataset_input.dataset.source_type == "code"
        assert json.loads(dataset_input.dataset.source)["tags"] == {"rlhf.source": "demo"}


STAGE_INPUTS = {  # what each training stage's run lists as its dataset inputs, with their contexts
    "sft": {"sft.dataset": "training"},
    "reward": {"data.preference": "training", "data.preference_eval": "evaluation"},
    "ppo": {"data.prompts": "training", "data.eval_prompts": "evaluation"},
}


def input_entries(run) -> dict[str, tuple[str, dict[str, str]]]:
    """A run's dataset inputs: name -> (digest, tags); each name once."""
    found = [(i.dataset.name, (i.dataset.digest, {t.key: t.value for t in i.tags})) for i in run.inputs.dataset_inputs]
    assert len(found) == len(dict(found)), found
    return dict(found)


def test_each_training_stage_run_lists_the_tables_it_read_as_dataset_inputs(record):
    for summary in (record.first, record.second):
        stages = children(record, summary["mlflow_run_id"])
        data = input_entries(stages["data"])
        for stage, expected in STAGE_INPUTS.items():
            if stage not in stages:  # the second run reused the SFT warm start whole: no run of its own
                assert summary is record.second and stage == "sft"
                continue
            entries = input_entries(stages[stage])
            assert {name: tags["mlflow.data.context"] for name, (_, tags) in entries.items()} == expected, stage
            for name, (digest, tags) in entries.items():
                assert digest == data[name][0], (stage, name)  # the data stage's fingerprint of the same table
                assert tags["rlhf.rows"] == data[name][1]["rlhf.rows"], (stage, name)
