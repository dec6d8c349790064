"""Scheduled retraining: new preference files are noticed by fingerprint, the policy starts from the
champion, unchanged data trains nothing; a transient tracking failure is retried."""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.retrain import rlhf_retrain
from rlhf_core.data.tables import read_rows
from tasks import tracking
from tests.fixtures.tables import write_jsonl

SMOKE = str(Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def test_retrain_notices_new_files_starts_from_the_champion_and_retries_io(
    prefect_harness, tmp_path, mlflow_uri, smoke_world, monkeypatch
):
    drops = tmp_path / "drops"
    drops.mkdir()
    pairs = read_rows(smoke_world.preferences("train"))
    write_jsonl(drops / "2026-11-01.jsonl", pairs[:32])
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}"]
    glob = f"{drops}/*.jsonl"

    # the tracking server is unreachable once, when the data stage tags its run: the task is retried
    failures = []
    real = tracking.logs.set_run_tags

    def flaky(run_id, tags):
        if "data_fingerprint" in tags and not failures:
            failures.append(run_id)
            raise ConnectionError("Connection refused")
        return real(run_id, tags)

    monkeypatch.setattr(tracking.logs, "set_run_tags", flaky)
    first = rlhf_retrain(config_path=SMOKE, overrides=overrides, preference_path=glob)
    assert len(failures) == 1 and first["pipeline"]["skipped"] is None
    assert first["promotion"]["decision"] == "promoted"  # no champion yet
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    champion = client.get_model_version_by_alias("smoke-policy", "champion")
    counts = (
        len(client.search_model_versions("name = 'smoke-policy'")),
        len(client.search_model_versions("name = 'smoke-reward-model'")),
    )

    # the same files again: nothing is trained, registered or promoted
    second = rlhf_retrain(config_path=SMOKE, overrides=overrides, preference_path=glob)
    assert second["pipeline"]["skipped"] == "no new data" and not second["promotion"]["changed"]
    assert (
        len(client.search_model_versions("name = 'smoke-policy'")),
        len(client.search_model_versions("name = 'smoke-reward-model'")),
    ) == counts

    # a new file: a new reward model, and PPO starts from the champion
    write_jsonl(drops / "2026-11-02.jsonl", pairs[32:])
    third = rlhf_retrain(config_path=SMOKE, overrides=overrides, preference_path=glob)
    assert (
        third["pipeline"]["skipped"] is None
        and third["pipeline"]["data_fingerprint"] != first["pipeline"]["data_fingerprint"]
    )
    assert len(client.search_model_versions("name = 'smoke-reward-model'")) > counts[1]
    new = [v for v in client.search_model_versions("name = 'smoke-policy'") if int(v.version) > counts[0]]
    assert {v.tags["stage"] for v in new} == {"ppo", "export"}
    assert all(v.tags["base_model"] == f"models:/smoke-policy/{champion.version}" for v in new)
    assert third["promotion"]["changed"] and third["promotion"]["champion"] == str(champion.version)


def test_retraining_with_dpo_trains_no_reward_model_registers_each_checkpoint_and_is_promoted(
    prefect_harness, tmp_path, mlflow_uri, smoke_world
):
    drops = tmp_path / "drops"
    drops.mkdir()
    write_jsonl(drops / "2026-11-01.jsonl", read_rows(smoke_world.preferences("train"))[:32])
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}", "rl.algorithm=dpo"]
    result = rlhf_retrain(config_path=SMOKE, overrides=overrides, preference_path=f"{drops}/*.jsonl")
    assert result["pipeline"]["algorithm"] == "dpo" and result["promotion"]["decision"] == "promoted"
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    assert client.search_model_versions("name = 'smoke-reward-model'") == []  # DPO trains none
    versions = client.search_model_versions("name = 'smoke-policy'")
    dpo = sorted(int(v.tags["step"]) for v in versions if v.tags["stage"] == "dpo")
    assert dpo == [1, 2]  # every checkpoint a version (rl.save_steps 1)
    champion = client.get_model_version_by_alias("smoke-policy", "champion")
    assert champion.tags["stage"] == "export" and "reward_model_version" not in champion.tags
    assert champion.tags["data_fingerprint"] == result["pipeline"]["data_fingerprint"]
