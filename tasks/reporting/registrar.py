"""A stage's checkpoints as versions of its registered model, registered off the training path.

`on_checkpoint` reads a checkpoint's tags now and hands its registration to a thread of its own
(tasks/reporting/background.py), in step order; each registration first waits for the metrics the stage
logged before it (a logged model carries its step's metrics). Every registry call goes through
tasks/registry, which skips it on the processes of a data-parallel stage other than rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path

from tasks import registry, tracking
from tasks.reporting.background import BackgroundJobs
from tasks.reporting.identity import RegisteredModel, StageIdentity
from tasks.reporting.metrics import MetricsWriter
from tasks.stage_io import register_saved_checkpoints

CheckpointTags = Callable[[Path, int], dict[str, str]]


def no_checkpoint_tags(path: Path, step: int) -> dict[str, str]:
    return {}


def model_description(cfg, model: RegisteredModel) -> str:
    """The registered model's description: what its versions are, the tags to filter them on, the aliases."""
    runs = f"`{cfg.run.name}-<algorithm>-seed<seed>` (e.g. `{cfg.run_label()}`)"
    common = (
        "\n\nFilter versions on their tags `stage`, `step`, `run_label` and lineage (`data_fingerprint`, "
        "`base_model`); each version's description says what it is, with its config hash and code version."
    )
    if model.task == "text-classification":
        return (
            f"The reward models of the RLHF pipeline's runs named {runs}: Bradley-Terry models trained on "
            "preference pairs, which score a prompt and its completion. Every reward checkpoint is a version "
            "(`stage=reward`, with its held-out `eval_accuracy` and `eval_loss`); a run's RL stage scores with its "
            f"last one, which the policy versions name in their tag `reward_model_version`.{common} Serve one with "
            f"`mlflow models serve -m models:/{model.name}/<version>`: prompts and completions in, scores out."
        )
    return (
        f"The policies of the RLHF pipeline's runs named {runs}. Every checkpoint is a version: the SFT warm "
        "start (`stage=sft`), each RL checkpoint (`stage=ppo`, `grpo`, ..., with its held-out gold metric and the "
        "guard's verdict `guard.passed`) and the exported policy (`stage=export`)."
        f"{common}\n\nThe alias `candidate` points at the latest export; `champion` at the candidate promotion "
        f'last accepted (`rlhf promote`). Load one with `mlflow.transformers.load_model("models:/{model.name}'
        '@candidate")`.'
    )


