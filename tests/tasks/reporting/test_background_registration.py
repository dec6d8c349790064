"""Checkpoints registered off the training path: a registration on another thread draws no randomness and
belongs to its stage run; the reporter hands checkpoints over, waits for them at the stage's end, and
fails the stage with the registration's own error."""

import random
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import GenerationConfig

from rlhf_core.config import load_config
from tasks import registry, tracking
from tasks.reporting.identity import RegisteredModel, StageIdentity
from tasks.reporting.reporter import StageReporter

pytestmark = pytest.mark.filterwarnings("ignore")


def rng_states():
    return random.getstate(), np.random.get_state()[1].tolist(), torch.random.get_rng_state().tolist()


def test_a_registration_on_another_thread_draws_no_randomness_and_belongs_to_its_run(cfg, smoke_world, tmp_path):
    # given a checkpoint whose own generation_config samples (as many base models' do)
    checkpoint = tmp_path / "checkpoint-3"
    shutil.copytree(smoke_world.base_model, checkpoint)
    GenerationConfig(do_sample=True, temperature=0.9, top_k=5).save_pretrained(checkpoint)
    torch.manual_seed(123)
    before = rng_states()
    with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "ppo") as run_id:
        outcome = {}
        tags = registry.lineage_tags(stage="ppo", step=3, config_hash="h", data_fingerprint="d")

        def register():  # no active MLflow run on this thread
            outcome["uri"] = registry.register_checkpoint(
                checkpoint, "unit-policy", task="text-generation", tags=tags, run_id=run_id, input_example=False
            )["uri"]

        worker = threading.Thread(target=register)
        worker.start()
        worker.join()
    # then the global generators are where they were (training on the other thread keeps its random stream)
    assert rng_states() == before
    version = MlflowClient().get_model_version("unit-policy", "1")
    assert outcome["uri"] == "models:/unit-policy/1" and version.run_id == run_id
    assert version.tags["step"] == "3"


def test_the_reporter_registers_in_step_order_while_training_goes_on_and_waits_at_the_stage_end(cfg, monkeypatch):
    gate, order = threading.Event(), []

    def register_once(path, model_name, *, task, tags, run_id, keep_last=None, input_example=True):
        assert not input_example  # its validation would draw from torch's generator beside training
        gate.wait(5)
        order.append(tags["step"])
        return f"models:/{model_name}/{len(order)}"

    monkeypatch.setattr(registry, "register_once", register_once)
    with StageReporter(StageIdentity(cfg, "ppo", "run-id"), model=RegisteredModel("p")) as reporter:
        futures = [reporter.on_checkpoint(cfg.run.output_dir, step) for step in (2, 4, 6)]
        assert order == [] and not any(f.done() for f in futures)  # training went on
        gate.set()
        assert reporter.version_of(4) == "models:/p/2"  # waits for the registrations
    assert order == ["2", "4", "6"]


def test_a_failed_background_registration_fails_the_stage_with_its_own_error(cfg, monkeypatch):
    monkeypatch.setattr("tasks.reporting.background.BackgroundJobs.backoff_s", 0.01)
    tried = []

    def register_once(path, model_name, *, task, tags, run_id, keep_last=None, input_example=True):
        tried.append(tags["step"])
        raise ConnectionError("tracking server unreachable")

    monkeypatch.setattr(registry, "register_once", register_once)
    with pytest.raises(ConnectionError, match="unreachable"):
        with StageReporter(StageIdentity(cfg, "reward", "run-id"), model=RegisteredModel("r")) as reporter:
            reporter.on_checkpoint(cfg.run.output_dir, 2)
            reporter.wait_registrations()
    assert tried == ["2"] * 4  # retried as a transient failure, then given up


def test_training_waits_for_each_registration_when_the_background_is_off(tmp_path, mlflow_uri, monkeypatch):
    cfg = load_config(
        None, [f"tracking.uri={mlflow_uri}", f"run.output_dir={tmp_path}", "tracking.register_in_background=false"]
    )
    monkeypatch.setattr(registry, "register_once", lambda path, name, **kw: f"models:/{name}/1")
    reporter = StageReporter(StageIdentity(cfg, "ppo", "run-id"), model=RegisteredModel("p"))
    assert reporter.on_checkpoint(tmp_path, 2) is None and reporter.registrar.registered == {2: "models:/p/1"}


