"""tasks/registry/registration.py: a registration is two halves, the checkpoint logged to its run, then a version
made from that logged model with its tags; a version that never becomes READY is deleted again."""

from types import SimpleNamespace

import mlflow
import pytest

import tasks.registry.registration as registration
from tasks import registry


def test_register_checkpoint_logs_the_checkpoint_then_makes_a_version_of_that_logged_model(monkeypatch, tmp_path):
    calls = []

    def log_checkpoint(checkpoint_dir, *, task, tags, run_id, input_example):
        calls.append(("log", checkpoint_dir, task, run_id, input_example))
        return SimpleNamespace(model_uri="models:/m-abc")

    def create_version(model_uri, model_name, tags, description):
        calls.append(("version", model_uri, model_name, tags, description))
        return "7"

    monkeypatch.setattr(registration, "log_checkpoint", log_checkpoint)
    monkeypatch.setattr(registration, "create_version", create_version)
    tags = {"stage": "sft", "step": "3", "code_version": "0.1.0", "stage_key": ""}
    out = registry.register_checkpoint(
        str(tmp_path), "policy", task="text-generation", tags=tags, run_id="r", input_example=False
    )
    assert out == {"name": "policy", "version": "7", "uri": "models:/policy/7"}
    assert calls == [
        ("log", tmp_path, "text-generation", "r", False),
        ("version", "models:/m-abc", "policy", {"stage": "sft", "step": "3"}, registry.checkpoint_description(tags)),
    ]


RL_CHECKPOINT = {  # what the RL stage records for a checkpoint whose evaluation passed the guard
    "stage": "ppo",
    "step": "40",
    "config_hash": "1f5a6225fe4abae1",
    "data_fingerprint": "676034046b2b4c1f",
    "code_version": "0.1.0+g7aa858b",
    "run_label": "demo-ppo-seed42",
    "stage_key": "2be58f3d25566648",
    "algorithm": "ppo",
    "reward_model_version": "models:/demo-reward-model/6",
    "base_model": "models:/demo-policy/1",
    "eval_vader_compound_mean": "0.4120",
    "eval_score_mean": "1.2100",
    "eval_kl_exact_mean": "1.7829",
    "kl": "2.0000",
    "guard.passed": "true",
    "guard.broken": "",
}


def test_a_version_is_tagged_with_what_a_person_filters_on_and_describes_the_rest():
    tags = registry.version_tags(RL_CHECKPOINT)
    assert tags == {
        "stage": "ppo",
        "step": "40",
        "data_fingerprint": "676034046b2b4c1f",
        "run_label": "demo-ppo-seed42",
        "stage_key": "2be58f3d25566648",
        "reward_model_version": "models:/demo-reward-model/6",
        "base_model": "models:/demo-policy/1",
        "eval_vader_compound_mean": "0.4120",
        "guard.passed": "true",
    }
    assert "" not in tags.values()
    # MLflow's list of versions shows every tag, one a line: with the guard's rules broken and after a rollback, 11
    broken = {**RL_CHECKPOINT, "guard.passed": "false", "guard.broken": "kl_budget", "attempt": "2"}
    assert len(registry.version_tags(broken)) == 11
    # what is read rather than filtered on; the first line plain text, as the list of versions shows it raw
    assert registry.checkpoint_description(RL_CHECKPOINT) == (
        "ppo checkpoint at step 40 of run demo-ppo-seed42.\n\n"
        "- algorithm: `ppo`\n"
        "- held-out reward-model score (the proxy): `1.2100`\n"
        "- held-out KL to the initial policy (exact, nats per completion): `1.7829`\n"
        "- training KL estimate at this step (k1, sampled, nats): `2.0000`\n"
        "- config hash: `1f5a6225fe4abae1`\n"
        "- code version: `0.1.0+g7aa858b`"
    )
    assert registry.checkpoint_description({"stage": "sft", "step": "8"}) == "sft checkpoint at step 8."


def test_a_ready_version_gets_its_description(monkeypatch):
    described = []

    class Described(Client):
        def update_model_version(self, name, version, description):
            described.append((name, version, description))

    monkeypatch.setattr(mlflow, "register_model", lambda uri, name, tags: SimpleNamespace(version=3))
    monkeypatch.setattr(registration, "MlflowClient", Described)
    monkeypatch.setattr(registration, "await_ready", lambda name, version: None)
    assert registration.create_version("models:/m-abc", "policy", {}, "`sft` checkpoint at step 8.") == "3"
    assert described == [("policy", 3, "`sft` checkpoint at step 8.")]


class Client:
    deleted: list = []

    def delete_model_version(self, name, version):
        Client.deleted.append((name, version))


def test_a_version_that_never_becomes_ready_is_deleted_again(monkeypatch):
    made = []

    def register_model(model_uri, name, tags):
        made.append((model_uri, name, tags))
        return SimpleNamespace(version=4)

    def never_ready(name, version):
        raise RuntimeError(f"model version {name}/{version} did not become READY")

    Client.deleted = []
    monkeypatch.setattr(mlflow, "register_model", register_model)
    monkeypatch.setattr(registration, "MlflowClient", Client)
    monkeypatch.setattr(registration, "await_ready", never_ready)
    with pytest.raises(RuntimeError, match="policy/4 did not become READY"):
        registration.create_version("models:/m-abc", "policy", {"step": "1"})
    assert made == [("models:/m-abc", "policy", {"step": "1"})] and Client.deleted == [("policy", 4)]


def test_a_ready_version_is_its_number(monkeypatch):
    monkeypatch.setattr(mlflow, "register_model", lambda uri, name, tags: SimpleNamespace(version=2))
    monkeypatch.setattr(registration, "await_ready", lambda name, version: None)
    assert registration.create_version("models:/m-abc", "policy", {}) == "2"


def test_the_package_re_exports_each_half():
    from tasks.registry import logged_model, versions

    assert registry.register_once is registration.register_once
    assert registry.log_checkpoint is logged_model.log_checkpoint
    assert registry.prune_versions is versions.prune_versions and registry.set_alias is versions.set_alias
