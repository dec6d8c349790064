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

    def create_version(model_uri, model_name, tags):
        calls.append(("version", model_uri, model_name, tags))
        return "7"

    monkeypatch.setattr(registration, "log_checkpoint", log_checkpoint)
    monkeypatch.setattr(registration, "create_version", create_version)
    tags = {"stage": "sft", "step": "3"}
    out = registry.register_checkpoint(
        str(tmp_path), "policy", task="text-generation", tags=tags, run_id="r", input_example=False
    )
    assert out == {"name": "policy", "version": "7", "uri": "models:/policy/7"}
    assert calls == [("log", tmp_path, "text-generation", "r", False), ("version", "models:/m-abc", "policy", tags)]


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
