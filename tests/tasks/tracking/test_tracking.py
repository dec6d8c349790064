import csv
import json
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from rlhf_core.config import load_config
from tasks import registry, tracking

pytestmark = pytest.mark.filterwarnings("ignore")


def test_pipeline_run_logs_flat_params_and_finishes(cfg):
    with tracking.runs.pipeline_run(cfg) as run_id:
        tracking.logs.log_metrics(run_id, {"x/loss": 1.5}, step=3)
    run = MlflowClient().get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["ppo.kl_coef"] == "0.05" and run.data.params["rl.algorithm"] == "ppo"
    assert run.data.tags["rlhf.config_hash"] == cfg.config_hash()
    history = MlflowClient().get_metric_history(run_id, "x/loss")
    assert [(m.step, m.value) for m in history] == [(3, 1.5)]


def test_numbers_are_rounded_where_they_are_logged_for_a_person_to_read(cfg, tmp_path):
    assert tracking.logs.rounded(0.10000000149011612, 6) == 0.1  # a float32 mean, as MLflow would show it
    assert tracking.logs.rounded(-1.23456789e-9, 6) == -1.23457e-9
    assert tracking.logs.rounded(1234567.89, 6) == 1234568.0  # never rounded left of the point: counts stay
    with tracking.runs.pipeline_run(cfg) as run_id:
        tracking.logs.log_metrics(run_id, {"kl": 0.12345678901234567, "tokens": 1234567.0}, step=1)
        rows = [{"prompt": "p", "score": 0.30000001192092896, "length": 12, "stopped": True}]
        tracking.logs.log_table(run_id, rows, "t.json")
    client = MlflowClient()
    assert client.get_run(run_id).data.metrics == {"kl": 0.123457, "tokens": 1234567.0}
    table = json.loads(Path(client.download_artifacts(run_id, "t.json", str(tmp_path))).read_text())
    assert table["data"] == [["p", 0.3, 12, True]]


def test_a_csv_table_is_one_artifact_whose_cells_keep_their_line_breaks_commas_and_quotes(cfg, tmp_path):
    # MLflow's UI shows a .csv artifact as a table (a .json or .parquet one it does not preview)
    text = 'He said "fine",\nthen left.\r\nThe end'
    rows = [
        {"prompt": text, "score": 0.30000001192092896, "calls": ["add", "mul"], "gold": None},
        {"prompt": "p", "score": 1.0, "calls": [], "gold": 2, "late": True},
    ]
    with tracking.runs.pipeline_run(cfg) as run_id:
        tracking.logs.log_table(run_id, rows, "eval/t.csv")
    client = MlflowClient()
    assert [a.path for a in client.list_artifacts(run_id, "eval")] == ["eval/t.csv"]
    local = Path(client.download_artifacts(run_id, "eval/t.csv", str(tmp_path)))
    with local.open(newline="", encoding="utf-8") as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == ["prompt", "score", "calls", "gold", "late"]
    assert read[0] == {"prompt": text, "score": "0.3", "calls": '["add", "mul"]', "gold": "", "late": ""}
    assert read[1] == {"prompt": "p", "score": "1.0", "calls": "[]", "gold": "2", "late": "True"}


def test_each_stage_run_can_be_found_and_described(cfg):
    with tracking.runs.pipeline_run(cfg) as parent:
        for stage in ("data", "sft"):
            with tracking.runs.stage_run(parent, stage) as run_id:
                tracking.logs.log_metrics(run_id, {"x": 1.0}, step=1)
        found = tracking.logs.stage_runs(parent)
        tracking.logs.describe_run(found["sft"], "Fine-tuned for 8 steps.")
        tracking.logs.describe_run(found["data"], "guard: attempt 1 rolled back.")
        for _ in range(2):  # once: what the run said stays below
            tracking.logs.describe_run(found["data"], "Prepared 5 tables.", keep=True)
    assert set(found) == {"data", "sft"}
    client = MlflowClient()
    assert client.get_run(found["sft"]).data.tags["mlflow.note.content"] == "Fine-tuned for 8 steps."
    note = client.get_run(found["data"]).data.tags["mlflow.note.content"]
    assert note == "Prepared 5 tables.\n\nguard: attempt 1 rolled back."
    assert client.get_run(found["data"]).data.tags["rlhf.stage"] == "data"


def test_artifacts_of_a_sqlite_store_live_beside_it(cfg, tmp_path):
    with tracking.runs.pipeline_run(cfg) as run_id:
        pass
    experiment = MlflowClient().get_experiment(MlflowClient().get_run(run_id).info.experiment_id)
    assert experiment.artifact_location == (tmp_path / "mlruns").as_uri()


