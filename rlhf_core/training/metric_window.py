"""What a training loop logs from the steps since its last log: the latest step's metrics, or their means.

One window per `LoopSettings.log_window`, chosen once when the loop starts:
- "last" (RL, whose checkpoints record the step's metrics): every step's metrics are averaged over
  processes (one all-reduce per step) and the latest is logged;
- "mean" (SFT, reward model): the steps since the last log are averaged at log time, in one all-reduce
  (every step returns the same keys; the loop's timing covers the last step only).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlhf_core.training.parallel import reduce_metrics

SUMMED = ("_tokens", "val/num_eos_tokens")  # metrics that add up over processes (the others are averaged)
MINIMA, MAXIMA = ("completions/min_length",), ("completions/max_length",)

Reduce = Callable[[dict[str, Any]], dict[str, float]]
Annotate = Callable[[dict[str, float], float], dict[str, float]]  # (metrics, seconds since the step began)
Show = Callable[[dict[str, float]], None]


@dataclass(frozen=True)
class LoopMetrics:
    """The loop's own numbers added to a stage's metrics, under the stage's names (None: not logged)."""

    lr: str = "lr"
    grad_norm: str | None = None
    epoch: str | None = None  # epochs done, as a fraction (the batches' `fraction`)
    timing: bool = False  # perf/step_seconds, perf/tokens_per_second (from a "_tokens" metric), time/<phase>_s

    def add(self, metrics: dict[str, float], elapsed: float, *, lr: float, batches, grad_norm, skipped: int):
        """`metrics` with the learning rate, epochs, gradient norm, timing (`elapsed`: seconds since the step
        began) and the skipped steps; the "_tokens" count is consumed."""
        metrics[self.lr] = lr
        if self.epoch is not None:
            metrics[self.epoch] = batches.fraction
        if self.grad_norm is not None and grad_norm is not None:
            metrics[self.grad_norm] = float(grad_norm)
        tokens = metrics.pop("_tokens", 0.0)
        if self.timing:
            metrics.update({"perf/step_seconds": elapsed, "perf/tokens_per_second": tokens / elapsed})
        metrics["perf/skipped_steps"] = float(skipped)
        return metrics


def reduce_over_processes(accelerator, metrics: dict[str, Any]) -> dict[str, float]:
    """Every process's numbers in one collective: averaged, or summed / min / max for the keys above."""
    keys = set(metrics)
    return reduce_metrics(
        accelerator,
        metrics,
        sums=[k for k in SUMMED if k in keys],
        mins=[k for k in MINIMA if k in keys],
        maxes=[k for k in MAXIMA if k in keys],
    )


def step_means(steps: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The mean of each key over `steps` (numbers or 0-d tensors, left on their device)."""
    return {k: torch.stack([torch.as_tensor(s[k]) for s in steps]).float().mean() for k in steps[0]}


class MetricWindow(ABC):
    """The steps' metrics between two logs. `reduce` combines them over processes (a collective),
    `annotate(metrics, seconds)` adds the loop's own numbers, `show` puts them beside the progress bar."""

    def __init__(self, reduce: Reduce, annotate: Annotate, show: Show):
        self.reduce, self.annotate, self.show = reduce, annotate, show

    @abstractmethod
    def record(self, metrics: dict[str, Any]) -> None:
        """A step's metrics as the stage returned them, before the schedule steps."""

    def stepped(self, started: float) -> dict[str, float] | None:
        """Once the step counts: the step's own metrics when this window makes them at every step, else None."""
        return None

    @abstractmethod
    def logged(self, started: float) -> dict[str, float]:
        """At a log step: what is logged (`started`: when the step began, for the timing)."""


class LastStep(MetricWindow):
    """Logs the latest step's metrics, reduced over processes at every step."""

    def __init__(self, reduce: Reduce, annotate: Annotate, show: Show):
        super().__init__(reduce, annotate, show)
        self.reduced: dict[str, float] = {}
        self.latest: dict[str, float] = {}

    def record(self, metrics: dict[str, Any]) -> None:
        self.reduced = self.reduce(metrics)

    def stepped(self, started: float) -> dict[str, float]:
        self.latest = self.annotate(self.reduced, time.perf_counter() - started)
        self.show(self.latest)
        return self.latest

    def logged(self, started: float) -> dict[str, float]:
        return self.latest


class MeanOverSteps(MetricWindow):
    """Logs the means of the steps since the last log, reduced over processes at log time."""

    def __init__(self, reduce: Reduce, annotate: Annotate, show: Show):
        super().__init__(reduce, annotate, show)
        self.steps: list[dict[str, Any]] = []

    def record(self, metrics: dict[str, Any]) -> None:
        self.steps.append(metrics)

    def logged(self, started: float) -> dict[str, float]:
        steps, self.steps = self.steps, []
        logged = self.annotate(self.reduce(step_means(steps)), time.perf_counter() - started)
        self.show(logged)
        return logged


WINDOWS: dict[str, type[MetricWindow]] = {"last": LastStep, "mean": MeanOverSteps}


def metric_window(mode: Literal["last", "mean"], reduce: Reduce, annotate: Annotate, show: Show) -> MetricWindow:
    return WINDOWS[mode](reduce, annotate, show)