class Registrar:
    """Registers one stage's checkpoints as versions of `model` with their lineage tags, once each, and gives the
    model its description (`model_description`) when it has none.

    writer: the stage's metrics (a version waits for those of its step and is tagged with their evaluation).
    checkpoint_tags(path, step): a checkpoint's own tags beyond the lineage, read when it is handed over.
    """

    def __init__(
        self,
        identity: StageIdentity,
        model: RegisteredModel | None,
        writer: MetricsWriter,
        checkpoint_tags: CheckpointTags = no_checkpoint_tags,
    ):
        self.identity, self.model, self.writer, self.checkpoint_tags = identity, model, writer, checkpoint_tags
        self.logger = writer.logger
        self.registered: dict[int, str] = {}  # filled by the registration thread: read it through `version_of`
        self.described = False  # the registered model's description (registry.describe_model) is set
        self.jobs = BackgroundJobs(f"{identity.stage}-registration")

    @property
    def enabled(self) -> bool:
        return self.identity.cfg.tracking.register_models

    def warm_up(self) -> None:
        """The first registration's one-time costs, paid on the registration thread while the stage trains."""
        if self.model and self.enabled and tracking.store.writes():
            self.jobs.submit(registry.warm_up, "the registry's warm-up")

    def eval_tags(self, step: int) -> dict[str, str]:
        """The numbers of `step`'s held-out evaluation a version records as `eval_<name>`: the gold metric (a tag to
        filter on), the proxy score and the exact eval KL (its description, registry.DESCRIBED); the whole
        evaluation is the logged model's metrics."""
        metrics = self.writer.step_metrics.get(step, {})
        keys = (f"eval/{self.identity.cfg.gold_metric()}_mean", "eval/score_mean", "eval/kl_exact_mean")
        return {k.replace("/", "_"): f"{metrics[k]:.4f}" for k in keys if k in metrics}

    def lineage_tags(self, step: int, **tags) -> dict[str, str]:
        """What a version records (registry.version_tags: its tags; the rest its description): the stage's
        lineage and run label, the evaluation of its own step (`eval_tags`) and `tags`."""
        stage_key = {"stage_key": self.identity.key} if self.identity.key is not None else {}
        return registry.lineage_tags(
            stage=self.identity.stage,
            step=step,
            config_hash=self.identity.cfg.config_hash(),
            data_fingerprint=self.identity.data_fingerprint,
            run_label=self.identity.cfg.run_label(),
            **stage_key,
            **(self.model.lineage if self.model else {}),
            **{**self.eval_tags(step), **tags},
        )

    def register(self, path: str | Path, step: int, **tags) -> str | None:
        """Register the checkpoint at `path` once, now, with `lineage_tags`; the logged model carries the stage
        run's metrics of that step. None when registration is off; "" on ranks other than 0."""
        if not self.enabled:
            return None
        self.writer.wait()  # the version carries its step's metrics
        return self._register(Path(path), step, self.lineage_tags(step, **tags))

    def on_checkpoint(self, path: Path, step: int) -> Future | None:
        """Register a saved checkpoint, with the tags it has now, in the background (tracking.register_in_background;
        else before training goes on). The Future completes once the version exists; it raises an earlier
        registration's failure. A version registered in the background has no input example
        (registry.INPUT_EXAMPLE says why)."""
        if not self.enabled:
            return None
        tags = self.lineage_tags(step, **self.checkpoint_tags(path, step))
        if not self.identity.cfg.tracking.register_in_background:
            self.writer.wait()
            self._register(path, step, tags)
            return None
        logged = self.writer.submitted()  # the metrics logged so far go out before the version is made
        return self.jobs.submit(
            partial(self._register_after, logged, path, step, tags),
            f"the registration of {self.identity.stage} checkpoint {step}",
        )

    def register_saved(self, out_dir: Path, subdir: str = "") -> None:
        """Hand over every complete checkpoint already under out_dir (a crashed attempt's included), oldest first."""
        register_saved_checkpoints(out_dir, subdir, self.on_checkpoint)

    def wait(self) -> None:
        """Block until every checkpoint handed to the background is registered; raise the first failure."""
        if self.jobs.pending:
            self.logger.info("waiting for %d %s checkpoint registration(s)", self.jobs.pending, self.identity.stage)
        self.jobs.wait()

    def version_of(self, step: int) -> str | None:
        """The registered version (models:/ URI) of the checkpoint of `step`, once registrations are done."""
        self.wait()
        return self.registered.get(step)

    def alias(self, alias: str, uri: str) -> str:
        """Point `alias` of the model at the version of `uri` (models:/name/N); return the version."""
        version = uri.rsplit("/", 1)[1]
        registry.set_alias(self.model.name, alias, version)
        return version

    def cancel(self) -> None:
        """Drop the registrations not started; the running one finishes (the next run registers the rest)."""
        self.jobs.cancel()

    def close(self) -> None:
        self.jobs.close()

    def _register_after(self, logged: list[Future], path: Path, step: int, tags: dict[str, str]) -> str:
        BackgroundJobs.wait_for(logged)
        return self._register(path, step, tags, input_example=False)

    def _register(self, path: Path, step: int, tags: dict[str, str], input_example: bool = True) -> str:
        self.registered[step] = registry.register_once(
            path,
            self.model.name,
            task=self.model.task,
            tags=tags,
            run_id=self.identity.run_id,
            keep_last=self.identity.cfg.registry.keep_last_versions,
            input_example=input_example,
        )
        if self.registered[step]:
            self.logger.info("%s checkpoint %d is %s", self.identity.stage, step, self.registered[step])
            if not self.described:  # once per stage: the model exists now
                registry.describe_model(self.model.name, model_description(self.identity.cfg, self.model))
                self.described = True
        return self.registered[step]
