"""The `reward` stage (the reward model) as a Prefect task: train with resume, evaluate, register every checkpoint.

Checkpoints live in <output_dir>/reward/<stage key>/checkpoint-N, so a changed config or data set
starts clean while a re-run of the same one resumes (or, when finished, reuses) what is there.
Every checkpoint becomes a version of registry.reward_model_name exactly once, including one that a
crashed attempt saved but did not get to register.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.config import PipelineConfig
from rlhf_core.data.tables import read_rows
from rlhf_core.demo.world import DemoWorld
from rlhf_core.models.loading import generation_config_of, model_tokenizer, prepare_for_training, run_stop_ids
from rlhf_core.rewards.reward_model import PreferencePairs, load_reward_model, train_reward_model
from rlhf_core.storage.checkpoints import list_checkpoints
from rlhf_core.training.loop import Hooks
from tasks import registry, tracking
from tasks.launch import launcher
from tasks.reporting.identity import RegisteredModel, StageIdentity
from tasks.reporting.progress import publish_table
from tasks.reporting.reporter import StageReporter
from tasks.runtime.retry import IO_RETRIES
from tasks.stage_io import Checkpoint, stage_key
from tasks.stages.data import PreparedData, resolve_model_source

CARD_BODY = """\
A reward model trained by the rlhf-pipeline with the Bradley-Terry loss
`-logsigmoid(r_chosen - r_rejected - margin)` on preference pairs, chosen and rejected scored in one
forward pass. It is a sequence classifier with one output: higher means preferred.

Load it with plain transformers:

```python
from transformers import AutoModelForSequenceClassification, AutoTokenizer
model = AutoModelForSequenceClassification.from_pretrained("<this directory>")
tokenizer = AutoTokenizer.from_pretrained("<this directory>")
score = model(**tokenizer(prompt + completion, return_tensors="pt")).logits[0, 0]
```
"""


def reward_identity(cfg: PipelineConfig, policy: Checkpoint | None) -> str:
    """What the reward model starts from, for keys and cards: the policy's version, the base model or reward.base
    as written (nothing is resolved: the launching process computes the stage's key with it too)."""
    if cfg.reward.base != "policy":
        return cfg.reward.base
    if policy is not None:
        return policy.model_uri or f"sft:{policy.key}"
    return cfg.model.base


def reward_base(cfg: PipelineConfig, data: PreparedData, policy: Checkpoint | None) -> str:
    """The local path or hub name the reward model starts from (`reward_identity` names it in keys and cards)."""
    if cfg.reward.base == "policy":
        return policy.path if policy is not None else data.base_model
    world = DemoWorld(Path(data.demo_world)) if data.demo_world else None
    return resolve_model_source(cfg.reward.base, field="reward.base", cfg=cfg, world=world)


TRAINER_VERSION = 3  # bump when training changes what a finished stage would contain (3: pairs end at a stop id)


def policy_stop_ids(cfg: PipelineConfig, data: PreparedData, policy: Checkpoint | None, tokenizer) -> tuple[int, ...]:
    """The ids RL generation will stop on (the policy's generation_config and rl.stop_token[s]): the
    reward model's pairs end on them, so that it is trained where RL reads it."""
    source = policy.path if policy is not None else data.base_model
    return run_stop_ids(tokenizer, generation_config_of(source, trust_remote_code=cfg.model.trust_remote_code), cfg.rl)


def reward_key(cfg: PipelineConfig, data: PreparedData, base_identity: str) -> str:
    return stage_key(
        {
            "trainer_version": TRAINER_VERSION,
            "reward": cfg.reward.model_dump(mode="json"),
            "lora": cfg.model.lora.model_dump() if cfg.reward.lora else None,
            "base": base_identity,
            "data": [data.fingerprints["preference"], data.fingerprints["preference_eval"]],
            "max_length": cfg.data.max_length,
            "seed": cfg.run.seed,
            "mixed_precision": cfg.run.mixed_precision,
        }
    )


def reuse_registered(cfg: PipelineConfig, key: str, out_dir: Path) -> Checkpoint | None:
    """The finished reward model of this stage key from the registry, when this machine has no checkpoint of it.

    A worker without the previous run's output directory (another machine, a wiped disk) then
    downloads the registered final version instead of training the same model again.
    """
    if not cfg.tracking.register_models or list_checkpoints(out_dir):
        return None
    name = cfg.registry.reward_model_name
    version = registry.find_version(name, {"stage": "reward", "stage_key": key, "step": str(cfg.reward.max_steps)})
    if version is None:
        return None
    uri = f"models:/{name}/{version.version}"
    local = registry.materialize_version(uri, Path(out_dir) / "registry")
    metrics = {k: float(version.tags[k]) for k in ("eval_accuracy", "eval_loss") if k in version.tags}
    return Checkpoint(
        path=str(local.resolve()),
        model_uri=uri,
        step=cfg.reward.max_steps,
        metrics=metrics,
        key=key,
        extra={"resumed_from": None, "from_registry": True},
    )


class RewardReporter(StageReporter):
    """The reward stage's reporting: checkpoints tagged with their eval metrics, evaluations as a table."""

    def __init__(self, cfg: PipelineConfig, run_id: str, data: PreparedData, key: str, base_identity: str):
        super().__init__(
            StageIdentity(cfg, "reward", run_id, key, data.fingerprint),
            model=RegisteredModel(
                cfg.registry.reward_model_name, task="text-classification", lineage={"base_model": base_identity}
            ),
            curves={
                "reward/loss": ("reward/loss",),
                "reward/accuracy": ("reward/accuracy",),
                "eval_accuracy": ("eval_accuracy",),
            },
        )
        self.eval_table: list[dict] = []

    def checkpoint_tags(self, path: Path, step: int) -> dict[str, str]:
        metrics = json.loads((path / "metrics.json").read_text())
        return {k: f"{v:.4f}" for k, v in metrics.items() if k in ("eval_accuracy", "eval_loss")}

    def on_eval(self, metrics: dict[str, float], step: int) -> None:
        tracking.logs.log_metrics(self.run_id, metrics, step)
        self.record(metrics, step)
        self.eval_table.append({"step": step, **{k: round(v, 4) for k, v in metrics.items()}})
        self.logger.info("reward eval at step %d: %s", step, ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()))

    def finish(self, result) -> Checkpoint:
        """The progress completed, the eval table and curves published, the final metrics logged; the stage's Checkpoint."""
        self.done()
        if result.resumed_from:
            self.logger.info("reward training resumed from step %d", result.resumed_from)
        if self.eval_table:
            publish_table(
                "reward-eval", self.eval_table, "Reward model on held-out preference pairs, per evaluation step"
            )
        if self.history["reward/loss"]:
            self.plot("reward_curves.png", "Reward model")
        tracking.logs.log_metrics(self.run_id, {f"final/{k}": v for k, v in result.metrics.items()}, result.step)
        return Checkpoint(
            path=str(result.checkpoint.resolve()),
            model_uri=self.version_of(result.step),
            step=result.step,
            metrics=result.metrics,
            key=self.identity.key,
            extra={"resumed_from": result.resumed_from},
        )


