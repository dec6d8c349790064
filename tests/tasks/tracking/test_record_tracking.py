"""tasks/tracking/runs.py, tasks/tracking/logs.py and tasks/reporting/reporter.py for a readable record: Prefect links
without secrets, empty stage runs dropped, data sets as dataset inputs, each version tagged with its own step's
evaluation."""

import json

import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

from tasks import registry, tracking
from tasks.reporting.identity import RegisteredModel, StageIdentity
from tasks.reporting.reporter import StageReporter

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture
def in_flow_run(monkeypatch):
    from prefect.runtime import flow_run

    monkeypatch.setattr(flow_run, "get_id", lambda: "0b1c-flow-run")


def test_prefect_tags_link_the_flow_run_without_the_ui_password(in_flow_run):
    with temporary_settings(updates={PREFECT_UI_URL: "https://alice:s3cret@prefect.example"}):
        tags = tracking.runs.prefect_tags()
    assert tags["prefect.flow_run_id"] == "0b1c-flow-run"
    assert tags["prefect.flow_run_url"] == "https://alice:***@prefect.example/runs/flow-run/0b1c-flow-run"
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):  # the UI url derived from it
        assert (
            tracking.runs.prefect_tags()["prefect.flow_run_url"] == "http://127.0.0.1:4200/runs/flow-run/0b1c-flow-run"
        )


def test_without_a_prefect_url_only_the_id_is_tagged_and_outside_a_flow_run_nothing(in_flow_run, monkeypatch):
    with temporary_settings(restore_defaults={PREFECT_API_URL, PREFECT_UI_URL}):
        assert tracking.runs.prefect_tags() == {"prefect.flow_run_id": "0b1c-flow-run"}
    from prefect.runtime import flow_run

    monkeypatch.setattr(flow_run, "get_id", lambda: None)
    assert tracking.runs.prefect_tags() == {}


def test_pipeline_and_stage_runs_say_their_kind_and_flow_run(cfg, in_flow_run):
    with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "sft") as stage:
        tracking.logs.log_metrics(stage, {"sft/loss": 1.0}, 1)
    with tracking.runs.pipeline_run(cfg, tags={"rlhf.run_kind": "promotion"}, run_name="promote-p-v3") as other:
        pass
    client = MlflowClient()
    parent_tags, stage_tags = client.get_run(parent).data.tags, client.get_run(stage).data.tags
    assert parent_tags["rlhf.run_kind"] == "pipeline" and stage_tags["rlhf.run_kind"] == "stage"
    assert parent_tags["prefect.flow_run_id"] == stage_tags["prefect.flow_run_id"] == "0b1c-flow-run"
    promotion = client.get_run(other)
    assert promotion.info.run_name == "promote-p-v3" and promotion.data.tags["rlhf.run_kind"] == "promotion"


def test_a_stage_run_in_a_launched_process_inherits_the_parents_flow_run(cfg, in_flow_run, monkeypatch):
    with tracking.runs.pipeline_run(cfg) as parent:
        from prefect.runtime import flow_run

        monkeypatch.setattr(flow_run, "get_id", lambda: None)  # a worker process started by tasks/launch/launcher.py
        with tracking.runs.stage_run(parent, "ppo") as stage:
            tracking.logs.log_metrics(stage, {"loss": 1.0}, 1)
    assert MlflowClient().get_run(stage).data.tags["prefect.flow_run_id"] == "0b1c-flow-run"


