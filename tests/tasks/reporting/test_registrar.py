"""tasks/reporting/registrar.py: a stage's checkpoints become versions in step order, with their lineage, once."""

import threading

import pytest

from rlhf_core.config import load_config
from rlhf_core.storage.checkpoints import STATE_DIR, STATE_JSON, TENSORS
from tasks import registry
from tasks.reporting.identity import RegisteredModel, StageIdentity
from tasks.reporting.metrics import MetricsWriter
from tasks.reporting.registrar import Registrar

pytestmark = pytest.mark.filterwarnings("ignore")


class Log:
    def __init__(self):
        self.lines = []

    def info(self, message, *args):
        self.lines.append(message % args)

    warning = info


@pytest.fixture
def registrar_cfg(tmp_path, mlflow_uri):
    """tests/tasks/conftest.py's `cfg` in the default experiment (no tracking.experiment)."""
    return load_config(None, [f"tracking.uri={mlflow_uri}", f"run.output_dir={tmp_path}", "run.name=unit"])


@pytest.fixture(autouse=True)
def described(monkeypatch):
    """The registered models' descriptions the registrar sets (registry.describe_model), recorded instead."""
    calls = []
    monkeypatch.setattr(registry, "describe_model", lambda name, text: calls.append((name, text)))
    return calls


def registrar(cfg, key="k", lineage=None, checkpoint_tags=None, task="text-generation"):
    identity = StageIdentity(cfg, "ppo", "run-id", key, "fp")
    writer = MetricsWriter(identity, Log())
    model = RegisteredModel("policy", task=task, lineage=lineage or {})
    if checkpoint_tags is None:
        return Registrar(identity, model, writer)
    return Registrar(identity, model, writer, checkpoint_tags)


def fake_register_once(calls, gate=None):
    def register_once(path, model_name, *, task, tags, run_id, keep_last=None, input_example=True):
        if gate is not None:
            gate.wait(5)
        calls.append({"path": path, "name": model_name, "task": task, "run_id": run_id, "tags": tags})
        calls[-1]["input_example"] = input_example
        return f"models:/{model_name}/{len(calls)}"

    return register_once


def test_checkpoints_handed_over_are_registered_in_step_order_on_the_registration_thread(registrar_cfg, monkeypatch):
    gate, calls = threading.Event(), []
    monkeypatch.setattr(registry, "register_once", fake_register_once(calls, gate))
    r = registrar(registrar_cfg)
    futures = [r.on_checkpoint(registrar_cfg.run.output_dir / f"checkpoint-{s}", s) for s in (3, 1, 2)]
    assert calls == [] and not any(f.done() for f in futures)  # handed over: the caller went on
    gate.set()
    assert [f.result() for f in futures] == ["models:/policy/1", "models:/policy/2", "models:/policy/3"]
    assert [c["tags"]["step"] for c in calls] == ["3", "1", "2"]  # in the order they were handed over
    assert not any(c["input_example"] for c in calls)  # none drawn from the generators beside training
    assert r.version_of(1) == "models:/policy/2" and r.registered == {
        3: "models:/policy/1",
        1: "models:/policy/2",
        2: "models:/policy/3",
    }
    r.close()


def test_the_future_of_a_failed_registration_raises_its_error_and_so_does_waiting(registrar_cfg, monkeypatch):
    monkeypatch.setattr("tasks.reporting.background.BackgroundJobs.backoff_s", 0.01)

    def register_once(path, model_name, **kw):
        raise ValueError("the checkpoint has no config.json")

    monkeypatch.setattr(registry, "register_once", register_once)
    r = registrar(registrar_cfg)
    future = r.on_checkpoint(registrar_cfg.run.output_dir, 2)
    with pytest.raises(ValueError, match="no config.json"):
        future.result()
    with pytest.raises(ValueError, match="no config.json"):
        r.wait()
    assert r.registered == {}
    r.close()


def test_a_version_is_tagged_with_its_lineage_its_checkpoint_and_its_steps_evaluation(registrar_cfg, monkeypatch):
    calls = []
    monkeypatch.setattr(registry, "register_once", fake_register_once(calls))
    gold = f"eval/{registrar_cfg.gold_metric()}_mean"
    r = registrar(
        registrar_cfg,
        lineage={"algorithm": "ppo", "base_model": "base"},
        checkpoint_tags=lambda path, step: {"kl": f"{0.5 * step:.4f}"},
        task="text-classification",
    )
    r.writer.record({gold: 0.25, "eval/kl_exact_mean": 0.125, "loss": 1.0}, 4)
    r.on_checkpoint(registrar_cfg.run.output_dir, 4).result()
    [call] = calls
    tags = call["tags"]
    assert call["name"] == "policy" and call["task"] == "text-classification" and call["run_id"] == "run-id"
    assert {k: tags[k] for k in ("stage", "step", "stage_key", "data_fingerprint", "algorithm", "base_model")} == {
        "stage": "ppo",
        "step": "4",
        "stage_key": "k",
        "data_fingerprint": "fp",
        "algorithm": "ppo",
        "base_model": "base",
    }
    assert tags["config_hash"] == registrar_cfg.config_hash() and tags["kl"] == "2.0000"
    assert tags["run_label"] == "unit-ppo-seed42"  # runs of one label are one filter away
    assert tags[gold.replace("/", "_")] == "0.2500" and tags["eval_kl_exact_mean"] == "0.1250"
    assert "loss" not in tags
    r.close()


