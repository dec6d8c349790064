"""The training stages' sections: the optimizer settings they share, SFT, reward, initialization, RL, PPO, GRPO."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlhf_core.config.base import PathText, Section
from rlhf_core.config.rewards import RewardSource
from rlhf_core.config.run_model_data import DatasetSpec


class OptimSettings(Section):
    learning_rate: float = Field(1e-4, gt=0.0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps before the schedule.")
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear", description="Learning-rate schedule after warm-up."
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    max_nonfinite_steps_in_a_row: int = Field(
        3,
        ge=0,
        description="An optimizer step whose gradient norm is NaN or inf is skipped and counted (perf/skipped_steps); this many in a row are tolerated and one more stops the run with an error. 0 stops at the first (DeepSpeed needs 0: its engine steps inside backward).",
    )


class SFTConfig(OptimSettings):
    enabled: bool | None = Field(
        None,
        description="Run the SFT warm start; false: the policy starts from model.base. null: on in the demo (model.base 'demo') and when sft.dataset names a corpus other than 'demo', off otherwise (a model of yours is not fine-tuned on the demo's reviews).",
    )
    dataset: DatasetSpec = Field(
        default_factory=DatasetSpec, description="Text corpus to fine-tune on ('demo': the review corpus)."
    )
    max_steps: int = Field(300, ge=1, description="Optimizer steps of the warm start.")
    batch_size: int = Field(32, ge=1, description="Sequences per micro-batch.")
    learning_rate: float = Field(2e-5, gt=0.0, description="Peak AdamW learning rate (TRL's SFTConfig default).")
    log_steps: int = Field(10, ge=1, description="Log the loss every this many steps.")


class RewardConfig(OptimSettings):
    base: PathText = Field(
        "policy",
        min_length=1,
        description="Reward model start: 'policy' (the SFT/base policy), a directory, hub name or models:/ URI.",
    )
    max_steps: int = Field(200, ge=1, description="Optimizer steps of reward training.")
    batch_size: int = Field(
        32, ge=1, description="Preference pairs per micro-batch (chosen and rejected share one forward)."
    )
    learning_rate: float = Field(
        1e-5,
        gt=0.0,
        description="Peak AdamW learning rate: 1e-5 for full fine-tuning of a real model (InstructGPT and OpenRLHF use about 9e-6; TRL's 1e-4 suits LoRA).",
    )
    center_rewards_coefficient: float | None = Field(
        None, gt=0.0, description="Weight of the reward-centering penalty (TRL's); null turns it off."
    )
    eval_steps: int = Field(50, ge=1, description="Evaluate on the held-out pairs every this many steps.")
    save_steps: int = Field(100, ge=1, description="Checkpoint and register a version every this many steps.")
    log_steps: int = Field(10, ge=1, description="Log training metrics every this many steps.")
    lora: bool = Field(
        False, description="Train the reward model with LoRA (model.lora settings, score head trainable)."
    )
    disable_dropout: bool = Field(
        True,
        description="Turn every dropout of the reward model off while it trains (TRL's default); false keeps the model's own.",
    )


class InitConfig(Section):
    policy: Literal["sft", "base", "champion"] | None = Field(
        None,
        description="Policy start: the SFT warm start's output, model.base as is, or the registry's champion (sft, else base, when there is none). null: 'sft' when the SFT stage runs, else 'base'.",
    )
    value_from: Literal["reward", "policy"] = Field(
        "reward", description="Value model start: the reward model's weights (as TRL) or the policy's."
    )
    reference: Literal["auto", "copy", "adapter_disabled"] = Field(
        "auto",
        description="Reference model: a frozen copy, or with LoRA the policy with adapters off; auto picks by LoRA.",
    )


GROUP_ALGORITHMS = (
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
)  # no value model; grpo: section
Algorithm = Literal["ppo", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]


class DynamicSampling(Section):
    enabled: bool = Field(
        False,
        description="Drop the groups whose reward has zero spread (they teach nothing) and sample more prompts until the generation batch is full (DAPO's dynamic sampling; the GRPO family: refused for ppo).",
    )
    max_rounds: int = Field(
        3,
        ge=1,
        description="Most extra generation rounds per step; a batch still short after them is filled with zero-spread groups (which carry no advantage) and the step goes on.",
    )


class RLConfig(OptimSettings):
    algorithm: Algorithm = Field(
        "ppo",
        description="RL algorithm of the policy stage: ppo (value model, GAE), or a group algorithm without one: grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline (the grpo section configures all four; docs/algorithms.md).",
    )
    total_steps: int = Field(100, ge=1, description="RL steps: one rollout (PPO) or generation (GRPO) batch each.")
    batch_size: int = Field(
        32,
        ge=1,
        description="Completions generated per RL step (the rollout or generation batch); PPO splits it into ppo.num_mini_batches optimizer steps per PPO epoch, GRPO into grpo.steps_per_generation / rl.gradient_accumulation_steps optimizer steps.",
    )
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="Micro-batches accumulated per optimizer step (PPO and GRPO alike)."
    )
    learning_rate: float = Field(3e-6, gt=0.0, description="Peak AdamW learning rate (TRL's default).")
    response_length: int = Field(
        256, ge=1, description="Most new tokens per rollout (TRL's max_completion_length), evaluation included."
    )
    temperature: float = Field(0.7, gt=0.0, description="Sampling temperature of rollouts (TRL's default).")
    top_k: int = Field(0, ge=0, description="Top-k filtering of rollouts; 0 disables it.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus filtering of rollouts; 1.0 disables it.")
    stop_token: str = Field(
        "eos",
        min_length=1,
        description="What ends a response: 'eos' (every id of the policy's generation_config.eos_token_id and the tokenizer's eos), 'none', or one token of the tokenizer.",
    )
    stop_tokens: list[str] = Field(
        default_factory=list,
        description="More tokens that end a response (e.g. '<|im_end|>'), each one token of the policy's tokenizer.",
    )
    min_response_length: int = Field(
        1,
        ge=1,
        description="The stop token cannot end a response before this many tokens (transformers' min_new_tokens).",
    )
    missing_eos_penalty: float | None = Field(
        None, description="Subtract this from the score of responses that never emit eos."
    )
    save_steps: int = Field(50, ge=1, description="Checkpoint and register a policy version every this many steps.")
    log_steps: int = Field(1, ge=1, description="Log training metrics every this many steps.")
    disable_dropout: bool = Field(
        True,
        description="Turn every dropout (LoRA's and attention's included) off in the trained policy and value models (TRL's default; frozen models run in eval mode anyway); false keeps them.",
    )

    @model_validator(mode="after")
    def _min_within_max(self) -> RLConfig:
        if self.min_response_length > self.response_length:
            raise ValueError(
                f"min_response_length {self.min_response_length} must not exceed response_length {self.response_length}"
            )
        if self.missing_eos_penalty is not None and self.stop_token == "none" and not self.stop_tokens:
            raise ValueError(
                "missing_eos_penalty needs a stop token, but stop_token is 'none' and stop_tokens is empty, "
                "so every response would be penalized"
            )
        return self


class PPOConfig(Section):
    kl_coef: float = Field(0.05, ge=0.0, description="Initial coefficient of the per-token KL penalty (TRL's default).")
    kl_estimator: Literal["k1", "k3"] = Field(
        "k1", description="KL estimator of the penalty: k1 (log ratio) or k3 (unbiased, positive)."
    )
    adaptive_kl: bool = Field(
        False, description="Adapt kl_coef toward target_kl (Ziegler et al.) instead of keeping it fixed."
    )
    target_kl: float = Field(6.0, gt=0.0, description="KL the adaptive controller steers toward.")
    horizon: int = Field(10000, ge=1, description="Horizon of the adaptive KL controller.")
    cliprange: float = Field(0.2, gt=0.0, description="Clip range of the policy ratio.")
    vf_coef: float = Field(0.1, ge=0.0, description="Weight of the value loss.")
    cliprange_value: float = Field(0.2, gt=0.0, description="Clip range of the value prediction.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount factor of GAE.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="Lambda of GAE.")
    num_ppo_epochs: int = Field(4, ge=1, description="Passes over each rollout batch.")
    early_stop_approx_kl: float | None = Field(
        None,
        gt=0.0,
        description="Skip a step's remaining PPO epochs once the approximate KL to the rollout policy (0.5 x the mean squared log ratio per token, measured at each mini-batch before its update, averaged over the step's so far; the first mini-batch is on-policy) exceeds this (the early stopping of OpenAI's baselines and TRL's old target_kl); policy/ppo_epochs logs the epochs run. Null: always ppo.num_ppo_epochs.",
    )
    num_mini_batches: int = Field(1, ge=1, description="Mini-batches per PPO epoch.")
    whiten_rewards: bool = Field(False, description="Whiten the KL-penalized rewards before GAE.")
    whiten_advantages: bool = Field(True, description="Whiten advantages before the policy loss.")


def _default_grpo_rewards() -> list[RewardSource]:
    return [RewardSource(name="reward_model", model="reward_stage")]


class GRPOConfig(Section):
    """The group algorithms' section (rl.algorithm grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline)."""

    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (the group).")
    generation_batch_size: int | None = Field(
        None,
        ge=2,
        description="Completions generated per RL step by the group algorithms, num_generations per prompt (TRL's name, per process here); null: rl.batch_size. Lets one config give PPO and GRPO each their own batch.",
    )
    epsilon: float = Field(0.2, gt=0.0, description="Lower clip of the importance ratio.")
    epsilon_high: float | None = Field(
        None,
        gt=0.0,
        description="Upper clip of the ratio; null uses epsilon. With loss_type cispo: the cap of the ratio (TRL recommends 5.0).",
    )
    delta: float | None = Field(
        None,
        gt=1.0,
        description="Two-sided clipping (INTELLECT-2): cap the unclipped ratio at delta; null is off. Should exceed 1 + epsilon_high.",
    )
    beta: float = Field(
        0.0,
        ge=0.0,
        description="KL coefficient to the reference; 0 loads no reference (TRL's GRPO default). grpo adds beta x k3 KL to the loss; rloo and reinforce_plus_plus* subtract beta x KL (kl_estimator) from the reward.",
    )
    kl_estimator: Literal["k1", "k3"] = Field(
        "k1",
        description="KL estimator of the penalty rloo and reinforce_plus_plus* put into the reward: k1 (log ratio; TRL's RLOO and verl's default) or k3 (never negative). grpo's loss term is always k3.",
    )
    normalize_advantages: bool = Field(
        False, description="rloo: normalize the advantages over the whole generation batch (TRL's RLOO option)."
    )
    reward_clip_range: list[float] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="rloo: clip each completion's summed reward into [low, high] before the KL penalty.",
    )
    gamma: float = Field(
        1.0, ge=0.0, le=1.0, description="reinforce_plus_plus: discount of the return over response tokens (verl's)."
    )
    use_bias_correction_kl: bool = Field(
        True, description="Multiply the k3 KL term by the importance ratio (TRL 1.16's default)."
    )
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"] = Field(
        "dapo",
        description="Loss: grpo, bnpo, dr_grpo, dapo (TRL's default), cispo (clipped-IS-weight policy gradient) or sapo (soft gate).",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Importance ratio per token, or one per sequence from the mean log ratio (GSPO)."
    )
    sapo_temperature_pos: float = Field(
        1.0, gt=0.0, description="SAPO's gate temperature for tokens with positive advantage."
    )
    sapo_temperature_neg: float = Field(
        1.05, gt=0.0, description="SAPO's gate temperature for tokens with non-positive advantage."
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide advantages by the group's, the batch's or no std."
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize",
        description="Weighted sum of rewards then group-normalize, or normalize each reward per group, sum, then batch-normalize.",
    )
    top_entropy_quantile: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Train only on the tokens whose entropy is in this top fraction of the batch's; 1.0 trains on all.",
    )
    num_iterations: int = Field(
        1, ge=1, description="Updates per generation batch, reusing stored old log-probabilities."
    )
    steps_per_generation: int | None = Field(
        None,
        ge=1,
        description="Micro-batches the generation batch (grpo.generation_batch_size or rl.batch_size completions) is split into (TRL's name); a multiple of rl.gradient_accumulation_steps; null: rl.gradient_accumulation_steps, i.e. one optimizer step per generation batch.",
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions without a stop token out of the loss."
    )
    sync_ref_model: bool = Field(
        False, description="Mix the policy into the reference every ref_model_sync_steps optimizer steps (TR-DPO)."
    )
    ref_model_mixup_alpha: float = Field(
        0.6, ge=0.0, le=1.0, description="ref = alpha * policy + (1 - alpha) * ref at each sync."
    )
    ref_model_sync_steps: int = Field(512, ge=1, description="Optimizer steps between reference syncs.")
    dynamic_sampling: DynamicSampling = Field(
        default_factory=DynamicSampling, description="DAPO's dynamic sampling (any group algorithm)."
    )
    rewards: list[RewardSource] = Field(
        default_factory=_default_grpo_rewards,
        min_length=1,
        description="Reward sources and weights: a reward model or function in the stage's process, or a scorer served elsewhere (kind; docs/served-rewards.md).",
    )
    log_completions_steps: int = Field(
        10,
        ge=1,
        description="Log a table of completions and rewards every this many steps (CSV in MLflow, Parquet in the stage directory).",
    )
    tools: list[str] = Field(
        default_factory=list,
        description="Tools the policy may call in its rollouts, each 'package.module:function' (sync or async; TRL's tools=): its name, type hints and Google-style docstring are the schema the chat template shows. A tool that raises, runs past grpo.tool_timeout_s or does not exist answers with its error text; the episode goes on (docs/tools.md).",
    )
    environment: str | dict[str, str] | None = Field(
        None,
        description="An environment class 'package.module:Class', one instance per episode (TRL's environment_factory=): reset(**row) may return text appended to the prompt's last user message, its public methods are tools, and get_reward(), when it has one, is a reward source of weight 1. Or a mapping name -> class, the prompt rows' `environment` column choosing one per row.",
    )
    max_tool_calls: int | None = Field(
        None,
        ge=0,
        description="Rounds of tool calls per episode at most (TRL's max_tool_calling_iterations): a turn's calls run together, then the model speaks again; null: until rl.response_length, which counts the tool answers' tokens too, runs out.",
    )
    tool_timeout_s: float = Field(
        10.0,
        gt=0.0,
        description="Seconds one tool call may take; past them the model gets a timeout error as the answer.",
    )

    @field_validator("tools")
    @classmethod
    def _import_paths(cls, tools: list[str]) -> list[str]:
        for spec in tools:
            if ":" not in spec:
                raise ValueError(f"tool '{spec}' must be written 'package.module:function'")
        return tools

    @property
    def uses_tools(self) -> bool:
        """Episodes of several turns: tools or an environment are configured."""
        return bool(self.tools) or self.environment is not None

    def generation_batch(self, rl_batch_size: int) -> int:
        """Completions per RL step: generation_batch_size, or rl.batch_size where it is null."""
        return self.generation_batch_size or rl_batch_size


# grpo-section fields that only some group algorithms read; setting one for another algorithm is an error
GROUP_FIELDS_FOR = {
    "loss_type": ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "importance_sampling_level": ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "delta": ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "sapo_temperature_pos": ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "sapo_temperature_neg": ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "top_entropy_quantile": ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "use_bias_correction_kl": ("grpo",),
    "scale_rewards": ("grpo",),
    "multi_objective_aggregation": ("grpo",),
    "kl_estimator": ("rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "normalize_advantages": ("rloo",),
    "reward_clip_range": ("rloo",),
    "gamma": ("reinforce_plus_plus",),
}


def keyed_sections(rl: RLConfig, ppo: PPOConfig, grpo: GRPOConfig) -> tuple[dict, dict]:
    """(rl, the algorithm's section) as the RL stage's key dumps them: laid out as before dynamic_sampling moved from
    rl to grpo (rl's dump with it, grpo's without), so that the runs before the move keep their keys and resume."""
    section = ppo if rl.algorithm == "ppo" else grpo
    moved = {"dynamic_sampling": grpo.dynamic_sampling.model_dump(mode="json")}
    return rl.model_dump(mode="json") | moved, section.model_dump(mode="json", exclude=set(moved))