def model_card(cfg: PipelineConfig, data: PreparedData, base_identity: str) -> dict:
    return {
        "title": f"Reward model {cfg.registry.reward_model_name}",
        "metadata": {
            "base_model": base_identity,
            "datasets": [data.source("preference")],
            "tags": ["rlhf", "reward-model", "bradley-terry", "rlhf-pipeline"],
            "library_name": "transformers",
            "pipeline_tag": "text-classification",
        },
        "body": CARD_BODY,
    }


def reuse_and_say(cfg: PipelineConfig, key: str, out_dir: Path, reporter) -> Checkpoint | None:
    """`reuse_registered`, said in the stage's log and tagged on its run when it reuses."""
    reused = reuse_registered(cfg, key, out_dir)
    if reused is not None:
        reporter.logger.info(
            "reward model for stage key %s is already registered as %s: reused, not retrained", key, reused.model_uri
        )
        reporter.tag({"rlhf.reused": reused.model_uri})
    return reused


@task(name="reward", cache_policy=NO_CACHE, **IO_RETRIES)
def reward_stage(cfg: PipelineConfig, data: PreparedData, policy: Checkpoint | None, parent_run_id: str) -> Checkpoint:
    """Train (or resume, or reuse) the reward model and register each checkpoint as a model version."""
    base_identity = reward_identity(cfg, policy)
    key = reward_key(cfg, data, base_identity)
    out_dir = cfg.run.output_dir / "reward" / key
    if cfg.run.num_processes > 1 and not launcher.launched():
        return launcher.launch(
            "reward", worker_body, cfg, out_dir, data=data, policy=policy, parent_run_id=parent_run_id
        )
    base = reward_base(cfg, data, policy)
    with (
        tracking.runs.stage_run(parent_run_id, "reward", tracking.runs.stage_params(cfg, "reward")) as run_id,
        RewardReporter(cfg, run_id, data, key, base_identity) as reporter,
    ):
        if (reused := reuse_and_say(cfg, key, out_dir, reporter)) is not None:
            return reused
        tracking.logs.log_datasets(run_id, data.inputs_for("preference", "preference_eval"))
        tokenizer = model_tokenizer(cfg.model, base)
        model = load_reward_model(
            base,
            tokenizer,
            lora=cfg.model.lora if cfg.reward.lora else None,
            torch_dtype=cfg.model.torch_dtype,
            trust_remote_code=cfg.model.trust_remote_code,
            revision=cfg.model.revision,
            seed=cfg.run.seed,
        )
        prepare_for_training(model, gradient_checkpointing=cfg.model.checkpointing)
        train_rows, eval_rows = read_rows(data.tables["preference"]), read_rows(data.tables["preference_eval"])
        reporter.register_saved(out_dir)
        reporter.start(cfg.reward.max_steps, f"Reward model: {cfg.reward.max_steps} steps")
        result = train_reward_model(
            model,
            tokenizer,
            PreferencePairs(
                train_rows, eval_rows, cfg.data.max_length, stop_ids=policy_stop_ids(cfg, data, policy, tokenizer)
            ),
            cfg.reward,
            cfg.run,
            output_dir=out_dir,
            card=model_card(cfg, data, base_identity),
            hooks=Hooks(on_log=reporter.log, on_eval=reporter.on_eval, on_checkpoint=reporter.on_checkpoint),
        )
        return reporter.finish(result)


def worker_body(cfg: PipelineConfig, inputs: dict) -> Checkpoint:
    """`reward_stage`'s body in one of the processes `launcher.launch` started (`inputs` as JSON)."""
    policy = Checkpoint(**inputs["policy"]) if inputs.get("policy") else None
    return reward_stage.fn(cfg, PreparedData(**inputs["data"]), policy, inputs["parent_run_id"])
