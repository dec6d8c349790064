"""The sections after training (export, promotion, tracking, registry) and the whole `PipelineConfig`: the
values derived from it, and its cross-field checks (written in `rlhf_core.config.cross_checks`, run here)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.config.base import DEMO, ExpandedPath, Section
from rlhf_core.config.cross_checks import (
    check_eval_columns,
    check_group_family,
    check_init_policy,
    check_init_reference,
    check_launcher,
    check_nonfinite_skipping,
    check_ppo_accumulation,
    check_ppo_mini_batches,
    check_preference_family,
    check_rollout_engine,
    check_token_budget,
    prompts_per_step,
)
from rlhf_core.config.evaluation import EvalConfig, GuardConfig, PromoteConfig, PromotionPlan, promotion_plan
from rlhf_core.config.rewards import GRPOConfig
from rlhf_core.config.rollout import RolloutConfig
from rlhf_core.config.run_model_data import DataConfig, DatasetSpec, ModelConfig, RunConfig
from rlhf_core.config.training import (
    GROUP_ALGORITHMS,
    DPOConfig,
    InitConfig,
    PPOConfig,
    RewardConfig,
    RLConfig,
    SFTConfig,
    reads_grpo_rewards,
)

DEMO_GOLD_METRIC = "rlhf_core.rewards.functions:vader_compound"  # the demo's eval.metrics when it is null
REAL_MICRO_BATCH = 8  # sequences per forward and backward outside the demo, unless set (`real_micro_batches`)


class ExportConfig(Section):
    output_dir: ExpandedPath | None = Field(
        None, strict=False, description="Where the final policy is exported; null means <run.output_dir>/export."
    )
    merge: bool = Field(False, description="With LoRA, also export the adapter merged into the base weights.")
    license: str | None = Field(
        None,
        description="License in the exported model card's metadata (a hub license id such as apache-2.0); null: the base model card's license when it has one.",
    )
    select: Literal["best", "last"] = Field(
        "best",
        description="Which RL checkpoint is exported: 'best' (the highest promotion metric among checkpoints that passed every guard rule) or 'last'.",
    )


class TrackingConfig(Section):
    uri: str | None = Field(
        None, description="MLflow tracking URI; null falls back to MLFLOW_TRACKING_URI, then sqlite:///mlflow.db here."
    )
    experiment: str = Field("rlhf", min_length=1, description="MLflow experiment name.")
    register_models: bool = Field(True, description="Log every checkpoint as a version of a registered model.")
    register_in_background: bool = Field(
        True,
        description="Register checkpoints on a background thread, in step order, while training goes on; the stage waits for them at its end. false: training waits for each registration.",
    )
    log_in_background: bool | None = Field(
        None,
        description="Write each logged step's metrics on a background thread while training goes on. null: on one when the tracking URI is a server (a write waits on the network), inline for a local store (sqlite:, file:, a path: a write is Python work that would hold the GIL beside the rollout's decode loop).",
    )


class RegistryConfig(Section):
    reward_model_name: str = Field(
        "rlhf-reward-model", min_length=1, description="Registered model that holds reward-model versions."
    )
    policy_model_name: str = Field(
        "rlhf-policy", min_length=1, description="Registered model that holds policy versions."
    )
    keep_last_versions: int | None = Field(
        None,
        ge=1,
        description="Versions kept per registered model after each registration: the newest N plus every version with an alias or the tag keep=true; null keeps all.",
    )


class RetrainConfig(Section):
    min_new_pairs: int = Field(
        64,
        ge=1,
        description="Feedback pairs (a `traces:` data.preference source) that must arrive after the last training before `rlhf-feedback-watch` emits the event that starts a retraining (docs/feedback.md).",
    )


class PipelineConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig, description="Run name, output directory, seed and device.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The base policy and its loading options.")
    data: DataConfig = Field(default_factory=DataConfig, description="Datasets, column mapping and length limits.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="The SFT warm start.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward-model training.")
    init: InitConfig = Field(default_factory=InitConfig, description="Policy, reference and value initialization.")
    rl: RLConfig = Field(default_factory=RLConfig, description="The RL stage shared by PPO and GRPO.")
    ppo: PPOConfig = Field(default_factory=PPOConfig, description="PPO hyper-parameters.")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="GRPO hyper-parameters.")
    dpo: DPOConfig = Field(default_factory=DPOConfig, description="DPO and online DPO hyper-parameters.")
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="The engine that samples the RL stage's rollouts."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Periodic generation evaluation.")
    guard: GuardConfig = Field(
        default_factory=GuardConfig,
        description="Rules against over-optimization and collapse, checked at every evaluation.",
    )
    export: ExportConfig = Field(default_factory=ExportConfig, description="Export of the final policy.")
    promote: PromoteConfig = Field(default_factory=PromoteConfig, description="Promotion of the candidate to champion.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    registry: RegistryConfig = Field(default_factory=RegistryConfig, description="Registered model names.")
    retrain: RetrainConfig = Field(default_factory=RetrainConfig, description="When new feedback starts a retraining.")

    @model_validator(mode="after")
    def _cross_checks(self) -> PipelineConfig:
        resolve_demo_defaults(self)
        # in the order they fire: the first failing check's sentence is the one a user sees
        rl, lora = self.rl, self.model.lora.enabled
        check_ppo_mini_batches(rl, self.ppo)
        check_init_reference(self.init, lora)
        check_ppo_accumulation(rl, self.ppo)
        strategy = check_launcher(self.run, lora or self.reward.lora)
        check_group_family(rl, self.grpo, lora, self.run, strategy)
        check_preference_family(rl, self.dpo, lora, strategy, self.rollout)
        check_nonfinite_skipping(self.run, strategy, rl, self.reward)
        check_token_budget(rl, strategy)
        check_rollout_engine(rl, self.grpo, self.rollout, self.run)
        check_init_policy(self.init, self.sft)
        check_eval_columns(self.metric_names(), self.verifier(), self.eval, self.guard)
        return self

    # derived values, computed in one place ---------------------------------------------------

    @property
    def export_dir(self) -> Path:
        return self.export.output_dir or self.run.output_dir / "export"

    def run_label(self) -> str:
        """What tells two configs apart: run.name, the algorithm and the seed (demo-ppo-seed42), the versions' run_label
        tag; the Prefect flow run and the MLflow run take it with the start time after it (two runs, two names)."""
        return f"{self.run.name}-{self.rl.algorithm}-seed{self.run.seed}"

    def metric_names(self) -> list[str]:
        """Eval column names of eval.metrics ('package.module:function' is named 'function'), then the sampled
        evaluation's pass_at_<k> and maj_at_<n>."""
        return [spec.rsplit(":", 1)[-1] for spec in self.eval.metrics] + self.eval.sampled_columns()

    def verifier(self) -> str | None:
        """The eval metric the sampled evaluation counts as correctness: eval.verifier, else the first of eval.metrics."""
        if self.eval.verifier is not None:
            return self.eval.verifier
        return self.eval.metrics[0].rsplit(":", 1)[-1] if self.eval.metrics else None

    def is_demo(self) -> bool:
        """The built-in demo: the policy's base is the demo world's model (model.base 'demo')."""
        return self.model.base == DEMO

    def gold_metric(self) -> str | None:
        """guard.divergence.gold, else the first of eval.metrics (the demo's VADER), else None: the guard's
        divergence rule is then off."""
        names = self.metric_names()
        return self.guard.divergence.gold or (names[0] if names else None)

    def eval_temperature(self) -> float:
        return self.eval.temperature or self.rl.temperature

    def selection_metric(self) -> str:
        """The eval column export.select 'best' ranks checkpoints by: the gold metric (the first of eval.metrics;
        the demo's VADER), else score, the reward model's."""
        names = self.metric_names()
        return names[0] if names else "score"

    def promotion(self, first: bool = False) -> PromotionPlan:
        """promote.*'s evaluator and gates; `first`: there is no champion yet. Outside the demo promotion needs an
        evaluator (or promote.allow_training_reward), else a one-sentence ConfigError."""
        demo_gold = self.eval.metrics[0] if self.is_demo() and self.eval.metrics else None
        return promotion_plan(self.promote, demo_gold=demo_gold, first=first)

    def trains_reward_model(self) -> bool:
        """Whether the reward stage runs: PPO always reads this run's reward model; the GRPO family and online DPO
        only when a grpo.rewards entry names 'reward_stage' (with only reward functions, e.g. RLVR, it is skipped);
        offline DPO never."""
        if not reads_grpo_rewards(self.rl.algorithm):
            return self.rl.algorithm == "ppo"
        return any(r.model == "reward_stage" for r in self.grpo.rewards)

    def data_tables(self) -> list[tuple[str, str, DatasetSpec, str]]:
        """(name, config field, spec, kind) of every table the pipeline reads: preferences when the reward stage
        or offline DPO reads them, the prompts (not for offline DPO, which trains on the pairs), the held-out
        prompts, and the SFT corpus when SFT runs."""
        tables = []
        if self.trains_reward_model() or self.rl.algorithm == "dpo":
            tables += [
                ("preference", "data.preference", self.data.preference, "preference"),
                ("preference_eval", "data.preference_eval", self.data.preference_eval, "preference"),
            ]
        if self.rl.algorithm != "dpo":
            tables.append(("prompts", "data.prompts", self.data.prompts, "prompt"))
        tables.append(("eval_prompts", "data.eval_prompts", self.data.eval_prompts, "prompt"))
        if self.sft.enabled:
            tables.append(("sft", "sft.dataset", self.sft.dataset, "text"))
        return tables

    def prompts_per_step(self) -> tuple[int, str]:
        """(prompts one RL step takes over all processes, the fields that say so): `prompts_per_step`."""
        return prompts_per_step(self.rl, self.grpo, self.run)

    def uses_demo_world(self) -> bool:
        sources = [
            self.model.base,
            self.reward.base,
            self.data.preference.path,
            self.data.preference_eval.path,
            self.data.prompts.path,
            self.data.eval_prompts.path,
        ]
        if self.sft.enabled:
            sources.append(self.sft.dataset.path)
        return DEMO in sources

    def tracking_uri(self) -> str:
        """tracking.uri, else MLFLOW_TRACKING_URI, else a SQLite file in the working directory."""
        if self.tracking.uri:
            return self.tracking.uri
        env = os.environ.get("MLFLOW_TRACKING_URI")
        if env:
            return env
        return f"sqlite:///{Path.cwd() / 'mlflow.db'}"

    def config_hash(self) -> str:
        """Stable short hash of the whole config (JSON with sorted keys)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def resolve_demo_defaults(cfg: PipelineConfig) -> None:
    """The null defaults that depend on whether this is the demo: what suits the demo's reviews (its VADER gold
    metric, SFT on its corpus) is not assumed for a model of the user's own."""
    if cfg.eval.metrics is None:
        cfg.eval.metrics = [DEMO_GOLD_METRIC] if cfg.is_demo() else []
    if cfg.sft.enabled is None:
        cfg.sft.enabled = cfg.is_demo() or cfg.sft.dataset.path != DEMO
    if cfg.init.policy is None:
        cfg.init.policy = "sft" if cfg.sft.enabled else "base"
    if not cfg.is_demo():
        real_micro_batches(cfg)


