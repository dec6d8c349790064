"""A stage's progress artifact (tasks/reporting/progress.py `StageProgress`), moved on the writer thread so that a
Prefect API call never holds up training."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

from tasks.reporting.progress import StageProgress


class ProgressUpdates:
    """The progress of one stage. submit: runs a job on the stage's writer thread (`MetricsWriter.submit`)."""

    def __init__(self, stage: str, submit: Callable[[Callable[[], object], str], Future]):
        self.stage, self.submit = stage, submit
        self.artifact: StageProgress | None = None
        self.total_steps = 0

    def start(self, total_steps: int, description: str, key: str | None = None) -> None:
        """The Prefect progress artifact `<stage>-progress` (or `key`); with total_steps, `at` moves it and `done`
        completes it, else `advance` does."""
        self.total_steps = total_steps
        self.artifact = StageProgress(key or f"{self.stage}-progress", description)

    def advance(self, done: int, total: int) -> None:
        """Move the artifact to done of total (nothing before `start`)."""
        if self.artifact is not None:
            self.submit(partial(self.artifact.update, done, total), f"the {self.stage} progress")

    def at(self, step: int) -> None:
        """Move the artifact to `step` of total_steps, when the stage was started with a total."""
        if self.total_steps:
            self.advance(step, self.total_steps)

    def done(self) -> None:
        self.advance(self.total_steps, self.total_steps)