def test_a_stage_without_a_key_has_no_stage_key_tag(registrar_cfg):
    assert "stage_key" not in registrar(registrar_cfg, key=None).lineage_tags(1)
    assert registrar(registrar_cfg, key="").lineage_tags(1)["stage_key"] == ""


def test_register_waits_for_the_metrics_and_registers_now_with_an_input_example(registrar_cfg, monkeypatch):
    calls = []
    monkeypatch.setattr(registry, "register_once", fake_register_once(calls))
    r = registrar(registrar_cfg)
    assert r.register(registrar_cfg.run.output_dir, 7, guard="passed") == "models:/policy/1"
    assert (
        calls[0]["input_example"] and calls[0]["tags"]["guard"] == "passed" and r.registered == {7: "models:/policy/1"}
    )


def test_nothing_is_registered_when_registration_is_off(tmp_path, mlflow_uri, monkeypatch):
    cfg = load_config(
        None, [f"tracking.uri={mlflow_uri}", f"run.output_dir={tmp_path}", "tracking.register_models=false"]
    )
    monkeypatch.setattr(registry, "register_once", lambda *a, **kw: pytest.fail("registered"))
    monkeypatch.setattr(registry, "warm_up", lambda: pytest.fail("warmed up"))
    r = registrar(cfg)
    r.warm_up()
    assert r.on_checkpoint(tmp_path, 1) is None and r.register(tmp_path, 1) is None
    r.wait()


def test_register_saved_hands_over_the_complete_checkpoints_oldest_first(registrar_cfg, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(registry, "register_once", fake_register_once(calls))
    for step in (10, 2, 5):
        state = tmp_path / "run" / f"checkpoint-{step}" / STATE_DIR
        state.mkdir(parents=True)
        if step != 5:  # checkpoint-5 was cut off before its training state was written
            (state / TENSORS).write_bytes(b"")
            (state / STATE_JSON).write_text("{}")
    r = registrar(registrar_cfg)
    r.register_saved(tmp_path / "run", "policy")
    r.wait()
    assert [(c["tags"]["step"], c["path"].name, c["path"].parent.name) for c in calls] == [
        ("2", "policy", "checkpoint-2"),
        ("10", "policy", "checkpoint-10"),
    ]
    r.close()


def test_alias_points_the_models_alias_at_the_version_of_a_uri(registrar_cfg, monkeypatch):
    set_aliases = []
    monkeypatch.setattr(registry, "set_alias", lambda name, alias, version: set_aliases.append((name, alias, version)))
    assert registrar(registrar_cfg).alias("candidate", "models:/policy/12") == "12"
    assert set_aliases == [("policy", "candidate", "12")]


def test_the_registry_warm_up_runs_on_the_registration_thread(registrar_cfg, monkeypatch):
    threads = []
    monkeypatch.setattr(registry, "warm_up", lambda: threads.append(threading.current_thread().name))
    r = registrar(registrar_cfg)
    r.warm_up()
    r.wait()
    assert len(threads) == 1 and threads[0].startswith("ppo-registration")
    r.close()


def test_the_registered_model_is_described_once_as_the_policy_or_the_reward_model_of_its_runs(
    registrar_cfg, monkeypatch, described
):
    monkeypatch.setattr(registry, "register_once", fake_register_once([]))
    policies, rewards = registrar(registrar_cfg), registrar(registrar_cfg, task="text-classification")
    for step in (1, 2):
        policies.register(registrar_cfg.run.output_dir, step)
    rewards.register(registrar_cfg.run.output_dir, 1)
    assert [name for name, _ in described] == ["policy", "policy"]  # once per stage, each model
    policy, reward = described[0][1], described[1][1]
    assert policy.startswith("The policies of the RLHF pipeline's runs named `unit-<algorithm>-seed<seed>`")
    assert "`candidate`" in policy and "`champion`" in policy and "`run_label`" in policy
    assert reward.startswith("The reward models of the RLHF pipeline's runs named `unit-<algorithm>-seed<seed>`")
    assert "`reward_model_version`" in reward
