"""One stage's reporting, shared by every stage task: metrics, curves, registered versions, progress.

A `StageReporter` is made inside the stage's MLflow run. Its bound methods are the callbacks the
rlhf_core loops take (`log` as on_log, `on_checkpoint` as on_checkpoint): a stage task is then a short
sequence of calls. It is composed of three parts with one concern each: the `MetricsWriter`
(tasks/reporting/metrics.py: step metrics, curves, figures, tags and files of the stage run, on a writer
thread when the store is a server), the `Registrar` (tasks/reporting/registrar.py: each checkpoint a version,
in step order on a registration thread) and the `ProgressUpdates` (tasks/reporting/progress_updates.py: the
Prefect progress artifact, moved on the writer thread). What a stage reports beyond that is a subclass with
its own `on_eval` and `checkpoint_tags` (`RewardReporter` in tasks/stages/reward_model.py, `PolicyReporter` in
tasks/stages/rl/reporting.py) or a few functions beside the task (tasks/stages/data.py, tasks/stages/export.py).

The reporter is a context manager: when the stage ends it waits for both threads (a failure fails the
stage); when the stage fails, the metrics still go out, the registrations not started are dropped, the
running one finishes, and the next run registers what is left (`register_saved`).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

from tasks.launch.launcher import stage_logger
from tasks.reporting.identity import RegisteredModel, StageIdentity
from tasks.reporting.metrics import MetricsWriter
from tasks.reporting.progress_updates import ProgressUpdates
from tasks.reporting.registrar import Registrar


class StageReporter:
    """Reporting for one stage run.

    curves: curve name -> the metric names it is read from (the first present), recorded by `log` and `record`.
    model: where `register` and `on_checkpoint` put checkpoints (None for a stage that registers nothing).
    """

    def __init__(
        self,
        identity: StageIdentity,
        *,
        curves: dict[str, tuple[str, ...]] | None = None,
        model: RegisteredModel | None = None,
    ):
        self.identity = identity
        self.cfg, self.stage, self.run_id = identity.cfg, identity.stage, identity.run_id
        self.logger = stage_logger()
        self.writer = MetricsWriter(identity, self.logger, curves)
        self.registrar = Registrar(identity, model, self.writer, self.checkpoint_tags)
        self.progress = ProgressUpdates(identity.stage, self.writer.submit)

    def __enter__(self) -> StageReporter:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        try:
            if error is None:
                self.writer.wait()
                self.wait_registrations()
            else:
                self.writer.flush_quietly()  # the metrics up to a failure are what explains it
                self.registrar.cancel()
        finally:
            self.writer.close()
            self.registrar.close()

    def switch_run(self, run_id: str) -> None:
        """Report to the MLflow run `run_id` from now on (an RL attempt's run after a guard rollback): what was
        handed to the writer and registration threads goes to the run before first, and the checkpoints
        registered from now on are logged models of `run_id`."""
        self.writer.wait()
        self.wait_registrations()
        self.identity = replace(self.identity, run_id=run_id)
        self.run_id, self.writer.identity, self.registrar.identity = run_id, self.identity, self.identity

    @property
    def history(self) -> dict[str, list[tuple[int, float]]]:
        """The curves' points so far: curve name -> [(step, value)]."""
        return self.writer.history

    # metrics, curves and progress
    def start(self, total_steps: int, description: str, key: str | None = None) -> None:
        """The progress artifact `<stage>-progress` (or `key`), moved by `log` when total_steps is set, else by
        `advance`; the registry warmed up for the stage's first version."""
        self.progress.start(total_steps, description, key)
        self.registrar.warm_up()

    def advance(self, done: int, total: int, *_) -> None:
        """Move the progress artifact to done of total (a progress callback: extra arguments are ignored)."""
        self.progress.advance(done, total)

    def record(self, metrics: dict[str, float], step: int) -> None:
        """Add the curves' points found in `metrics`, and keep them as the metrics of `step` (its version's tags)."""
        self.writer.record(metrics, step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """on_log: the metrics to MLflow at `step`, their curve points kept, the progress artifact moved."""
        self.writer.log(metrics, step)
        self.progress.at(step)

    def done(self) -> None:
        self.progress.done()

    def plot(self, artifact_file: str, title: str, history: dict[str, list[tuple[int, float]]] | None = None) -> None:
        self.writer.plot(artifact_file, title, history)

    def tag(self, tags: dict[str, str]) -> None:
        self.writer.tag(tags)

    def artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.writer.artifact(path, artifact_path)

    # the registry
    def checkpoint_tags(self, path: Path, step: int) -> dict[str, str]:
        """The tags of one checkpoint beyond the stage's lineage (read from its metrics.json in subclasses)."""
        return {}

    def on_checkpoint(self, path: Path, step: int) -> Future | None:
        """on_checkpoint: register a saved checkpoint in the background (`Registrar.on_checkpoint`)."""
        return self.registrar.on_checkpoint(path, step)

    def register(self, path: str | Path, step: int, **tags) -> str | None:
        """Register the checkpoint at `path` now (`Registrar.register`): its version, None when registration is off."""
        return self.registrar.register(path, step, **tags)

    def register_saved(self, out_dir: Path, subdir: str = "") -> None:
        """Register every complete checkpoint already under out_dir (a crashed attempt's included), oldest first."""
        self.registrar.register_saved(out_dir, subdir)

    def wait_registrations(self) -> None:
        """Block until every checkpoint handed to the background is registered; raise the first failure."""
        self.registrar.wait()

    def version_of(self, step: int) -> str | None:
        """The registered version (models:/ URI) of the checkpoint of `step`, once registrations are done."""
        self.wait_registrations()  # through the reporter: what bench/timing/flow_vs_bare_loops.py times
        return self.registrar.version_of(step)

    def alias(self, alias: str, uri: str) -> str:
        """Point `alias` of the model at the version of `uri` (models:/name/N); return the version."""
        return self.registrar.alias(alias, uri)
