"""The checks of `PipelineConfig` that span sections, grouped by concern: the PPO batch arithmetic, init, the
launcher and its accelerate strategy, the group algorithms (GRPO family) and the evaluation columns.

Each takes the sections it reads and raises ValueError with one sentence; they run inside PipelineConfig's
model validator, where pydantic turns that into the ConfigError a user sees.
"""

from __future__ import annotations

from rlhf_core.config.evaluation import EvalConfig, GuardConfig
from rlhf_core.config.rewards import GROUP_FIELDS_FOR, GRPOConfig
from rlhf_core.config.rollout import RolloutConfig
from rlhf_core.config.run_model_data import RunConfig, accelerate_strategy
from rlhf_core.config.training import (
    GROUP_ALGORITHMS,
    PREFERENCE_ALGORITHMS,
    DPOConfig,
    InitConfig,
    PPOConfig,
    RewardConfig,
    RLConfig,
    SFTConfig,
)

# the accelerate strategies that shard parameters: no LoRA, no whole-weight reference sync
SHARDED = ("zero3", "fsdp")


# PPO batch arithmetic ----------------------------------------------------------------------


def check_ppo_mini_batches(rl: RLConfig, ppo: PPOConfig) -> None:
    """PPO splits its rollout batch into ppo.num_mini_batches equal mini-batches."""
    if rl.algorithm == "ppo" and rl.batch_size % ppo.num_mini_batches:
        raise ValueError(
            f"rl.batch_size {rl.batch_size} must be a multiple of ppo.num_mini_batches {ppo.num_mini_batches}"
        )


