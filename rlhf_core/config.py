"""The pipeline configuration: strict pydantic models, one section per stage.

Every field carries a one-line description; defaults follow TRL where TRL has one. A config is read
from YAML, patched with ``--set a.b=value`` overrides, and validated before any work starts; a bad
one raises :class:`ConfigError` with one sentence that names the field and what it accepts.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlhf_core.config_errors import describe_error, nested_section

DEMO = "demo"  # the reserved source name for the built-in offline demo world


class ConfigError(ValueError):
    """A configuration a user wrote that cannot run; the message is one sentence."""


class Section(BaseModel):
    # strict: an int field refuses `true` and `2.5` (a float field still takes `1`); Path fields opt out
    # with Field(strict=False) so that YAML strings become paths
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


# --------------------------------------------------------------------------------------------
# run, model, data
# --------------------------------------------------------------------------------------------


class RunConfig(Section):
    name: str = Field("rlhf", min_length=1, description="Name of the pipeline run, used for the MLflow run and Prefect artifacts.")
    output_dir: Path = Field(Path("outputs/rlhf"), strict=False, description="Directory for the demo world, checkpoints and exports of this run.")
    seed: int = Field(42, ge=0, description="Seed for data generation, model initialization, shuffling and sampling.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where training runs: auto picks CUDA when available.")
    mixed_precision: Literal["no", "fp16", "bf16"] = Field("no", description="Accelerate mixed precision for training loops.")
    num_processes: int = Field(
        1, ge=1, description="Data-parallel processes for the reward, PPO and GRPO stages; >1 launches torchrun (CPU, gloo) or accelerate launch (CUDA).")
    accelerate_config: Path | None = Field(None, strict=False, description="accelerate launch config file (DeepSpeed, FSDP) for num_processes > 1 on CUDA.")
    keep_last_checkpoints: int | None = Field(
        None, ge=1, description="Local checkpoints kept per reward, PPO and GRPO stage: the newest N plus the best (reward: highest eval_accuracy; PPO: highest objective/scores, GRPO: highest reward, both the training metrics of the checkpoint's step); null keeps all.")


class DemoModelConfig(Section):
    hidden_size: int = Field(128, ge=8, description="Hidden size of the demo's tiny Llama.")
    num_hidden_layers: int = Field(2, ge=1, description="Number of transformer layers of the demo's tiny Llama.")
    num_attention_heads: int = Field(4, ge=1, description="Attention heads of the demo's tiny Llama.")
    intermediate_size: int = Field(256, ge=8, description="MLP width of the demo's tiny Llama.")
    max_position_embeddings: int = Field(128, ge=16, description="Longest sequence the demo's tiny Llama accepts.")

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> DemoModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be divisible by num_attention_heads {self.num_attention_heads}"
            )
        return self


class LoraSettings(Section):
    enabled: bool = Field(False, description="Train LoRA adapters through PEFT instead of all weights.")
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: int = Field(16, ge=1, description="LoRA scaling numerator (lora_alpha).")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA branch.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], min_length=1, description="Module names that get adapters."
    )


class ModelConfig(Section):
    base: str = Field(DEMO, min_length=1, description="Base policy: 'demo' (built offline), a local directory, a hub name or a models:/ URI.")
    tokenizer: str | None = Field(None, description="Tokenizer source when it differs from `base`; defaults to the base's own.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) for hub names.")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub to run; only for sources you trust.")
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("float32", description="Dtype the weights are loaded in.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="LoRA adapter settings shared by the trained models.")
    demo: DemoModelConfig = Field(default_factory=DemoModelConfig, description="Architecture of the demo's tiny Llama (used when base is 'demo').")


class ColumnMap(Section):
    prompt: str = Field("prompt", min_length=1, description="Source column holding the prompt.")
    chosen: str = Field("chosen", min_length=1, description="Source column holding the preferred completion.")
    rejected: str = Field("rejected", min_length=1, description="Source column holding the dispreferred completion.")
    margin: str | None = Field(None, description="Optional source column with a per-pair Bradley-Terry margin.")
    text: str = Field("text", min_length=1, description="Source column holding plain text (SFT corpora).")


class DatasetSpec(Section):
    path: str = Field(DEMO, min_length=1, description="'demo', a local json/jsonl/parquet/csv file, directory or glob (data/prefs/*.jsonl), or a hub dataset name.")
    split: str = Field("train", min_length=1, description="Split to read (local files are one 'train' split).")
    columns: ColumnMap = Field(default_factory=ColumnMap, description="Mapping from the pipeline's column names to the source's.")
    limit: int | None = Field(None, ge=1, description="Read at most this many rows, in file order.")

    @model_validator(mode="after")
    def _demo_splits(self) -> DatasetSpec:
        if self.path == DEMO and self.split not in ("train", "test"):
            raise ValueError(f"split '{self.split}' does not exist in the demo world; allowed values are 'train' or 'test'")
        return self


class DemoWorldConfig(Section):
    num_sentences: int = Field(6000, ge=10, description="Sentences in the demo's review corpus (SFT data).")
    num_preference_pairs: int = Field(3000, ge=10, description="Preference pairs labelled by VADER (train split).")
    num_eval_preference_pairs: int = Field(400, ge=2, description="Held-out preference pairs (reward-model evaluation).")
    num_train_prompts: int = Field(1024, ge=2, description="Prompts for RL training.")
    num_eval_prompts: int = Field(64, ge=2, description="Held-out prompts for generation evaluation.")
    min_compound_gap: float = Field(0.3, gt=0.0, le=2.0, description="Least VADER compound difference between chosen and rejected.")


class DataConfig(Section):
    preference: DatasetSpec = Field(default_factory=DatasetSpec, description="Preference pairs for reward-model training.")
    preference_eval: DatasetSpec = Field(
        default_factory=lambda: DatasetSpec(split="test"), description="Held-out preference pairs for reward-model evaluation."
    )
    prompts: DatasetSpec = Field(default_factory=DatasetSpec, description="Prompts for RL rollouts.")
    eval_prompts: DatasetSpec = Field(
        default_factory=lambda: DatasetSpec(split="test"), description="Held-out prompts for generation evaluation."
    )
    max_length: int = Field(64, ge=4, description="Longest prompt+completion in tokens; longer rows are handled by `overlong`.")
    max_prompt_length: int = Field(16, ge=1, description="Longest prompt in tokens for RL and evaluation prompts.")
    overlong: Literal["truncate", "drop"] = Field("truncate", description="What to do with rows longer than the limits.")
    demo: DemoWorldConfig = Field(default_factory=DemoWorldConfig, description="Sizes of the offline demo world (used by 'demo' sources).")

    @model_validator(mode="after")
    def _prompt_fits(self) -> DataConfig:
        if self.max_prompt_length >= self.max_length:
            raise ValueError(f"max_prompt_length {self.max_prompt_length} must be below max_length {self.max_length}")
        return self


# --------------------------------------------------------------------------------------------
# training stages
# --------------------------------------------------------------------------------------------


class OptimSettings(Section):
    learning_rate: float = Field(1e-4, gt=0.0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps before the schedule.")
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field("linear", description="Learning-rate schedule after warm-up.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")


class SFTConfig(OptimSettings):
    enabled: bool = Field(True, description="Run the SFT warm start; with false the policy starts from model.base.")
    dataset: DatasetSpec = Field(default_factory=DatasetSpec, description="Text corpus to fine-tune on ('demo': the review corpus).")
    max_steps: int = Field(300, ge=1, description="Optimizer steps of the warm start.")
    batch_size: int = Field(32, ge=1, description="Sequences per micro-batch.")
    learning_rate: float = Field(3e-3, gt=0.0, description="Peak AdamW learning rate.")
    log_steps: int = Field(10, ge=1, description="Log the loss every this many steps.")


class RewardConfig(OptimSettings):
    base: str = Field("policy", min_length=1, description="Reward model start: 'policy' (the SFT/base policy), a directory, hub name or models:/ URI.")
    max_steps: int = Field(200, ge=1, description="Optimizer steps of reward training.")
    batch_size: int = Field(32, ge=1, description="Preference pairs per micro-batch (chosen and rejected share one forward).")
    learning_rate: float = Field(1e-3, gt=0.0, description="Peak AdamW learning rate.")
    center_rewards_coefficient: float | None = Field(None, gt=0.0, description="Weight of the reward-centering penalty (TRL's); null turns it off.")
    eval_steps: int = Field(50, ge=1, description="Evaluate on the held-out pairs every this many steps.")
    save_steps: int = Field(100, ge=1, description="Checkpoint and register a version every this many steps.")
    log_steps: int = Field(10, ge=1, description="Log training metrics every this many steps.")
    lora: bool = Field(False, description="Train the reward model with LoRA (model.lora settings, score head trainable).")
    disable_dropout: bool = Field(True, description="Turn every dropout of the reward model off while it trains (TRL's default); false keeps the model's own.")


class InitConfig(Section):
    policy: Literal["sft", "base", "champion"] = Field(
        "sft", description="Policy start: the SFT warm start's output, model.base as is, or the registry's champion (sft, else base, when there is none).")
    value_from: Literal["reward", "policy"] = Field("reward", description="Value model start: the reward model's weights (as TRL) or the policy's.")
    reference: Literal["auto", "copy", "adapter_disabled"] = Field(
        "auto", description="Reference model: a frozen copy, or with LoRA the policy with adapters off; auto picks by LoRA."
    )


class RLConfig(OptimSettings):
    algorithm: Literal["ppo", "grpo"] = Field("ppo", description="RL algorithm of the policy stage.")
    total_steps: int = Field(100, ge=1, description="Policy optimization iterations (one rollout batch each).")
    batch_size: int = Field(32, ge=1, description="Prompts per rollout batch.")
    learning_rate: float = Field(3e-6, gt=0.0, description="Peak AdamW learning rate (TRL's default).")
    response_length: int = Field(16, ge=1, description="Most new tokens per rollout.")
    temperature: float = Field(0.7, gt=0.0, description="Sampling temperature of rollouts (TRL's default).")
    top_k: int = Field(0, ge=0, description="Top-k filtering of rollouts; 0 disables it.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus filtering of rollouts; 1.0 disables it.")
    stop_token: str = Field(
        "eos", min_length=1, description="What ends a response: 'eos' (every id of the policy's generation_config.eos_token_id and the tokenizer's eos), 'none', or one token of the tokenizer.")
    stop_tokens: list[str] = Field(
        default_factory=list, description="More tokens that end a response (e.g. '<|im_end|>'), each one token of the policy's tokenizer.")
    min_response_length: int = Field(1, ge=1, description="The stop token cannot end a response before this many tokens (transformers' min_new_tokens).")
    missing_eos_penalty: float | None = Field(None, description="Subtract this from the score of responses that never emit eos.")
    save_steps: int = Field(50, ge=1, description="Checkpoint and register a policy version every this many steps.")
    log_steps: int = Field(1, ge=1, description="Log training metrics every this many steps.")
    disable_dropout: bool = Field(True, description="Turn every dropout (LoRA's and attention's included) off in the trained policy and value models (TRL's default; frozen models run in eval mode anyway); false keeps them.")
    skip_nonfinite_steps: bool = Field(
        True, description="Skip an optimizer step whose gradient norm is NaN or inf and count it; false stops the run there. DeepSpeed needs false.")

    @model_validator(mode="after")
    def _min_within_max(self) -> RLConfig:
        if self.min_response_length > self.response_length:
            raise ValueError(f"min_response_length {self.min_response_length} must not exceed response_length {self.response_length}")
        if self.missing_eos_penalty is not None and self.stop_token == "none" and not self.stop_tokens:
            raise ValueError("missing_eos_penalty needs a stop token, but stop_token is 'none' and stop_tokens is empty, "
                             "so every response would be penalized")
        return self


class PPOConfig(Section):
    kl_coef: float = Field(0.05, ge=0.0, description="Initial coefficient of the per-token KL penalty (TRL's default).")
    kl_estimator: Literal["k1", "k3"] = Field("k1", description="KL estimator of the penalty: k1 (log ratio) or k3 (unbiased, positive).")
    adaptive_kl: bool = Field(False, description="Adapt kl_coef toward target_kl (Ziegler et al.) instead of keeping it fixed.")
    target_kl: float = Field(6.0, gt=0.0, description="KL the adaptive controller steers toward.")
    horizon: int = Field(10000, ge=1, description="Horizon of the adaptive KL controller.")
    cliprange: float = Field(0.2, gt=0.0, description="Clip range of the policy ratio.")
    vf_coef: float = Field(0.1, ge=0.0, description="Weight of the value loss.")
    cliprange_value: float = Field(0.2, gt=0.0, description="Clip range of the value prediction.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount factor of GAE.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="Lambda of GAE.")
    num_ppo_epochs: int = Field(4, ge=1, description="Passes over each rollout batch.")
    num_mini_batches: int = Field(1, ge=1, description="Mini-batches per PPO epoch.")
    whiten_rewards: bool = Field(False, description="Whiten the KL-penalized rewards before GAE.")
    whiten_advantages: bool = Field(True, description="Whiten advantages before the policy loss.")


class RewardSource(Section):
    name: str = Field(..., min_length=1, description="Name of this reward in metrics (rewards/<name>/mean).")
    model: str | None = Field(None, description="A reward model: 'reward_stage' (this run's), a directory, hub name or models:/ URI.")
    function: str | None = Field(None, description="A Python reward function as 'package.module:function'.")
    weight: float = Field(1.0, description="Weight of this reward in the sum.")

    @model_validator(mode="after")
    def _one_kind(self) -> RewardSource:
        if (self.model is None) == (self.function is None):
            raise ValueError(f"reward '{self.name}' must set exactly one of model or function")
        if self.function is not None and ":" not in self.function:
            raise ValueError(f"function '{self.function}' must be written 'package.module:function'")
        return self


def _default_grpo_rewards() -> list[RewardSource]:
    return [RewardSource(name="reward_model", model="reward_stage")]


class GRPOConfig(Section):
    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (the group).")
    epsilon: float = Field(0.2, gt=0.0, description="Lower clip of the importance ratio.")
    epsilon_high: float | None = Field(
        None, gt=0.0, description="Upper clip of the ratio; null uses epsilon. With loss_type cispo: the cap of the ratio (TRL recommends 5.0).")
    delta: float | None = Field(
        None, gt=1.0, description="Two-sided clipping (INTELLECT-2): cap the unclipped ratio at delta; null is off. Should exceed 1 + epsilon_high.")
    beta: float = Field(0.0, ge=0.0, description="KL coefficient to the reference (k3); 0 loads no reference (TRL's default).")
    use_bias_correction_kl: bool = Field(True, description="Multiply the k3 KL term by the importance ratio (TRL 1.16's default).")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"] = Field(
        "dapo", description="Loss: grpo, bnpo, dr_grpo, dapo (TRL's default), cispo (clipped-IS-weight policy gradient) or sapo (soft gate).")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Importance ratio per token, or one per sequence from the mean log ratio (GSPO).")
    sapo_temperature_pos: float = Field(1.0, gt=0.0, description="SAPO's gate temperature for tokens with positive advantage.")
    sapo_temperature_neg: float = Field(1.05, gt=0.0, description="SAPO's gate temperature for tokens with non-positive advantage.")
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="Divide advantages by the group's, the batch's or no std.")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="Weighted sum of rewards then group-normalize, or normalize each reward per group, sum, then batch-normalize.")
    top_entropy_quantile: float = Field(
        1.0, gt=0.0, le=1.0, description="Train only on the tokens whose entropy is in this top fraction of the batch's; 1.0 trains on all.")
    num_iterations: int = Field(1, ge=1, description="Updates per generation batch, reusing stored old log-probabilities.")
    steps_per_generation: int | None = Field(
        None, ge=1, description="Micro-batches each generation batch feeds (TRL's name); a multiple of rl.gradient_accumulation_steps; null: one optimizer step per generation.")
    mask_truncated_completions: bool = Field(False, description="Leave completions without a stop token out of the loss.")
    sync_ref_model: bool = Field(False, description="Mix the policy into the reference every ref_model_sync_steps optimizer steps (TR-DPO).")
    ref_model_mixup_alpha: float = Field(0.6, ge=0.0, le=1.0, description="ref = alpha * policy + (1 - alpha) * ref at each sync.")
    ref_model_sync_steps: int = Field(512, ge=1, description="Optimizer steps between reference syncs.")
    rewards: list[RewardSource] = Field(default_factory=_default_grpo_rewards, min_length=1, description="Reward sources and weights.")
    log_completions_steps: int = Field(10, ge=1, description="Write a Parquet of completions and rewards every this many steps.")


class EvalConfig(Section):
    every_steps: int = Field(20, ge=1, description="Generate and score held-out completions every this many RL steps.")
    num_prompts: int = Field(64, ge=1, description="Held-out prompts evaluated each time.")
    batch_size: int = Field(64, ge=1, description="Prompts per generation batch.")
    greedy: bool = Field(False, description="Plain greedy decoding instead of near-greedy sampling (temperature 0.01+1e-7).")
    metrics: list[str] = Field(
        default_factory=lambda: ["rlhf_core.reward_functions:vader_compound"],
        description="Extra metric functions 'module:function' scored on each completion.",
    )


class ExportConfig(Section):
    output_dir: Path | None = Field(None, strict=False, description="Where the final policy is exported; null means <run.output_dir>/export.")
    merge: bool = Field(False, description="With LoRA, also export the adapter merged into the base weights.")


class PromoteConfig(Section):
    metric: str | None = Field(
        None, description="Eval column that decides promotion: 'score' (reward model) or a metric function's name; null: the first of eval.metrics, else score.")
    min_improvement: float = Field(0.01, description="The candidate must beat the champion's metric by at least this much.")
    max_kl: float | None = Field(20.0, gt=0.0, description="Refuse a candidate whose mean KL to its reference (nats per completion) exceeds this; null: no KL gate.")
    min_value: float | None = Field(None, description="With no champion yet, the candidate's metric must reach this; null: no such gate.")
    num_prompts: int | None = Field(None, ge=1, description="Held-out prompts evaluated; null: eval.num_prompts.")


class TrackingConfig(Section):
    uri: str | None = Field(None, description="MLflow tracking URI; null falls back to MLFLOW_TRACKING_URI, then sqlite:///mlflow.db here.")
    experiment: str = Field("rlhf", min_length=1, description="MLflow experiment name.")
    register_models: bool = Field(True, description="Log every checkpoint as a version of a registered model.")


class RegistryConfig(Section):
    reward_model_name: str = Field("rlhf-reward-model", min_length=1, description="Registered model that holds reward-model versions.")
    policy_model_name: str = Field("rlhf-policy", min_length=1, description="Registered model that holds policy versions.")
    keep_last_versions: int | None = Field(
        None, ge=1, description="Versions kept per registered model after each registration: the newest N plus every version with an alias or the tag keep=true; null keeps all.")


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
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Periodic generation evaluation.")
    export: ExportConfig = Field(default_factory=ExportConfig, description="Export of the final policy.")
    promote: PromoteConfig = Field(default_factory=PromoteConfig, description="Promotion of the candidate to champion.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    registry: RegistryConfig = Field(default_factory=RegistryConfig, description="Registered model names.")

    @model_validator(mode="after")
    def _cross_checks(self) -> PipelineConfig:
        if self.rl.algorithm == "grpo" and self.rl.batch_size % self.grpo.num_generations:
            raise ValueError(
                f"rl.batch_size {self.rl.batch_size} must be a multiple of grpo.num_generations {self.grpo.num_generations}"
            )
        if self.rl.algorithm == "ppo" and self.rl.batch_size % self.ppo.num_mini_batches:
            raise ValueError(
                f"rl.batch_size {self.rl.batch_size} must be a multiple of ppo.num_mini_batches {self.ppo.num_mini_batches}"
            )
        if self.init.reference == "adapter_disabled" and not self.model.lora.enabled:
            raise ValueError("init.reference 'adapter_disabled' needs model.lora.enabled true; use 'copy' or 'auto'")
        if self.rl.algorithm == "ppo" and (self.rl.batch_size // self.ppo.num_mini_batches) % self.rl.gradient_accumulation_steps:
            raise ValueError(
                f"a PPO mini-batch of {self.rl.batch_size // self.ppo.num_mini_batches} (rl.batch_size / ppo.num_mini_batches) "
                f"must be a multiple of rl.gradient_accumulation_steps {self.rl.gradient_accumulation_steps}"
            )
        if self.run.accelerate_config is not None:
            strategy = accelerate_strategy_of(self.run.accelerate_config)
            if strategy == "fsdp1":
                raise ValueError(f"run.accelerate_config {self.run.accelerate_config} uses FSDP version 1; set "
                                 "fsdp_config.fsdp_version: 2 (see configs/accelerate/fsdp.yaml)")
            if strategy in ("zero3", "fsdp") and (self.model.lora.enabled or self.reward.lora):
                raise ValueError(f"run.accelerate_config {self.run.accelerate_config} shards parameters ({strategy}), "
                                 "which LoRA training does not need or support here; use configs/accelerate/ddp.yaml "
                                 "or deepspeed_zero2.yaml, or turn model.lora.enabled / reward.lora off")
        if self.rl.algorithm == "grpo":
            self._grpo_checks()
        if self.run.accelerate_config is not None and self.rl.skip_nonfinite_steps and \
                accelerate_strategy_of(self.run.accelerate_config).startswith("zero"):
            raise ValueError(f"run.accelerate_config {self.run.accelerate_config} uses DeepSpeed, whose engine steps inside "
                             "backward before a non-finite gradient can be seen; set rl.skip_nonfinite_steps: false "
                             "(a non-finite gradient then stops the run)")
        if self.init.policy == "sft" and not self.sft.enabled:
            raise ValueError("init.policy is 'sft' but sft.enabled is false; set init.policy to 'base' or enable sft")
        names = self.metric_names()
        if self.promote.metric is not None and self.promote.metric not in ("score", *names):
            allowed = ", ".join(repr(n) for n in ("score", *names))
            raise ValueError(f"promote.metric {self.promote.metric!r} is not an eval column; allowed: {allowed}")
        return self

    def _grpo_checks(self) -> None:
        grpo, rl = self.grpo, self.rl
        if grpo.steps_per_generation is not None and grpo.steps_per_generation % rl.gradient_accumulation_steps:
            raise ValueError(f"grpo.steps_per_generation {grpo.steps_per_generation} must be a multiple of "
                             f"rl.gradient_accumulation_steps {rl.gradient_accumulation_steps}")
        if rl.batch_size % rl.gradient_accumulation_steps:
            raise ValueError(f"rl.batch_size {rl.batch_size} must be a multiple of rl.gradient_accumulation_steps "
                             f"{rl.gradient_accumulation_steps} for GRPO")
        if rl.missing_eos_penalty is not None and grpo.multi_objective_aggregation == "normalize_then_sum":
            raise ValueError("rl.missing_eos_penalty is subtracted from the summed reward before group statistics, which "
                             "grpo.multi_objective_aggregation 'normalize_then_sum' does not have; use 'sum_then_normalize' "
                             "or add the penalty as a reward function")
        if grpo.delta is not None and grpo.loss_type in ("cispo", "sapo"):
            raise ValueError(f"grpo.delta applies to the clipped losses (grpo, bnpo, dr_grpo, dapo), not loss_type '{grpo.loss_type}'")
        if grpo.sync_ref_model:
            if grpo.beta == 0:
                raise ValueError("grpo.sync_ref_model needs a reference model, but grpo.beta is 0 so none is loaded")
            if self.model.lora.enabled:
                raise ValueError("grpo.sync_ref_model needs a reference copy to mix into, but with model.lora.enabled the "
                                 "reference is the policy with its adapters disabled")
            if self.run.accelerate_config is not None and accelerate_strategy_of(self.run.accelerate_config) in ("zero3", "fsdp"):
                raise ValueError(f"grpo.sync_ref_model mixes whole weights, which run.accelerate_config "
                                 f"{self.run.accelerate_config} shards; use ddp.yaml or deepspeed_zero2.yaml")

    # derived values, computed in one place ---------------------------------------------------

    @property
    def export_dir(self) -> Path:
        return self.export.output_dir or self.run.output_dir / "export"

    def metric_names(self) -> list[str]:
        """Eval column names of eval.metrics ('package.module:function' is named 'function')."""
        return [spec.rsplit(":", 1)[-1] for spec in self.eval.metrics]

    def promotion_metric(self) -> str:
        """The eval column promotion compares: promote.metric, else the first metric function, else score."""
        if self.promote.metric is not None:
            return self.promote.metric
        names = self.metric_names()
        return names[0] if names else "score"

    def uses_demo_world(self) -> bool:
        sources = [self.model.base, self.reward.base, self.data.preference.path, self.data.preference_eval.path,
                   self.data.prompts.path, self.data.eval_prompts.path]
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


def accelerate_strategy_of(path) -> str:
    """`rlhf_core.parallel.accelerate_strategy`, imported when a config names a launch file (it imports torch)."""
    from rlhf_core.parallel import accelerate_strategy

    return accelerate_strategy(path)


# --------------------------------------------------------------------------------------------
# reading, overriding, validating
# --------------------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any]:
    """`ppo.kl_coef=0.1` -> (['ppo', 'kl_coef'], 0.1); the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}' must look like section.field=value, e.g. ppo.kl_coef=0.1")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override '{text}' has a value that is not valid YAML ({err.__class__.__name__})") from None
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `raw` with each `a.b=value` override set (unknown keys are caught by validation)."""
    patched = json.loads(json.dumps(raw, default=str))
    for text in overrides:
        path, value = parse_override(text)
        node = patched
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': `{'.'.join(path[: i + 1])}` is a value, not a section")
            node = child
        node[path[-1]] = value
    return patched


def validate_config(raw: dict[str, Any]) -> PipelineConfig:
    """Validate a raw mapping into a PipelineConfig, or raise ConfigError naming the first bad field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(raw).__name__}")
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_error(exc.errors()[0], PipelineConfig)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a YAML config (or the defaults with no path), apply overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config file {path} is not valid YAML{where}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, not a {type(raw).__name__}")
    return validate_config(apply_overrides(raw, list(overrides or [])))