def test_a_crash_marks_pipeline_and_stage_runs_failed(cfg):
    ids = {}
    with pytest.raises(RuntimeError, match="boom"):
        with tracking.runs.pipeline_run(cfg) as run_id:
            ids["parent"] = run_id
            with tracking.runs.stage_run(run_id, "sft") as stage_id:
                ids["stage"] = stage_id
                raise RuntimeError("boom")
    client = MlflowClient()
    assert client.get_run(ids["parent"]).info.status == "FAILED"
    stage = client.get_run(ids["stage"])
    assert stage.info.status == "FAILED"
    assert stage.data.tags["mlflow.parentRunId"] == ids["parent"]
    assert mlflow.active_run() is None


def test_secrets_never_reach_params(tmp_path):
    cfg = load_config(None, [f"tracking.uri=sqlite:///{tmp_path / 'm.db'}"])
    # a password in a URI-valued field is hidden, even one a user put into a free-text field
    cfg.model.base = "https://bob:hunter2@hub.example/org/model"
    with tracking.runs.pipeline_run(cfg) as run_id:
        pass
    params = MlflowClient().get_run(run_id).data.params
    assert "hunter2" not in " ".join(params.values())


def test_register_checkpoint_creates_a_tagged_described_version_that_loads(cfg, smoke_world):
    with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "sft") as run_id:
        tags = registry.lineage_tags(
            stage="sft", step=8, config_hash=cfg.config_hash(), data_fingerprint="abc123", run_label="unit-ppo-seed42"
        )
        first = registry.register_checkpoint(
            smoke_world.base_model, "unit-policy", task="text-generation", tags=dict(tags, stage_key=""), run_id=run_id
        )
        second = registry.register_checkpoint(
            smoke_world.base_model, "unit-policy", task="text-generation", tags=dict(tags, step="9"), run_id=run_id
        )
    assert (first["version"], second["version"]) == ("1", "2")
    version = MlflowClient().get_model_version("unit-policy", "1")
    # what a person filters on is a tag; the config hash and code version are read on the version's page
    assert version.tags == {"stage": "sft", "step": "8", "data_fingerprint": "abc123", "run_label": "unit-ppo-seed42"}
    assert version.description.startswith("sft checkpoint at step 8 of run unit-ppo-seed42.")
    assert f"- config hash: `{cfg.config_hash()}`" in version.description
    assert "- code version: `0.1.0" in version.description
    assert version.run_id == run_id
    assert str(registry.find_version("unit-policy", {"step": "8", "stage_key": ""}).version) == "1"  # empty: no tag
    found = registry.find_version("unit-policy", {"stage": "sft", "step": "9"})
    assert found is not None and str(found.version) == "2"
    assert registry.find_version("unit-policy", {"stage": "reward"}) is None
    assert registry.find_version("no-such-model", {}) is None
    # the registered model's description is set once: one a person wrote later stays
    registry.describe_model("unit-policy", "The policies of runs named `unit-<algorithm>-seed<seed>`.")
    registry.describe_model("unit-policy", "another text")
    registry.describe_model("no-such-model", "nothing to describe")
    assert MlflowClient().get_registered_model("unit-policy").description.startswith("The policies of runs named")
    # an empty value removes a tag instead of setting an empty one
    registry.set_version_tags("unit-policy", "1", {"guard.broken": "kl_budget"})
    registry.set_version_tags("unit-policy", "1", {"guard.broken": "", "guard.passed": "true"})
    assert MlflowClient().get_model_version("unit-policy", "1").tags["guard.passed"] == "true"
    assert "guard.broken" not in MlflowClient().get_model_version("unit-policy", "1").tags

    generator = mlflow.transformers.load_model(first["uri"])
    out = generator("the food was", max_new_tokens=3, do_sample=False)
    assert out[0]["generated_text"].startswith("the food was")


def test_a_failed_registration_leaves_no_version(cfg, smoke_world, monkeypatch):
    def not_ready(name, version, timeout_s=300.0):
        raise RuntimeError("registry went away")

    monkeypatch.setattr("tasks.registry.registration.await_ready", not_ready)
    with pytest.raises(RuntimeError, match="registry went away"):
        with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "sft") as run_id:
            registry.register_checkpoint(
                smoke_world.base_model,
                "unit-policy",
                task="text-generation",
                tags={"stage": "sft", "step": "1"},
                run_id=run_id,
            )
    assert MlflowClient().search_model_versions("name = 'unit-policy'") == []


def test_materialize_model_round_trips_a_version(cfg, smoke_world, tmp_path):
    with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "sft") as run_id:
        uri = registry.register_checkpoint(
            smoke_world.base_model,
            "unit-policy",
            task="text-generation",
            tags={"stage": "sft", "step": "1"},
            run_id=run_id,
        )["uri"]
    local = registry.materialize_model(uri, tmp_path / "local")
    assert (local / "config.json").is_file() and (local / "model.safetensors").is_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(local).config.vocab_size == len(AutoTokenizer.from_pretrained(local))


