"""tasks/reporting/metrics.py: a stage run's metrics, inline or on the writer thread, and the curves read from them."""

import threading

import pytest

from rlhf_core.config import load_config
from tasks import tracking
from tasks.reporting.identity import StageIdentity
from tasks.reporting.metrics import MetricsWriter


class Log:
    def __init__(self):
        self.warnings = []

    def warning(self, message, *args):
        self.warnings.append(message % args)


@pytest.fixture
def identity(tmp_path, mlflow_uri):
    cfg = load_config(None, [f"tracking.uri={mlflow_uri}", f"run.output_dir={tmp_path}"])
    return StageIdentity(cfg, "reward", "run-id")


def test_record_keeps_each_curves_first_present_metric_and_every_metric_of_the_step(identity):
    writer = MetricsWriter(identity, Log(), {"loss": ("train/loss", "loss"), "acc": ("eval_accuracy",)})
    writer.record({"loss": 2.0, "train/loss": 1.5}, 1)
    writer.record({"loss": 1.0}, 2)
    writer.record({"eval_accuracy": 0.75}, 2)
    assert writer.history == {"loss": [(1, 1.5), (2, 1.0)], "acc": [(2, 0.75)]}
    assert writer.step_metrics == {1: {"loss": 2.0, "train/loss": 1.5}, 2: {"loss": 1.0, "eval_accuracy": 0.75}}


def test_starting_over_keeps_the_trunk_and_returns_the_attempt_rolled_back(identity):
    writer = MetricsWriter(identity, Log(), {"kl": ("kl",), "gold": ("eval/gold",)})
    writer.record({"eval/gold": 0.1}, 0)
    for step in (1, 2, 3):
        writer.record({"kl": float(step)}, step)
    writer.record({"eval/gold": 0.4}, 2)
    before = writer.start_over(1)  # a guard rollback to step 1
    assert before == {"kl": [(1, 1.0), (2, 2.0), (3, 3.0)], "gold": [(0, 0.1), (2, 0.4)]}
    assert writer.history == {"kl": [(1, 1.0)], "gold": [(0, 0.1)]} and sorted(writer.step_metrics) == [0, 1]
    writer.record({"kl": 1.5}, 2)
    assert writer.history["kl"] == [(1, 1.0), (2, 1.5)]  # the new attempt's line never goes back


def test_a_local_store_is_written_inline(identity, monkeypatch):
    written = []
    monkeypatch.setattr(tracking.logs, "log_metrics", lambda run_id, m, step: written.append((run_id, m, step)))
    writer = MetricsWriter(identity, Log(), {"loss": ("loss",)})
    assert not writer.in_background  # sqlite: a local store
    writer.log({"loss": 0.5}, 3)
    assert written == [("run-id", {"loss": 0.5}, 3)] and writer.history["loss"] == [(3, 0.5)]
    assert writer.submitted() == []


def test_in_the_background_the_metrics_go_out_on_the_writer_thread_in_order(identity, monkeypatch):
    gate, written = threading.Event(), []

    def log_metrics(run_id, metrics, step):
        gate.wait(5)
        written.append((step, threading.current_thread().name))

    monkeypatch.setattr(tracking.logs, "log_metrics", log_metrics)
    writer = MetricsWriter(identity, Log())
    writer.in_background = True
    metrics = {"loss": 1.0}
    writer.log(metrics, 1)
    metrics["loss"] = 9.0  # the caller's dict changing later changes nothing written
    writer.log({"loss": 0.5}, 2)
    assert written == [] and len(writer.submitted()) == 2
    gate.set()
    writer.wait()
    assert [s for s, _ in written] == [1, 2] and all(t.startswith("reward-tracking") for _, t in written)
    assert writer.step_metrics[1] == {"loss": 1.0}
    writer.close()


def test_flush_quietly_logs_a_failed_write_instead_of_raising(identity, monkeypatch):
    def log_metrics(run_id, metrics, step):
        raise ValueError("metric value is not a number")

    monkeypatch.setattr(tracking.logs, "log_metrics", log_metrics)
    log = Log()
    writer = MetricsWriter(identity, log)
    writer.in_background = True
    writer.log({"loss": float("nan")}, 1)
    writer.flush_quietly()
    assert log.warnings == ["reward metrics not all logged: metric value is not a number"]
    with pytest.raises(ValueError, match="not a number"):
        writer.wait()
    writer.close()