def real_micro_batches(cfg: PipelineConfig) -> None:
    """Outside the demo, the sections whose micro-batch the user left to its default run micro-batches of
    REAL_MICRO_BATCH sequences (TRL's per_device_train_batch_size) accumulated into the same optimizer step: sft and
    reward with neither batch_size nor gradient_accumulation_steps set, rl without gradient_accumulation_steps (and,
    for the GRPO family, without grpo.steps_per_generation). The demo's tiny model keeps its whole batches."""
    for section in (cfg.sft, cfg.reward):
        if not {"batch_size", "gradient_accumulation_steps"} & section.model_fields_set:
            accumulated = _accumulation(section.batch_size)
            section.batch_size //= accumulated
            section.gradient_accumulation_steps = accumulated
    rl, grpo = cfg.rl, cfg.grpo
    if "gradient_accumulation_steps" in rl.model_fields_set or grpo.steps_per_generation is not None:
        return
    if rl.algorithm == "ppo":
        rl.gradient_accumulation_steps = _accumulation(rl.batch_size // cfg.ppo.num_mini_batches)
    elif rl.algorithm in GROUP_ALGORITHMS:
        rl.gradient_accumulation_steps = _accumulation(grpo.generation_batch(rl.batch_size))
    else:
        rl.gradient_accumulation_steps = _accumulation(rl.batch_size)


def _accumulation(batch: int) -> int:
    """Micro-batches of REAL_MICRO_BATCH in `batch`, when they divide it; else 1 (the batch whole)."""
    return batch // REAL_MICRO_BATCH if batch > REAL_MICRO_BATCH and batch % REAL_MICRO_BATCH == 0 else 1