def test_registry_sources_follow_the_alias_and_a_missing_version_is_named(cfg, smoke_world, tmp_path):
    from rlhf_core.models.loading import ModelSourceError
    from tasks.stages.data import resolve_model_source

    with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "export") as run_id:
        versions = [
            registry.register_checkpoint(
                smoke_world.base_model,
                "unit-policy",
                task="text-generation",
                tags={"stage": "export", "step": str(i)},
                run_id=run_id,
            )["version"]
            for i in (1, 2)
        ]
    registry.set_alias("unit-policy", "candidate", versions[0])
    first = resolve_model_source("models:/unit-policy@candidate", field="grpo.rewards[0].model", cfg=cfg, world=None)
    assert (
        resolve_model_source("models:/unit-policy/1", field="f", cfg=cfg, world=None) == first
    )  # same version, one copy
    registry.set_alias("unit-policy", "candidate", versions[1])
    moved = resolve_model_source("models:/unit-policy@candidate", field="grpo.rewards[0].model", cfg=cfg, world=None)
    assert moved != first and "-v2-" in moved
    with pytest.raises(
        ModelSourceError,
        match=r"grpo.rewards\[0\].model: the registry at .* has no model version models:/unit-policy/9",
    ):
        resolve_model_source("models:/unit-policy/9", field="grpo.rewards[0].model", cfg=cfg, world=None)


def test_a_local_artifact_store_shares_the_checkpoint_weights_instead_of_copying_them(cfg, smoke_world):
    import os

    with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "sft") as run_id:
        tags = registry.lineage_tags(stage="sft", step=1, config_hash=cfg.config_hash(), data_fingerprint="abc")
        uri = registry.register_checkpoint(
            smoke_world.base_model, "unit-policy", task="text-generation", tags=tags, run_id=run_id
        )["uri"]
    weights = smoke_world.base_model / "model.safetensors"
    source = MlflowClient().get_model_version("unit-policy", "1").source  # models:/m-...
    logged = registry.local_artifact_dir(source.removeprefix("models:/"))
    [artifact] = list(logged.rglob("model.safetensors"))
    assert os.path.samefile(artifact, weights)  # one copy on disk, two names
    generator = mlflow.transformers.load_model(uri)  # and the version still loads
    assert generator("the food was", max_new_tokens=2, do_sample=False)[0]["generated_text"].startswith("the food was")


def _schema(db) -> tuple[dict, list]:
    """Tables with their columns, indexes, the schema revision (not the CREATE text: MLflow's own migrations
    write a table's constraints in varying order from one run to the next)."""
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(db)) as con:
        names = con.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'").fetchall()
        schema = {
            (kind, name): con.execute(f"PRAGMA table_info('{name}')").fetchall() if kind == "table" else None
            for kind, name in names
        }
        return schema, con.execute("SELECT version_num FROM alembic_version").fetchall()


def test_a_new_store_is_a_copy_of_the_migrated_empty_schema(tmp_path, monkeypatch):
    # given: a private cache and a store MLflow migrates itself
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    monkeypatch.setenv(tracking.store.CACHE_ENV, str(tmp_path / "cache"))
    migrated = tmp_path / "migrated.db"
    SqlAlchemyStore(f"sqlite:///{migrated}", str(tmp_path / "artifacts")).engine.dispose()
    # when: two new stores are configured (the first makes the template)
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        uri = f"sqlite:///{tmp_path / name / 'mlflow.db'}"
        tracking.store.configure(uri)
        tracking.store.ensure_experiment("demo", uri)
        # then: the same tables, indexes and schema revision; experiment 0 made in this store's own context
        assert _schema(tmp_path / name / "mlflow.db") == _schema(migrated)
        default = MlflowClient(uri).get_experiment("0")
        assert default.name == "Default" and str(tmp_path / name / "mlruns") in default.artifact_location
    assert (tmp_path / "cache" / f"mlflow-{mlflow.__version__}-empty-store.db").is_file()
    assert not list((tmp_path / "first").glob(".*.tmp"))  # the copy's temporary name is gone


def test_a_file_at_the_store_path_is_never_replaced_by_the_template(tmp_path, monkeypatch):
    monkeypatch.setenv(tracking.store.CACHE_ENV, str(tmp_path / "cache"))
    db = tmp_path / "mlflow.db"
    db.write_text("a user's file")
    template = tracking.store.empty_store_template()
    tracking.store._copy_template(template, db)
    assert db.read_text() == "a user's file" and not list(tmp_path.glob(".*.tmp"))


def test_an_unwritable_cache_leaves_the_store_to_mlflow(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(tracking.store.CACHE_ENV, str(blocker / "cache"))
    assert tracking.store.empty_store_template() is None
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.store.configure(uri)
    assert tracking.store.ensure_experiment("demo", uri)
