"""rlhf_core/training/metric_window.py: what a log step logs, from the steps since the last one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf_core.training.metric_window import (
    LastStep,
    LoopMetrics,
    MeanOverSteps,
    metric_window,
    reduce_over_processes,
    step_means,
)


class Recorder:
    """reduce, annotate and show that note their calls: reduce passes numbers through as floats,
    annotate adds the seconds it was given under "elapsed"."""

    def __init__(self):
        self.reduced, self.shown, self.elapsed = [], [], []

    def reduce(self, metrics):
        self.reduced.append(dict(metrics))
        return {k: float(v) for k, v in metrics.items()}

    def annotate(self, metrics, elapsed):
        self.elapsed.append(elapsed)
        metrics["elapsed"] = elapsed
        return metrics

    def show(self, metrics):
        self.shown.append(dict(metrics))

    def window(self, mode):
        return metric_window(mode, self.reduce, self.annotate, self.show)


def test_the_mode_chooses_the_window_once():
    calls = Recorder()
    assert type(calls.window("last")) is LastStep and type(calls.window("mean")) is MeanOverSteps
    with pytest.raises(KeyError):
        calls.window("median")


def test_the_mean_window_averages_the_steps_since_the_last_log_in_one_reduction():
    # given three steps, one value a tensor left on the device as a stage returns it
    calls = Recorder()
    window = calls.window("mean")
    for loss, accuracy in [(1.0, 0.5), (2.0, 0.25), (6.0, 0.0)]:
        window.record({"loss": torch.tensor(loss), "accuracy": accuracy})
        assert window.stepped(0.0) is None  # nothing a checkpoint records until the log step
    assert calls.reduced == []  # no collective between log steps
    # when the log step comes
    logged = window.logged(0.0)
    # then each key is the mean over the three steps (by hand), reduced once, shown once
    assert logged["loss"] == pytest.approx((1.0 + 2.0 + 6.0) / 3)
    assert logged["accuracy"] == pytest.approx((0.5 + 0.25 + 0.0) / 3)
    assert len(calls.reduced) == 1 and calls.shown == [logged] and logged["elapsed"] >= 0.0
    # and the next window starts empty
    window.record({"loss": 10.0, "accuracy": 1.0})
    assert window.logged(0.0)["loss"] == 10.0


def test_the_last_window_reduces_every_step_and_logs_the_latest():
    calls = Recorder()
    window = calls.window("last")
    for value in (1.0, 2.0, 3.0):
        window.record({"value": value})
        latest = window.stepped(0.0)
        assert latest["value"] == value  # what a checkpoint of this step records
    assert [r["value"] for r in calls.reduced] == [1.0, 2.0, 3.0]  # one reduction per step
    assert [s["value"] for s in calls.shown] == [1.0, 2.0, 3.0]
    # the log step logs the latest step as it was, without another reduction or another display
    assert window.logged(0.0) is latest
    assert len(calls.reduced) == 3 and len(calls.shown) == 3


def test_step_means_are_float_means_per_key():
    means = step_means([{"a": 1, "b": torch.tensor(2.0)}, {"a": 2, "b": torch.tensor(5.0)}])
    assert means["a"].dtype == torch.float32 and float(means["a"]) == 1.5 and float(means["b"]) == 3.5


def test_the_loops_own_numbers_go_under_the_stages_names():
    own = LoopMetrics(lr="sft/learning_rate", grad_norm="sft/grad_norm", epoch="sft/epoch", timing=True)
    metrics = own.add(
        {"sft/loss": 1.0, "_tokens": 40.0},
        2.0,
        lr=0.01,
        batches=SimpleNamespace(fraction=1.25),
        grad_norm=torch.tensor(3.0),
        skipped=2,
    )
    assert metrics == {
        "sft/loss": 1.0,
        "sft/learning_rate": 0.01,
        "sft/epoch": 1.25,
        "sft/grad_norm": 3.0,
        "perf/step_seconds": 2.0,
        "perf/tokens_per_second": 20.0,
        "perf/skipped_steps": 2.0,
    }
    # unnamed ones, no gradient norm yet (every step skipped so far) and no timing: only lr and the skip count
    bare = LoopMetrics().add({"_tokens": 4.0}, 1.0, lr=0.5, batches=None, grad_norm=None, skipped=0)
    assert bare == {"lr": 0.5, "perf/skipped_steps": 0.0}


def test_one_process_reduces_to_its_own_numbers_as_floats():
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    reduced = reduce_over_processes(accelerator, {"loss": torch.tensor(0.5), "_tokens": 3, "completions/min_length": 2})
    assert reduced == {"loss": 0.5, "_tokens": 3.0, "completions/min_length": 2.0}
    assert all(type(v) is float for v in reduced.values())