def test_a_stage_run_that_recorded_nothing_is_dropped_and_the_parent_says_why(cfg):
    with tracking.runs.pipeline_run(cfg) as parent:
        with tracking.runs.stage_run(parent, "sft") as empty:
            pass
        with tracking.runs.stage_run(parent, "reward") as reused:
            tracking.logs.set_run_tags(reused, {"rlhf.reused": "models:/rm/2"})
        with tracking.runs.stage_run(parent, "ppo") as kept:
            tracking.logs.log_metrics(kept, {"loss": 1.0}, 1)
    client = MlflowClient()
    active = client.search_runs([client.get_run(parent).info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert [r.info.run_id for r in active] == [kept]
    assert client.get_run(empty).info.lifecycle_stage == "deleted"
    assert client.get_run(empty).info.status == "FINISHED"
    tags = client.get_run(parent).data.tags
    assert tags["rlhf.stage.sft"].startswith("reused") and tags["rlhf.stage.reward"].startswith("reused")
    assert tags["rlhf.reward.reused"] == "models:/rm/2"
    assert "rlhf.stage.ppo" not in tags


def test_a_failed_stage_run_is_kept_even_when_empty(cfg):
    with pytest.raises(RuntimeError):
        with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "sft") as stage:
            raise RuntimeError("boom")
    run = MlflowClient().get_run(stage)
    assert run.info.status == "FAILED" and run.info.lifecycle_stage == "active"
    experiment = run.info.experiment_id
    assert len(MlflowClient().search_runs([experiment], run_view_type=ViewType.ALL)) == 2


def test_an_rl_attempt_after_a_rollback_is_a_run_nested_in_its_stage_run(cfg, in_flow_run):
    with tracking.runs.pipeline_run(cfg) as parent:
        with tracking.runs.stage_run(parent, "ppo", {"ppo.kl_coef": "0.6"}) as stage:
            tracking.logs.log_metrics(stage, {"loss": 2.0}, 4)  # the first attempt, rolled back at step 4
            with tracking.runs.attempt_run(stage, "ppo", 2, "Attempt 2 after a rollback") as attempt:
                tracking.logs.log_metrics(attempt, {"loss": 1.0}, 3)
            with pytest.raises(RuntimeError), tracking.runs.attempt_run(stage, "ppo", 3, "again") as failed:
                raise RuntimeError("boom")
            left_running = tracking.runs.attempt_run(stage, "ppo", 4, "its process killed")  # never exited
            killed = left_running.__enter__()
            assert tracking.runs.end_orphan_stage_runs(parent) == [stage, killed]  # as the launcher does
    client = MlflowClient()
    run = client.get_run(attempt)
    assert run.info.run_name == "ppo-attempt-2" and run.info.status == "FINISHED"
    assert run.data.tags["mlflow.parentRunId"] == stage and run.data.tags["rlhf.run_kind"] == "attempt"
    assert run.data.tags["mlflow.note.content"] == "Attempt 2 after a rollback"
    assert run.data.tags["prefect.flow_run_id"] == "0b1c-flow-run" and run.data.params == {"ppo.kl_coef": "0.6"}
    assert [m.step for m in client.get_metric_history(stage, "loss")] == [4]  # each run's series its own
    assert client.get_run(failed).info.status == "FAILED" and client.get_run(killed).info.status == "KILLED"


def test_datasets_are_logged_with_name_source_digest_and_context(cfg, tmp_path):
    local = tmp_path / "prefs.jsonl"
    local.write_text("{}\n")
    with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "data") as run_id:
        tracking.logs.log_datasets(
            run_id,
            [
                {"name": "data.preference", "source": str(local), "digest": "aaa", "context": "training", "rows": 3},
                {"name": "data.prompts", "source": "org/prompts", "digest": "bbb", "context": "training"},
                {
                    "name": "data.eval_prompts",
                    "source": "https://bob:hunter2@data.example/p.jsonl",
                    "digest": "ccc",
                    "context": "evaluation",
                },
                {"name": "sft.dataset", "source": "demo", "digest": "ddd", "context": "training"},
            ],
        )
    run = MlflowClient().get_run(run_id)
    found = {i.dataset.name: i for i in run.inputs.dataset_inputs}
    assert {n: i.dataset.digest for n, i in found.items()} == {
        "data.preference": "aaa",
        "data.prompts": "bbb",
        "data.eval_prompts": "ccc",
        "sft.dataset": "ddd",
    }
    contexts = {n: {t.key: t.value for t in i.tags}["mlflow.data.context"] for n, i in found.items()}
    assert contexts["data.eval_prompts"] == "evaluation" and contexts["data.preference"] == "training"
    assert {t.key: t.value for t in found["data.preference"].tags}["rlhf.rows"] == "3"
    assert found["data.preference"].dataset.source_type == "local"
    assert str(local) in found["data.preference"].dataset.source
    assert found["data.prompts"].dataset.source_type == "hugging_face"
    assert json.loads(found["data.prompts"].dataset.source)["path"] == "org/prompts"
    assert found["data.eval_prompts"].dataset.source_type == "http"
    assert "hunter2" not in found["data.eval_prompts"].dataset.source
    assert "bob:***@data.example" in found["data.eval_prompts"].dataset.source
    assert found["sft.dataset"].dataset.source_type == "code"


def test_a_registered_checkpoint_carries_the_evaluation_recorded_for_its_step(cfg, monkeypatch):
    seen = []

    def register_once(path, model_name, *, task, tags, run_id, keep_last=None, input_example=True):
        seen.append(tags)
        return f"models:/{model_name}/{len(seen)}"

    monkeypatch.setattr(registry, "register_once", register_once)
    gold = f"eval/{cfg.gold_metric()}_mean"
    reporter = StageReporter(StageIdentity(cfg, "ppo", "run-id"), model=RegisteredModel("p"), curves={"gold": (gold,)})
    reporter.record({gold: 0.25, "eval/score_mean": 1.5}, 0)
    reporter.record({gold: 0.75, "eval/score_mean": 2.5, "eval/length_mean": 4.0, "loss": 3.0}, 1)
    reporter.on_checkpoint(cfg.run.output_dir, 1).result()  # registered in the background
    reporter.register(cfg.run.output_dir, 2)  # no evaluation at step 2: no eval tags
    assert seen[0]["step"] == "1"
    assert seen[0][gold.replace("/", "_")] == "0.7500" and seen[0]["eval_score_mean"] == "2.5000"
    # only what a person filters versions on; the whole evaluation is the logged model's metrics
    assert "loss" not in seen[0] and "eval_length_mean" not in seen[0]
    assert not any(k.startswith("eval_") for k in seen[1])


def test_the_logged_model_of_a_checkpoint_carries_its_steps_metrics(cfg, smoke_world):
    with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "ppo") as run_id:
        tracking.logs.log_metrics(run_id, {"eval/gold_mean": 0.1}, 0)
        tracking.logs.log_metrics(run_id, {"eval/gold_mean": 0.9}, 3)
        tags = registry.lineage_tags(stage="ppo", step=3, config_hash="h", data_fingerprint="d")
        registry.register_checkpoint(
            smoke_world.base_model, "unit-policy", task="text-generation", tags=tags, run_id=run_id
        )
    client = MlflowClient()
    version = client.get_model_version("unit-policy", "1")
    metrics = {
        m.key: (m.step, m.value) for m in client.get_logged_model(version.source.removeprefix("models:/")).metrics
    }
    assert metrics["eval/gold_mean"] == (3, pytest.approx(0.9))
