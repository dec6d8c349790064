"""The training stages' sections: the optimizer settings they share, SFT, reward, initialization, RL, PPO, DPO (the
GRPO family's section is rlhf_core/config/rewards.py, beside the rewards it reads)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.config.base import PathText, Section
from rlhf_core.config.rewards import GRPOConfig
from rlhf_core.config.run_model_data import DatasetSpec


class OptimSettings(Section):
    learning_rate: float = Field(1e-4, gt=0.0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps before the schedule.")
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "linear", description="Learning-rate schedule after warm-up."
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    gradient_accumulation_steps: int = Field(
        1,
        ge=1,
        description="Micro-batches accumulated per optimizer step. Unset outside the demo: micro-batches of 8 sequences (TRL's per_device_train_batch_size) where 8 divides the batch, the same optimizer step (sft and reward: when batch_size is unset too, batch_size becomes 8 and this its multiple).",
    )
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


GROUP_ALGORITHMS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")  # no value model; grpo:
PREFERENCE_ALGORITHMS = ("dpo", "online_dpo")  # a DPO loss on pairs, no value model, no advantages; dpo: section
Algorithm = Literal["ppo", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "dpo", "online_dpo"]


def section_of(algorithm: str) -> str:
    """The config section rl.algorithm `algorithm` reads: ppo, grpo (the GRPO family) or dpo (DPO, online DPO)."""
    return "ppo" if algorithm == "ppo" else "dpo" if algorithm in PREFERENCE_ALGORITHMS else "grpo"


def reads_grpo_rewards(algorithm: str) -> bool:
    """Whether rl.algorithm `algorithm` scores its samples with grpo.rewards: the GRPO family, and online DPO,
    which ranks its two completions per prompt by them."""
    return algorithm in GROUP_ALGORITHMS or algorithm == "online_dpo"


class RLConfig(OptimSettings):
    algorithm: Algorithm = Field(
        "ppo",
        description="RL algorithm of the policy stage: ppo (value model, GAE); a group algorithm without one: grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline (the grpo section configures all four); or preference optimization without a reward model: dpo (offline, on data.preference) and online_dpo (two samples per prompt ranked by grpo.rewards), which the dpo section configures (docs/algorithms.md).",
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
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="A token budget for every forward and backward pass of the policy, reference, value and reward models in the RL stage (verl's dynamic batch size, ppo_max_token_len_per_gpu): completions of similar length packed, longest first, so that a micro-batch's completions x its longest prompt + completion stay within it (a longer one alone), instead of the fixed micro-batch rl.batch_size / rl.gradient_accumulation_steps; the gradients equal the fixed split's (grpo.loss_type bnpo, which normalizes per micro-batch, excepted); unset: the fixed split.",
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


DPO_LOSS_TYPES = (  # TRL 1.16 DPOTrainer's, in its order (rlhf_core/rl/dpo_losses.py)
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
    "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip


def dpo_loss_problem(
    loss_types: Sequence[str], loss_weights: Sequence[float] | None, beta: float, label_smoothing: float
) -> str | None:
    """What makes these DPO loss settings untrainable, in one sentence naming the field; None when nothing does
    (the dpo section's check and `rlhf_core.rl.dpo_losses.check_spec`'s)."""
    known = ", ".join(DPO_LOSS_TYPES)
    if not loss_types:
        return f"dpo.loss_type must name at least one loss type of {known}."
    unknown = [t for t in loss_types if t not in DPO_LOSS_TYPES]
    if unknown:
        return f"dpo.loss_type {', '.join(map(repr, unknown))} is unknown; TRL 1.16's are {known}."
    if loss_weights is not None and len(loss_weights) != len(loss_types):
        return f"dpo.loss_weights needs one weight per loss type ({', '.join(loss_types)}), got {len(loss_weights)}."
    if beta <= 0:
        return f"dpo.beta must be above 0, got {beta}."
    if "exo_pair" in loss_types and label_smoothing <= 0:
        return "dpo.label_smoothing must be above 0 for exo_pair; the EXO paper recommends 1e-3."
    if "robust" in loss_types and not 0 <= label_smoothing < 0.5:
        return f"dpo.label_smoothing must lie in [0, 0.5) for robust, got {label_smoothing}."
    return None


class DPOConfig(Section):
    """DPO and online DPO (rl.algorithm dpo, online_dpo): TRL 1.16 DPOTrainer's names and defaults."""

    loss_type: list[str] = Field(
        default_factory=lambda: ["sigmoid"],
        min_length=1,
        description="DPO losses, summed with loss_weights (TRL's list): sigmoid, hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sft, sigmoid_norm (docs/algorithms.md).",
    )
    loss_weights: list[float] | None = Field(
        None, description="One weight per loss_type entry; null: 1.0 each (TRL's loss_weights)."
    )
    beta: float = Field(
        0.1,
        gt=0.0,
        description="Temperature of the implicit reward beta x log(pi / pi_ref): higher stays closer to the reference (TRL's default); IPO's tau.",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="The share of pairs assumed flipped (robust: in [0, 0.5); exo_pair needs it above 0, 1e-3 in the EXO paper; aot).",
    )
    discopop_tau: float = Field(0.05, gt=0.0, description="DiscoPOP's temperature (loss_type discopop).")
    reference_free: bool = Field(
        False,
        description="Train against a uniform reference (its log-probs taken as 0; older TRL's reference_free, which TRL 1.16 dropped); no reference model is loaded for the loss.",
    )
    precompute_ref_log_probs: bool = Field(
        False,
        description="Compute the reference's log-probs of every pair once before training (saved with the stage) and free the reference from the training steps (TRL's precompute_ref_log_probs; not with sync_ref_model).",
    )
    sync_ref_model: bool = Field(
        False,
        description="TR-DPO: every ref_model_sync_steps steps, ref = alpha x policy + (1 - alpha) x ref (TRL's sync_ref_model; needs a reference copy: not with LoRA's disabled adapters).",
    )
    ref_model_mixup_alpha: float = Field(0.6, ge=0.0, le=1.0, description="TR-DPO's alpha (TRL's default).")
    ref_model_sync_steps: int = Field(
        512, ge=1, description="Steps between TR-DPO's reference updates (TRL's default)."
    )

    @model_validator(mode="after")
    def _losses_known(self) -> DPOConfig:
        problem = dpo_loss_problem(self.loss_type, self.loss_weights, self.beta, self.label_smoothing)
        if problem:
            raise ValueError(problem)
        if self.sync_ref_model and (self.precompute_ref_log_probs or self.reference_free):
            raise ValueError(
                "dpo.sync_ref_model updates a reference model; turn precompute_ref_log_probs and reference_free off"
            )
        return self


def keyed_sections(rl: RLConfig, ppo: PPOConfig, grpo: GRPOConfig, dpo: DPOConfig | None = None) -> tuple[dict, dict]:
    """(rl, the algorithm's section: `section_of`) as the RL stage's key dumps them: laid out as before
    dynamic_sampling moved from rl to grpo (rl's dump with it, grpo's without), and without
    rl.max_tokens_per_micro_batch while it is unset, so that the runs before keep their keys and resume."""
    section = {"ppo": ppo, "grpo": grpo, "dpo": dpo or DPOConfig()}[section_of(rl.algorithm)]
    moved = {"dynamic_sampling": grpo.dynamic_sampling.model_dump(mode="json")}
    later = {"max_tokens_per_micro_batch"} if rl.max_tokens_per_micro_batch is None else set()  # unset: keys as before
    return rl.model_dump(mode="json", exclude=later) | moved, section.model_dump(mode="json", exclude=set(moved))