SECRET_SUFFIXES = ("token", "password", "passwd", "secret", "api_key", "apikey", "credentials")


def is_secret_key(key: str) -> bool:
    """True for keys such as `hub_token` or `tracking.password` (not `model.tokenizer`)."""
    name = key.rsplit(".", 1)[-1].lower()
    return any(name == s or name.endswith("_" + s) for s in SECRET_SUFFIXES)


def redact_uri(text: str) -> str:
    """Hide every credential of every URI in `text` (see rlhf_core.redaction.redact)."""
    from rlhf_core.redaction import redact

    return redact(text)


def flatten_config(cfg: PipelineConfig) -> dict[str, str]:
    """Dotted key -> string value, for MLflow params; secret keys left out, URI passwords hidden."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif is_secret_key(prefix):
            return
        else:
            out[prefix] = redact_uri(json.dumps(value) if isinstance(value, list) else str(value))

    walk("", cfg.model_dump(mode="json"))
    return out


def describe_fields(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted field, default, description) for every leaf field: the README's config reference."""
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        if field.annotation is nested_section(field.annotation):
            rows.extend(describe_fields(field.annotation, path + "."))
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, list):
            default = [d.model_dump(exclude_none=True) if isinstance(d, BaseModel) else d for d in default]
        rows.append((path, json.dumps(default, default=str), field.description or ""))
    return rows
