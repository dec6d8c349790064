"""One stage's reporting, shared by every stage task: metrics, curves, registered versions, Prefect artifacts.

A `StageReporter` is made inside the stage's MLflow run. Its bound methods are the callbacks the
rlhf_core loops take (`log` as on_log, `on_checkpoint` as on_checkpoint): a stage task is then a short
sequence of calls, and what a stage reports beyond that lives in a small subclass next to the task.
Every write goes through tasks/tracking.py and tasks/registry.py, so the processes of a
data-parallel stage other than rank 0 write nothing.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import PipelineConfig
from tasks import registry, tracking
from tasks.launcher import stage_logger
from tasks.plots import close, curve_figure
from tasks.progress import StageProgress, publish_markdown, publish_table
from tasks.stage_io import register_saved_checkpoints


class StageReporter:
    """Reporting for one stage run.

    stage: the stage's name (MLflow run, lineage tag `stage`, artifact keys `<stage>-progress`).
    curves: curve name -> the metric names it is read from (the first present), recorded by `log` and `record`.
    model_name, task, lineage: where `register` puts a checkpoint, its transformers task, and the lineage
    tags every version of this stage carries besides stage, step, config hash and data fingerprint.
    """

    def __init__(
        self,
        cfg: PipelineConfig,
        stage: str,
        run_id: str,
        *,
        data_fingerprint: str = "",
        curves: dict[str, tuple[str, ...]] | None = None,
        model_name: str | None = None,
        task: str = "text-generation",
        lineage: dict[str, str] | None = None,
    ):
        self.cfg, self.stage, self.run_id = cfg, stage, run_id
        self.data_fingerprint = data_fingerprint
        self.sources = dict(curves or {})
        self.history: dict[str, list[tuple[int, float]]] = {name: [] for name in self.sources}
        self.model_name, self.task, self.lineage = model_name, task, dict(lineage or {})
        self.registered: dict[int, str] = {}
        self.step_metrics: dict[int, dict[str, float]] = {}  # what `record` saw per step (a version's own step)
        self.logger = stage_logger()
        self.progress: StageProgress | None = None
        self.total_steps = 0

    # metrics and curves
    def start(self, total_steps: int, description: str, key: str | None = None) -> None:
        """The Prefect progress artifact `<stage>-progress` (or `key`); with total_steps, `log` moves it and `done`
        completes it, else `advance` does."""
        self.total_steps = total_steps
        self.progress = StageProgress(key or f"{self.stage}-progress", description)

    def advance(self, done: int, total: int, *_) -> None:
        """Move the progress artifact to done of total (a progress callback: extra arguments are ignored)."""
        if self.progress is not None:
            self.progress.update(done, total)

    def record(self, metrics: dict[str, float], step: int) -> None:
        """Add the curves' points found in `metrics`, and keep them as the metrics of `step` (see `eval_tags`)."""
        self.step_metrics.setdefault(step, {}).update(metrics)
        for name, keys in self.sources.items():
            key = next((k for k in keys if k in metrics), None)
            if key is not None:
                self.history[name].append((step, metrics[key]))

    def log(self, metrics: dict[str, float], step: int) -> None:
        """on_log: the metrics to MLflow at `step`, their curve points kept, the progress artifact moved."""
        tracking.log_metrics(self.run_id, metrics, step)
        self.record(metrics, step)
        if self.total_steps:
            self.advance(step, self.total_steps)

    def done(self) -> None:
        self.advance(self.total_steps, self.total_steps)

    def plot(self, artifact_file: str, title: str, history: dict[str, list[tuple[int, float]]] | None = None) -> None:
        """The curves (or `history`) as a PNG artifact of the stage run."""
        fig = curve_figure(self.history if history is None else history, title)
        tracking.log_figure(self.run_id, fig, artifact_file)
        close(fig)

    def tag(self, tags: dict[str, str]) -> None:
        tracking.set_run_tags(self.run_id, tags)

    def artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        tracking.log_artifact(self.run_id, path, artifact_path)

    # the registry
    def eval_tags(self, step: int) -> dict[str, str]:
        """The held-out evaluation of `step` (its `eval/...` metrics seen by `record`) as version tags
        `eval_<name>` (the export's naming), so each version carries its own step's evaluation."""
        metrics = self.step_metrics.get(step, {})
        return {k.replace("/", "_"): f"{v:.4f}" for k, v in metrics.items() if k.startswith("eval/")}

    def register(self, path: str | Path, step: int, **tags) -> str | None:
        """Register the checkpoint at `path` once, as a version of model_name with the lineage tags, the
        evaluation of its own step (`eval_tags`) and `tags`. The logged model carries the stage run's
        metrics of that step (tasks/registry.py).

        None when registration is off (tracking.register_models: false); "" on ranks other than 0.
        """
        if not self.cfg.tracking.register_models:
            return None
        lineage = registry.lineage_tags(
            stage=self.stage,
            step=step,
            config_hash=self.cfg.config_hash(),
            data_fingerprint=self.data_fingerprint,
            **self.lineage,
            **{**self.eval_tags(step), **tags},
        )
        self.registered[step] = registry.register_once(
            path,
            self.model_name,
            task=self.task,
            tags=lineage,
            run_id=self.run_id,
            keep_last=self.cfg.registry.keep_last_versions,
        )
        return self.registered[step]

    def checkpoint_tags(self, path: Path, step: int) -> dict[str, str]:
        """The tags of one checkpoint beyond the stage's lineage (read from its metrics.json in subclasses)."""
        return {}

    def on_checkpoint(self, path: Path, step: int) -> None:
        """on_checkpoint: register a saved checkpoint and say which version it is."""
        uri = self.register(path, step, **self.checkpoint_tags(path, step))
        if uri is not None:
            self.logger.info("%s checkpoint %d is %s", self.stage, step, uri)

    def register_saved(self, out_dir: Path, subdir: str = "") -> None:
        """Register every complete checkpoint already under out_dir (a crashed attempt's included), oldest first."""
        register_saved_checkpoints(out_dir, subdir, self.on_checkpoint)

    def alias(self, alias: str, uri: str) -> str:
        """Point `alias` of model_name at the version of `uri` (models:/name/N); return the version."""
        version = uri.rsplit("/", 1)[1]
        registry.set_alias(self.model_name, alias, version)
        return version

    # Prefect artifacts
    @staticmethod
    def publish_table(key: str, rows: list[dict], description: str) -> None:
        publish_table(key, rows, description)

    @staticmethod
    def publish_markdown(key: str, markdown: str, description: str) -> None:
        publish_markdown(key, markdown, description)
