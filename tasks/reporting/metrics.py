"""What a stage writes to its MLflow run: each step's metrics, the curves read from them, figures, tags and files.

A step's metrics go out on the writer thread (tasks/reporting/background.py) when the store is a server
(tracking.log_in_background), and training goes on; for a local store they are written inline: that write
is Python work, and on a thread of its own it would hold the GIL beside the rollout's decode loop and cost
more than inline. The same thread carries the progress artifact's updates (tasks/reporting/progress_updates.py).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path

from tasks import tracking
from tasks.reporting.background import BackgroundJobs
from tasks.reporting.identity import StageIdentity
from tasks.reporting.plots import close, curve_figure


class MetricsWriter:
    """The stage run's writer. curves: curve name -> the metric names it is read from (the first present)."""

    def __init__(self, identity: StageIdentity, logger, curves: dict[str, tuple[str, ...]] | None = None):
        self.identity, self.logger = identity, logger
        self.sources = dict(curves or {})
        self.history: dict[str, list[tuple[int, float]]] = {name: [] for name in self.sources}
        self.step_metrics: dict[int, dict[str, float]] = {}  # what `record` saw per step (a version's own step)
        self.jobs = BackgroundJobs(f"{identity.stage}-tracking")
        in_background = identity.cfg.tracking.log_in_background
        self.in_background = (
            not tracking.store.is_local_store(identity.cfg.tracking_uri()) if in_background is None else in_background
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        """The metrics to MLflow at `step` (on the writer thread when in_background), their curve points kept."""
        metrics = dict(metrics)
        if self.in_background:
            self.jobs.submit(
                partial(tracking.logs.log_metrics, self.identity.run_id, metrics, step),
                f"the {self.identity.stage} metrics",
            )
        else:
            tracking.logs.log_metrics(self.identity.run_id, metrics, step)
        self.record(metrics, step)

    def record(self, metrics: dict[str, float], step: int) -> None:
        """Add the curves' points found in `metrics`, and keep them as the metrics of `step`."""
        self.step_metrics.setdefault(step, {}).update(metrics)
        for name, keys in self.sources.items():
            key = next((k for k in keys if k in metrics), None)
            if key is not None:
                self.history[name].append((step, metrics[key]))

    def start_over(self, after_step: int) -> dict[str, list[tuple[int, float]]]:
        """Training went back to `after_step` (a guard rollback: a new attempt): every curve keeps its points up
        to that step, the trunk the new attempt grows from, and the metrics kept for later steps are forgotten;
        returns the curves as they were (the attempt rolled back)."""
        before = self.history
        self.history = {name: [(s, v) for s, v in points if s <= after_step] for name, points in before.items()}
        self.step_metrics = {s: m for s, m in self.step_metrics.items() if s <= after_step}
        return before

    def plot(self, artifact_file: str, title: str, history: dict[str, list[tuple[int, float]]] | None = None) -> None:
        """The curves (or `history`) as a PNG artifact of the stage run."""
        fig = curve_figure(self.history if history is None else history, title)
        tracking.logs.log_figure(self.identity.run_id, fig, artifact_file)
        close(fig)

    def tag(self, tags: dict[str, str]) -> None:
        tracking.logs.set_run_tags(self.identity.run_id, tags)

    def artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        tracking.logs.log_artifact(self.identity.run_id, path, artifact_path)

    def submit(self, job: Callable[[], object], what: str) -> Future:
        """Run `job` on the writer thread, after what was handed to it before."""
        return self.jobs.submit(job, what)

    def submitted(self) -> list[Future]:
        """The writes handed to the thread so far and not seen finished (a registration waits for them)."""
        return self.jobs.submitted()

    def wait(self) -> None:
        """Block until every write handed to the thread is done; raise the first failure."""
        self.jobs.wait()

    def flush_quietly(self) -> None:
        """Wait for the writes handed to the thread; a failure of theirs is logged, not raised (the stage is
        failing already with its own error)."""
        try:
            self.jobs.wait()
        except Exception as err:  # noqa: BLE001 (the stage's own error is the one to raise)
            self.logger.warning("%s metrics not all logged: %s", self.identity.stage, err)

    def close(self) -> None:
        self.jobs.close()
