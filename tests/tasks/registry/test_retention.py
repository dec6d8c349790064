"""registry.keep_last_versions: register_once prunes old versions, sparing aliased and keep=true ones."""

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from rlhf_core.config import load_config
from tasks import registry, tracking

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture
def keep_two_cfg(tmp_path, mlflow_uri):
    """tests/tasks/conftest.py's `cfg` keeping the last two versions (registry.keep_last_versions)."""
    return load_config(
        None,
        [
            f"tracking.uri={mlflow_uri}",
            "tracking.experiment=t",
            f"run.output_dir={tmp_path}",
            "run.name=unit",
            "registry.keep_last_versions=2",
        ],
    )


def test_old_versions_go_and_aliased_and_kept_ones_stay(keep_two_cfg, smoke_world):
    name = "unit-policy"

    def register(step, run_id):
        tags = {"stage": "rl", "stage_key": "k", "step": str(step)}
        return registry.register_once(
            smoke_world.base_model,
            name,
            task="text-generation",
            tags=tags,
            run_id=run_id,
            keep_last=keep_two_cfg.registry.keep_last_versions,
        )

    with tracking.runs.pipeline_run(keep_two_cfg) as parent, tracking.runs.stage_run(parent, "ppo") as run_id:
        client = MlflowClient()  # after pipeline_run pointed MLflow at the test's store
        assert [register(s, run_id) for s in (1, 2, 3)] == [f"models:/{name}/{v}" for v in (1, 2, 3)]
        assert sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'")) == [2, 3]
        gone = registry.find_version(name, {"step": "1"})
        assert gone is None
        registry.set_alias(name, "champion", "2")
        registry.set_alias(name, "candidate", "3")
        register(4, run_id)
        registry.set_version_tags(name, "4", {"keep": "true"})
        register(5, run_id)
        register(6, run_id)
        # an existing version is found, not registered again, and prunes nothing
        assert register(6, run_id) == f"models:/{name}/6"

    left = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    # newest two (5, 6), champion 2, candidate 3, keep=true 4; version 1 went at the third registration
    assert left == [2, 3, 4, 5, 6]
    assert str(client.get_model_version_by_alias(name, "champion").version) == "2"

    # the logged model behind a deleted version is marked deleted (mlflow gc removes its artifacts)
    with tracking.runs.pipeline_run(keep_two_cfg) as parent, tracking.runs.stage_run(parent, "ppo") as run_id:
        v5 = client.get_model_version(name, "5")
        assert register(7, run_id) == f"models:/{name}/7"
    assert sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'")) == [2, 3, 4, 6, 7]
    assert client.get_logged_model(registry.logged_model_id(client.get_model_version(name, "6"))).model_id
    with pytest.raises(MlflowException, match="not found"):  # the store hides deleted logged models
        client.get_logged_model(registry.logged_model_id(v5))


def test_prune_versions_keeps_all_without_a_limit_and_refuses_zero(keep_two_cfg, smoke_world):
    with tracking.runs.pipeline_run(keep_two_cfg) as parent, tracking.runs.stage_run(parent, "sft") as run_id:
        for step in (1, 2):
            registry.register_once(
                smoke_world.base_model,
                "unit-sft",
                task="text-generation",
                tags={"stage": "sft", "stage_key": "k", "step": str(step)},
                run_id=run_id,
            )
    assert registry.prune_versions("unit-sft", None) == []
    with pytest.raises(ValueError):
        registry.prune_versions("unit-sft", 0)
    assert registry.prune_versions("unit-sft", 1) == ["1"]
    assert [str(v.version) for v in MlflowClient().search_model_versions("name = 'unit-sft'")] == ["2"]