def check_ppo_accumulation(rl: RLConfig, ppo: PPOConfig) -> None:
    """A PPO mini-batch is accumulated over rl.gradient_accumulation_steps equal micro-batches."""
    if rl.algorithm == "ppo" and (rl.batch_size // ppo.num_mini_batches) % rl.gradient_accumulation_steps:
        raise ValueError(
            f"a PPO mini-batch of {rl.batch_size // ppo.num_mini_batches} (rl.batch_size / ppo.num_mini_batches) "
            f"must be a multiple of rl.gradient_accumulation_steps {rl.gradient_accumulation_steps}"
        )


# init --------------------------------------------------------------------------------------


def check_init_reference(init: InitConfig, lora_enabled: bool) -> None:
    if init.reference == "adapter_disabled" and not lora_enabled:
        raise ValueError("init.reference 'adapter_disabled' needs model.lora.enabled true; use 'copy' or 'auto'")


def check_init_policy(init: InitConfig, sft: SFTConfig) -> None:
    if init.policy == "sft" and not sft.enabled:
        raise ValueError(
            "init.policy is 'sft' but the SFT stage is off (sft.enabled false, or null with sft.dataset 'demo' outside "
            "the demo); set init.policy to 'base', or name your corpus in sft.dataset"
        )


# the launcher and its accelerate strategy ---------------------------------------------------


def check_launcher(run: RunConfig, trains_lora: bool) -> str | None:
    """The strategy run.accelerate_config asks for (its file read once here; None without one), after
    refusing a launcher that does not read it and a sharding strategy under LoRA (`trains_lora`)."""
    if run.accelerate_config is None:
        return None
    if run.launcher == "ray":  # refused before the file is read: a missing file is then not the first sentence
        raise ValueError(
            f"run.accelerate_config {run.accelerate_config} is read by `accelerate launch`, which "
            "run.launcher 'ray' does not run (Ray Train starts the processes and a DDP process group); "
            "leave run.accelerate_config unset with the ray launcher, or use run.launcher 'local'"
        )
    strategy = accelerate_strategy(run.accelerate_config)
    if strategy == "fsdp1":
        raise ValueError(
            f"run.accelerate_config {run.accelerate_config} uses FSDP version 1; set "
            "fsdp_config.fsdp_version: 2 (see configs/accelerate/fsdp.yaml)"
        )
    if strategy in SHARDED and trains_lora:
        raise ValueError(
            f"run.accelerate_config {run.accelerate_config} shards parameters ({strategy}), "
            "which LoRA training does not need or support here; use configs/accelerate/ddp.yaml "
            "or deepspeed_zero2.yaml, or turn model.lora.enabled / reward.lora off"
        )
    return strategy


def check_nonfinite_skipping(run: RunConfig, strategy: str | None, rl: RLConfig, reward: RewardConfig) -> None:
    """DeepSpeed steps inside backward, so a stage cannot skip a non-finite step there."""
    if strategy is None or not strategy.startswith("zero"):
        return
    for name, stage in (("rl", rl), ("reward", reward)):
        if stage.max_nonfinite_steps_in_a_row:
            raise ValueError(
                f"run.accelerate_config {run.accelerate_config} uses DeepSpeed, whose engine steps "
                "inside backward before a non-finite gradient can be seen, so such a step cannot be "
                f"skipped; set {name}.max_nonfinite_steps_in_a_row: 0 (it is "
                f"{stage.max_nonfinite_steps_in_a_row}; a non-finite gradient then stops the run)"
            )


# the group algorithms (GRPO family) ---------------------------------------------------------


def check_token_budget(rl: RLConfig, strategy: str | None) -> None:
    """rl.max_tokens_per_micro_batch varies the micro-batches of an optimizer step, which DeepSpeed, counting them
    in its engine, cannot follow; and only PPO and the GRPO family read it."""
    if rl.max_tokens_per_micro_batch is None:
        return
    if rl.algorithm in ("dpo", "online_dpo"):
        raise ValueError(
            f"rl.max_tokens_per_micro_batch is read by ppo and the GRPO family, not by rl.algorithm {rl.algorithm!r}; "
            "unset it (the dpo section's micro-batches are rl.batch_size / rl.gradient_accumulation_steps pairs)"
        )
    if strategy is not None and strategy.startswith("zero"):
        raise ValueError(
            "rl.max_tokens_per_micro_batch makes the number of micro-batches vary by step, which DeepSpeed "
            f"({strategy}) cannot accumulate over; unset it or use DDP or FSDP"
        )


def group_batch_field(grpo: GRPOConfig) -> str:
    """The field that sets the group algorithms' generation batch here."""
    return "rl.batch_size" if grpo.generation_batch_size is None else "grpo.generation_batch_size"


def prompts_per_step(rl: RLConfig, grpo: GRPOConfig, run: RunConfig) -> tuple[int, str]:
    """(prompts one RL step takes over all processes, the fields that say so): for PPO rl.batch_size, for the
    group algorithms the generation batch over grpo.num_generations, for online DPO rl.batch_size / 2 (two
    completions each), for offline DPO the pairs of rl.batch_size."""
    per_process, fields = rl.batch_size, "rl.batch_size"
    if rl.algorithm == "online_dpo":
        per_process, fields = rl.batch_size // 2, "rl.batch_size / 2"
    elif rl.algorithm in GROUP_ALGORITHMS:
        per_process = grpo.generation_batch(rl.batch_size) // grpo.num_generations
        fields = f"{group_batch_field(grpo)} / grpo.num_generations"
    if run.num_processes > 1:
        fields += " x run.num_processes"
    return per_process * run.num_processes, fields


def check_group_family(
    rl: RLConfig, grpo: GRPOConfig, lora_enabled: bool, run: RunConfig, strategy: str | None
) -> None:
    """The grpo.* checks for a group algorithm; PPO reads no grpo.* field, and is refused the two that would change
    what it samples (dynamic sampling: it samples no groups; tools)."""
    if rl.algorithm in GROUP_ALGORITHMS:
        check_group_fields(rl, grpo)
        check_generation_batch(rl, grpo)
        check_group_rewards(rl, grpo)
        check_sync_ref_model(grpo, lora_enabled, run, strategy)
    elif grpo.dynamic_sampling.enabled:
        raise ValueError(
            f"grpo.dynamic_sampling drops groups of completions, which rl.algorithm {rl.algorithm!r} does not "
            f"sample; use one of {', '.join(GROUP_ALGORITHMS)} or turn grpo.dynamic_sampling.enabled off"
        )
    elif grpo.uses_tools:
        raise ValueError(
            f"grpo.tools and grpo.environment give the group algorithms' rollouts tools; rl.algorithm "
            f"{rl.algorithm!r} samples without them: use one of {', '.join(GROUP_ALGORITHMS)}"
        )


def check_group_fields(rl: RLConfig, grpo: GRPOConfig) -> None:
    """No grpo.* value the algorithm would never read; a reward clip range in order; whole micro-batches."""
    for name, algorithms in GROUP_FIELDS_FOR.items():  # a changed value the algorithm would never read
        if rl.algorithm not in algorithms and getattr(grpo, name) != GRPOConfig.model_fields[name].default:
            raise ValueError(
                f"grpo.{name} applies to rl.algorithm {' and '.join(algorithms)}, not "
                f"{rl.algorithm!r}; remove it (docs/algorithms.md lists what each algorithm reads)"
            )
    if grpo.reward_clip_range is not None and grpo.reward_clip_range[0] > grpo.reward_clip_range[1]:
        raise ValueError(f"grpo.reward_clip_range {list(grpo.reward_clip_range)} must be [low, high] with low <= high")
    if grpo.steps_per_generation is not None and grpo.steps_per_generation % rl.gradient_accumulation_steps:
        raise ValueError(
            f"grpo.steps_per_generation {grpo.steps_per_generation} must be a multiple of "
            f"rl.gradient_accumulation_steps {rl.gradient_accumulation_steps}"
        )


def check_generation_batch(rl: RLConfig, grpo: GRPOConfig) -> None:
    """The generation batch holds whole groups and splits into whole micro-batches."""
    batch, name = grpo.generation_batch(rl.batch_size), group_batch_field(grpo)
    if batch % grpo.num_generations:
        raise ValueError(f"{name} {batch} must be a multiple of grpo.num_generations {grpo.num_generations}")
    if grpo.steps_per_generation is not None and batch % grpo.steps_per_generation:
        raise ValueError(
            f"{name} {batch} (the generation batch) must be a multiple of "
            f"grpo.steps_per_generation {grpo.steps_per_generation}, the micro-batches it is split into"
        )
    if grpo.steps_per_generation is None and batch % rl.gradient_accumulation_steps:
        raise ValueError(
            f"{name} {batch} (the generation batch) must be a multiple of "
            f"rl.gradient_accumulation_steps {rl.gradient_accumulation_steps}, the micro-batches it is "
            "split into while grpo.steps_per_generation is null"
        )


def check_group_rewards(rl: RLConfig, grpo: GRPOConfig) -> None:
    """A missing-stop penalty needs a summed reward; grpo.delta needs a clipped loss."""
    if rl.missing_eos_penalty is not None and grpo.multi_objective_aggregation == "normalize_then_sum":
        raise ValueError(
            "rl.missing_eos_penalty is subtracted from the summed reward before group statistics, which "
            "grpo.multi_objective_aggregation 'normalize_then_sum' does not have; use 'sum_then_normalize' "
            "or add the penalty as a reward function"
        )
    if grpo.delta is not None and grpo.loss_type in ("cispo", "sapo"):
        raise ValueError(
            f"grpo.delta applies to the clipped losses (grpo, bnpo, dr_grpo, dapo), not loss_type '{grpo.loss_type}'"
        )


def check_preference_family(
    rl: RLConfig, dpo: DPOConfig, lora_enabled: bool, strategy: str | None, rollout: RolloutConfig
) -> None:
    """dpo.* only for DPO and online DPO; their batches in whole micro-batches (of whole pairs, online); TR-DPO's
    reference sync on a whole reference copy; no rollout engine for offline DPO, which samples nothing."""
    if rl.algorithm not in PREFERENCE_ALGORITHMS:
        default = DPOConfig()
        changed = [name for name in DPOConfig.model_fields if getattr(dpo, name) != getattr(default, name)]
        if changed:
            raise ValueError(
                f"dpo.{changed[0]} applies to rl.algorithm dpo and online_dpo, not {rl.algorithm!r}; remove it"
            )
        return
    if rl.algorithm == "dpo" and rollout.engine != "hf":
        raise ValueError(
            f"rollout.engine {rollout.engine!r} samples rollouts, and offline dpo trains on data.preference's pairs "
            "without sampling; use rollout.engine hf (or rl.algorithm online_dpo)"
        )
    if rl.batch_size % rl.gradient_accumulation_steps:
        raise ValueError(
            f"rl.batch_size {rl.batch_size} must be a multiple of rl.gradient_accumulation_steps "
            f"{rl.gradient_accumulation_steps}, the micro-batches a {rl.algorithm} step is split into"
        )
    if rl.algorithm == "online_dpo" and (rl.batch_size // rl.gradient_accumulation_steps) % 2:
        raise ValueError(
            f"rl.batch_size {rl.batch_size} / rl.gradient_accumulation_steps {rl.gradient_accumulation_steps} must "
            "be even: online_dpo samples two completions per prompt and trains on each pair in one micro-batch"
        )
    if rl.algorithm == "online_dpo" and dpo.precompute_ref_log_probs:
        raise ValueError(
            "dpo.precompute_ref_log_probs needs the pairs before training, but online_dpo samples new ones every "
            "step; turn it off"
        )
    if dpo.sync_ref_model and lora_enabled:
        raise ValueError(
            "dpo.sync_ref_model needs a reference copy to mix into, but with model.lora.enabled the reference is "
            "the policy with its adapters disabled"
        )
    if dpo.sync_ref_model and strategy in SHARDED:
        raise ValueError("dpo.sync_ref_model mixes whole weights, which the accelerate config shards; use ddp.yaml")


def check_sync_ref_model(grpo: GRPOConfig, lora_enabled: bool, run: RunConfig, strategy: str | None) -> None:
    """Syncing the reference mixes whole policy weights into a reference copy that exists."""
    if not grpo.sync_ref_model:
        return
    if grpo.beta == 0:
        raise ValueError("grpo.sync_ref_model needs a reference model, but grpo.beta is 0 so none is loaded")
    if lora_enabled:
        raise ValueError(
            "grpo.sync_ref_model needs a reference copy to mix into, but with model.lora.enabled the "
            "reference is the policy with its adapters disabled"
        )
    if strategy in SHARDED:
        raise ValueError(
            f"grpo.sync_ref_model mixes whole weights, which run.accelerate_config "
            f"{run.accelerate_config} shards; use ddp.yaml or deepspeed_zero2.yaml"
        )


# evaluation, guard and promotion columns ----------------------------------------------------


def check_eval_columns(names: list[str], verifier: str | None, evaluation: EvalConfig, guard: GuardConfig) -> None:
    """guard.divergence.gold and eval.verifier (when sampling) name columns the evaluation has: `names`, the eval
    metrics' columns (`PipelineConfig.metric_names`)."""
    if guard.divergence.gold is not None and guard.divergence.gold not in names:
        allowed = ", ".join(repr(n) for n in names) or "none (eval.metrics is empty)"
        raise ValueError(f"guard.divergence.gold {guard.divergence.gold!r} is not an eval metric; allowed: {allowed}")
    if evaluation.samples_per_prompt > 1 and verifier not in names:
        allowed = ", ".join(repr(n) for n in names if n not in evaluation.sampled_columns()) or "none"
        raise ValueError(
            f"eval.samples_per_prompt {evaluation.samples_per_prompt} counts correct completions with "
            f"eval.verifier {verifier!r}, which is not an eval metric; allowed: {allowed}"
        )


# the rollout engine ------------------------------------------------------------------------


def check_rollout_engine(rl: RLConfig, grpo: GRPOConfig, rollout: RolloutConfig, run: RunConfig) -> None:
    """The correction's bounds in order; rloo's loss is one ratio per sequence, so its correction is per sequence;
    generation ahead only where it is built (`check_ahead`)."""
    c = rollout.correction
    if c.min is not None and c.cap is not None and c.min > c.cap:
        raise ValueError(f"rollout.correction.min {c.min} must not exceed rollout.correction.cap {c.cap}")
    if rollout.off_policy and rl.algorithm == "rloo" and c.mode.startswith("token"):
        raise ValueError(
            f"rollout.correction.mode {c.mode!r} weighs tokens, but rloo's loss has one ratio per sequence; "
            "use sequence_truncate, sequence_mask or none"
        )
    if rollout.max_staleness:
        check_ahead(rl, grpo, rollout, run)


def check_ahead(rl: RLConfig, grpo: GRPOConfig, rollout: RolloutConfig, run: RunConfig) -> None:
    """rollout.max_staleness > 0 runs the GRPO family in one process, without dynamic sampling's extra rounds or
    evaluations on the engine (both would sample beside the generator)."""
    k = f"rollout.max_staleness {rollout.max_staleness}"
    if rl.algorithm not in GROUP_ALGORITHMS:
        raise ValueError(f"{k} runs generation ahead for the GRPO family; rl.algorithm {rl.algorithm!r} needs 0")
    if run.num_processes > 1:
        raise ValueError(f"{k} runs in one process; set run.num_processes to 1 or rollout.max_staleness to 0")
    if grpo.dynamic_sampling.enabled:
        raise ValueError(
            f"{k} samples each step's groups ahead, so grpo.dynamic_sampling cannot refill them; turn one off"
        )
    if rollout.engine == "vllm" and rollout.vllm.evaluate:
        raise ValueError(f"{k} keeps the vLLM server busy ahead of training; set rollout.vllm.evaluate to false")