def test_metrics_are_written_beside_training_and_before_the_version_of_their_step(cfg, monkeypatch):
    # given: a slow tracking store, and the order in which metrics and registrations reach it
    gate, events = threading.Event(), []

    def log_metrics(run_id, metrics, step):
        gate.wait(5)
        events.append(("metrics", step))

    def register_once(path, model_name, *, task, tags, run_id, keep_last=None, input_example=True):
        events.append(("version", int(tags["step"])))
        return f"models:/{model_name}/1"

    monkeypatch.setattr(tracking.logs, "log_metrics", log_metrics)
    monkeypatch.setattr(registry, "register_once", register_once)
    with StageReporter(
        StageIdentity(cfg, "ppo", "run-id"), model=RegisteredModel("p"), curves={"kl": ("kl",)}
    ) as reporter:
        reporter.writer.in_background = True  # as for a tracking server
        # when: two steps log and the second one's checkpoint is saved
        reporter.log({"kl": 0.5}, 1)
        reporter.log({"kl": 0.25}, 2)
        future = reporter.on_checkpoint(cfg.run.output_dir, 2)
        # then: training went on (nothing written yet), the curve points are kept at once
        assert events == [] and not future.done()
        assert reporter.history["kl"] == [(1, 0.5), (2, 0.25)]
        gate.set()
    # and the stage's end waited for all of it, the version after the metrics of its step
    assert events == [("metrics", 1), ("metrics", 2), ("version", 2)]


def test_a_failing_stage_still_writes_the_metrics_it_logged(cfg, monkeypatch):
    written = []

    def log_metrics(run_id, metrics, step):
        time.sleep(0.05)
        written.append(step)

    monkeypatch.setattr(tracking.logs, "log_metrics", log_metrics)
    with pytest.raises(ValueError, match="loss is nan"):
        with StageReporter(StageIdentity(cfg, "sft", "run-id")) as reporter:
            reporter.writer.in_background = True
            for step in (1, 2, 3):
                reporter.log({"loss": float(step)}, step)
            raise ValueError("loss is nan")
    assert written == [1, 2, 3]  # what explains the failure is in MLflow


def test_a_metrics_write_that_fails_fails_the_stage(cfg, monkeypatch):
    from mlflow.exceptions import MlflowException

    def log_metrics(run_id, metrics, step):
        raise MlflowException("INVALID_PARAMETER_VALUE: metric value is not a number")

    monkeypatch.setattr(tracking.logs, "log_metrics", log_metrics)
    with pytest.raises(MlflowException, match="not a number"):
        with StageReporter(StageIdentity(cfg, "sft", "run-id")) as reporter:
            reporter.writer.in_background = True
            reporter.log({"loss": 1.0}, 1)


@pytest.mark.parametrize(
    ("uri", "setting", "in_background"),
    [
        ("sqlite:///m.db", None, False),
        ("file:///tmp/mlruns", None, False),
        ("./mlruns", None, False),
        ("https://mlflow.example.org", None, True),
        ("databricks", None, True),
        ("http://127.0.0.1:5000", False, False),
        ("sqlite:///m.db", True, True),
    ],
)
def test_metrics_go_to_the_writer_thread_for_a_server_and_inline_for_a_local_store(
    tmp_path, uri, setting, in_background
):
    overrides = [f"tracking.uri={uri}", f"run.output_dir={tmp_path}"]
    if setting is not None:
        overrides.append(f"tracking.log_in_background={str(setting).lower()}")
    with StageReporter(StageIdentity(load_config(None, overrides), "sft", "run-id")) as reporter:
        assert reporter.writer.in_background is in_background


def test_a_stage_that_registers_warms_the_registry_up_on_its_registration_thread(cfg, monkeypatch):
    threads = []
    monkeypatch.setattr(registry, "warm_up", lambda: threads.append(threading.current_thread().name))
    with StageReporter(StageIdentity(cfg, "sft", "run-id"), model=RegisteredModel("p")) as reporter:
        reporter.start(10, "SFT")
    with StageReporter(StageIdentity(cfg, "data", "run-id")) as reporter:  # registers nothing: no warm-up
        reporter.start(0, "data")
    assert len(threads) == 1 and threads[0].startswith("sft-registration")


def test_the_registry_warm_up_never_fails_a_stage(monkeypatch):
    import mlflow.utils.requirements_utils as requirements_utils

    def broken(requirements):
        raise RuntimeError("a changed MLflow")

    monkeypatch.setattr(requirements_utils, "warn_dependency_requirement_mismatches", broken)
    assert registry.warm_up.__wrapped__() is None


def test_a_registration_builds_its_model_only_while_no_other_thread_builds_one(cfg, smoke_world, tmp_path):
    # transformers' from_pretrained changes process-wide state while it builds a model: a model built on the
    # registration thread beside one built by training came out with its tied weights on the meta device
    from rlhf_core.models.loading import MODEL_BUILDING

    with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "ppo") as run_id:
        tags = registry.lineage_tags(stage="ppo", step=1, config_hash="h", data_fingerprint="d")
        done = threading.Event()

        def register():
            registry.register_checkpoint(
                smoke_world.base_model,
                "unit-policy",
                task="text-generation",
                tags=tags,
                run_id=run_id,
                input_example=False,
            )
            done.set()

        with MODEL_BUILDING:  # training is building a model
            worker = threading.Thread(target=register)
            worker.start()
            assert not done.wait(1.5)  # the registration waits for it
        worker.join(60)
    assert done.is_set() and MlflowClient().get_model_version("unit-policy", "1").tags["step"] == "1"
