"""One stage's reporting, shared by every stage task: metrics, curves, registered versions, Prefect artifacts.

A `StageReporter` is made inside the stage's MLflow run. Its bound methods are the callbacks the
rlhf_core loops take (`log` as on_log, `on_checkpoint` as on_checkpoint): a stage task is then a short
sequence of calls. What a stage reports beyond that is a subclass with its own `on_eval` (`RewardReporter`
beside the reward task in tasks/stages/reward_model.py, `PolicyReporter` in tasks/stages/rl_reporting.py) or a few
functions beside the task (tasks/stages/data.py, tasks/stages/export.py). Every MLflow write goes through
tasks/tracking/logs.py and tasks/registry.py, which skip it on the processes of a data-parallel stage
other than rank 0.

Tracking is off the training path. `log` hands the progress artifact's update, and the step's metrics
when the store is a server (tracking.log_in_background), to a writer thread and training goes on (a local
store's write is Python work: on a thread of its own it would hold the GIL beside the rollout's decode
loop, and costs more there than inline); `on_checkpoint` reads the checkpoint's tags and hands its
registration to a second thread, in step order, which first waits for the metrics logged before it (a
logged model carries its step's metrics). Both are tasks/reporting/background.py's `BackgroundJobs`. The reporter
is a context manager: when the stage ends it waits for both (a failure fails the stage); when the stage
fails, the metrics still go out, the registrations not started are dropped, the running one finishes,
and the next run registers what is left (`register_saved`).
"""

from __future__ import annotations

from concurrent.futures import Future
from functools import partial
from pathlib import Path

from rlhf_core.config import PipelineConfig
from tasks import registry, tracking
from tasks.launch.launcher import stage_logger
from tasks.reporting.background import BackgroundJobs
from tasks.reporting.plots import close, curve_figure
from tasks.reporting.progress import StageProgress, publish_markdown, publish_table
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
        self.registered: dict[int, str] = {}  # filled by the registration thread: read it through `version_of`
        self.writes = BackgroundJobs(f"{stage}-tracking")  # progress, and metrics when metrics_in_background
        in_background = cfg.tracking.log_in_background
        self.metrics_in_background = (
            not tracking.store.is_local_store(cfg.tracking_uri()) if in_background is None else in_background
        )
        self.registrations = BackgroundJobs(f"{stage}-registration")
        self.step_metrics: dict[int, dict[str, float]] = {}  # what `record` saw per step (a version's own step)
        self.logger = stage_logger()
        self.progress: StageProgress | None = None
        self.total_steps = 0

    def __enter__(self) -> StageReporter:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        try:
            if error is None:
                self.writes.wait()
                self.wait_registrations()
            else:
                self.flush_quietly()  # the metrics up to a failure are what explains it
                self.registrations.cancel()
        finally:
            self.writes.close()
            self.registrations.close()

    def flush_quietly(self) -> None:
        """Wait for the metrics handed to the writer; a failure of theirs is logged, not raised (the stage
        is failing already with its own error)."""
        try:
            self.writes.wait()
        except Exception as err:  # noqa: BLE001 (the stage's own error is the one to raise)
            self.logger.warning("%s metrics not all logged: %s", self.stage, err)

    # metrics and curves
    def start(self, total_steps: int, description: str, key: str | None = None) -> None:
        """The Prefect progress artifact `<stage>-progress` (or `key`); with total_steps, `log` moves it and `done`
        completes it, else `advance` does."""
        self.total_steps = total_steps
        self.progress = StageProgress(key or f"{self.stage}-progress", description)
        if self.model_name and self.cfg.tracking.register_models and tracking.store.writes():
            # the first registration's one-time costs, paid on the registration thread while the stage trains
            self.registrations.submit(registry.warm_up, "the registry's warm-up")

    def advance(self, done: int, total: int, *_) -> None:
        """Move the progress artifact to done of total, on the writer thread (a progress callback: extra
        arguments are ignored)."""
        if self.progress is not None:
            self.writes.submit(partial(self.progress.update, done, total), f"the {self.stage} progress")

    def record(self, metrics: dict[str, float], step: int) -> None:
        """Add the curves' points found in `metrics`, and keep them as the metrics of `step` (see `eval_tags`)."""
        self.step_metrics.setdefault(step, {}).update(metrics)
        for name, keys in self.sources.items():
            key = next((k for k in keys if k in metrics), None)
            if key is not None:
                self.history[name].append((step, metrics[key]))

    def log(self, metrics: dict[str, float], step: int) -> None:
        """on_log: the metrics to MLflow at `step` (on the writer thread when metrics_in_background), their curve
        points kept, the progress artifact moved (on the writer thread)."""
        metrics = dict(metrics)
        if self.metrics_in_background:
            self.writes.submit(
                partial(tracking.logs.log_metrics, self.run_id, metrics, step), f"the {self.stage} metrics"
            )
        else:
            tracking.logs.log_metrics(self.run_id, metrics, step)
        self.record(metrics, step)
        if self.total_steps:
            self.advance(step, self.total_steps)

    def done(self) -> None:
        self.advance(self.total_steps, self.total_steps)

    def plot(self, artifact_file: str, title: str, history: dict[str, list[tuple[int, float]]] | None = None) -> None:
        """The curves (or `history`) as a PNG artifact of the stage run."""
        fig = curve_figure(self.history if history is None else history, title)
        tracking.logs.log_figure(self.run_id, fig, artifact_file)
        close(fig)

    def tag(self, tags: dict[str, str]) -> None:
        tracking.logs.set_run_tags(self.run_id, tags)

    def artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        tracking.logs.log_artifact(self.run_id, path, artifact_path)

    # the registry
    def eval_tags(self, step: int) -> dict[str, str]:
        """The numbers of `step`'s held-out evaluation a person filters versions on (gold, proxy score, exact
        eval KL) as version tags `eval_<name>`; the whole evaluation is the logged model's metrics."""
        metrics = self.step_metrics.get(step, {})
        keys = (f"eval/{self.cfg.gold_metric()}_mean", "eval/score_mean", "eval/kl_exact_mean")
        return {k.replace("/", "_"): f"{metrics[k]:.4f}" for k in keys if k in metrics}

    def lineage_tags(self, step: int, **tags) -> dict[str, str]:
        """A version's tags: the stage's lineage, the evaluation of its own step (`eval_tags`) and `tags`."""
        return registry.lineage_tags(
            stage=self.stage,
            step=step,
            config_hash=self.cfg.config_hash(),
            data_fingerprint=self.data_fingerprint,
            **self.lineage,
            **{**self.eval_tags(step), **tags},
        )

    def register(self, path: str | Path, step: int, **tags) -> str | None:
        """Register the checkpoint at `path` once, now, as a version of model_name with `lineage_tags`. The
        logged model carries the stage run's metrics of that step (tasks/registry.py).

        None when registration is off (tracking.register_models: false); "" on ranks other than 0.
        """
        if not self.cfg.tracking.register_models:
            return None
        self.writes.wait()  # the version carries its step's metrics
        return self._register(Path(path), step, self.lineage_tags(step, **tags))

    def _register(self, path: Path, step: int, tags: dict[str, str], input_example: bool = True) -> str:
        self.registered[step] = registry.register_once(
            path,
            self.model_name,
            task=self.task,
            tags=tags,
            run_id=self.run_id,
            keep_last=self.cfg.registry.keep_last_versions,
            input_example=input_example,
        )
        if self.registered[step]:
            self.logger.info("%s checkpoint %d is %s", self.stage, step, self.registered[step])
        return self.registered[step]

    def checkpoint_tags(self, path: Path, step: int) -> dict[str, str]:
        """The tags of one checkpoint beyond the stage's lineage (read from its metrics.json in subclasses)."""
        return {}

    def on_checkpoint(self, path: Path, step: int) -> Future | None:
        """on_checkpoint: register a saved checkpoint, with the tags it has now, in the background
        (tracking.register_in_background; else before training goes on). The Future completes once the
        version exists; it raises an earlier registration's failure. A version registered in the background
        has its signature but no input example (registry.INPUT_EXAMPLE says why)."""
        if not self.cfg.tracking.register_models:
            return None
        tags = self.lineage_tags(step, **self.checkpoint_tags(path, step))
        if not self.cfg.tracking.register_in_background:
            self.writes.wait()
            self._register(path, step, tags)
            return None
        logged = self.writes.submitted()  # the metrics logged so far go out before the version is made
        return self.registrations.submit(
            partial(self._register_after, logged, path, step, tags),
            f"the registration of {self.stage} checkpoint {step}",
        )

    def _register_after(self, logged: list[Future], path: Path, step: int, tags: dict[str, str]) -> str:
        BackgroundJobs.wait_for(logged)
        return self._register(path, step, tags, input_example=False)

    def wait_registrations(self) -> None:
        """Block until every checkpoint handed to the background is registered; raise the first failure."""
        if self.registrations.pending:
            self.logger.info("waiting for %d %s checkpoint registration(s)", self.registrations.pending, self.stage)
        self.registrations.wait()

    def version_of(self, step: int) -> str | None:
        """The registered version (models:/ URI) of the checkpoint of `step`, once registrations are done."""
        self.wait_registrations()
        return self.registered.get(step)

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
