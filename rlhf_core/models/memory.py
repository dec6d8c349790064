"""The peak memory per device of the training a `PipelineConfig` describes, estimated from the models' shapes
and what their passes keep per token (`rlhf_core.models.shapes`: from their configs, never their weights) and the
batch sizes, before anything trains.

A stage holds all along the weights of every model it keeps, AdamW's two moments of the trained parameters and
the runtime (CUDA's context; on CPU the resident torch and transformers), and at its peak the largest of what
comes and goes: the update (gradients, the activations of the largest micro-batch, one chunk of logits),
generation (the decode loop's KV cache) or a forward without gradients (prefill, scoring, evaluation). Checked on
this repository's CPU against measured peaks: bench/studies/memory_estimate.py, docs/distributed.md#what-fits-where.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.config import GROUP_ALGORITHMS, PipelineConfig, accelerate_strategy
from rlhf_core.models.shapes import (
    DTYPE_BYTES,
    ModelShape,
    Precision,
    ShapeReader,
    activation_bytes,
    kv_cache_bytes,
    logits_bytes,
    logits_chunk_tokens,
    no_grad_bytes,
)

GIB = 2**30
CPU_RUNTIME_BYTES = 0.38 * GIB  # torch, transformers and the training stack imported: measured on this CPU
CUDA_CONTEXT_BYTES = 1.0 * GIB  # the CUDA context, cuBLAS workspaces and the allocator's slack (not measured here)
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, each in the parameter's dtype (torch's AdamW: zeros_like)
LORA_BYTES = 4  # PEFT keeps adapters in float32 (autocast_adapter_dtype) whatever the base's dtype


@dataclass(frozen=True)
class Part:
    name: str
    bytes: float


@dataclass(frozen=True)
class StageEstimate:
    """One stage's memory: `held` all along, `phases` what comes and goes (the update, generation, a pass
    without gradients); its peak is the held parts and the largest phase."""

    stage: str
    held: tuple[Part, ...]
    phases: dict[str, tuple[Part, ...]]

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: sum(p.bytes for p in self.phases[name]))

    @property
    def parts(self) -> tuple[Part, ...]:
        """The parts at the peak, largest first."""
        return tuple(sorted(self.held + self.phases[self.peak_phase], key=lambda p: -p.bytes))

    @property
    def total(self) -> float:
        return sum(p.bytes for p in self.parts)

    def phase_total(self, name: str) -> float:
        return sum(p.bytes for p in self.held + self.phases[name])


@dataclass(frozen=True)
class MemoryEstimate:
    """Every stage's estimate on `device` ('cpu' or 'cuda'); `unknown`: what could not be counted, one phrase
    each (a model not readable offline); no stages when the policy's shape itself is unknown."""

    device: str
    stages: tuple[StageEstimate, ...]
    unknown: tuple[str, ...] = ()

    @property
    def peak(self) -> StageEstimate | None:
        return max(self.stages, key=lambda s: s.total) if self.stages else None


def device_kind(device: str) -> str:
    """run.device as 'cpu' or 'cuda'; 'auto' is CUDA where torch (when loaded) or the NVIDIA driver says so."""
    if device != "auto":
        return device
    torch = sys.modules.get("torch")
    if torch is not None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if Path("/proc/driver/nvidia/version").exists() else "cpu"


def runtime_part(device: str) -> Part:
    if device == "cuda":
        return Part("CUDA context", CUDA_CONTEXT_BYTES)
    return Part("runtime (torch, transformers)", CPU_RUNTIME_BYTES)


@dataclass(frozen=True)
class Trained:
    """What a stage's optimizer trains: the bytes of its parameters, and the processes that share their optimizer
    state, gradients and weights (ZeRO, FSDP: `shards_of`)."""

    bytes: float
    shards: dict[str, int]

    def held(self) -> tuple[Part, ...]:
        return (Part("AdamW state", ADAM_MOMENTS * self.bytes / self.shards["optimizer"]),)

    def gradients(self) -> Part:
        return Part("gradients", self.bytes / self.shards["gradients"])


def strategy_of(cfg: PipelineConfig) -> str | None:
    """run.accelerate_config's strategy ('ddp', 'zero1'..'zero3', 'fsdp') when it launches several processes."""
    if cfg.run.num_processes == 1 or cfg.run.accelerate_config is None:
        return None
    try:
        return accelerate_strategy(cfg.run.accelerate_config)
    except ValueError:
        return None


def shards_of(cfg: PipelineConfig) -> dict[str, int]:
    """How many processes share the trained model's optimizer state, gradients and weights under
    run.accelerate_config's strategy (ZeRO-1, -2, -3, FSDP); 1 each without sharding."""
    n = cfg.run.num_processes
    level = {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "fsdp1": 3}.get(strategy_of(cfg) or "", 0)
    return {"optimizer": n if level >= 1 else 1, "gradients": n if level >= 2 else 1, "weights": n if level >= 3 else 1}


NOT_SHARDED = {"optimizer": 1, "gradients": 1, "weights": 1}


def precision_of(cfg: PipelineConfig, shape: ModelShape) -> Precision:
    weights = DTYPE_BYTES[shape.dtype]
    return Precision(weights, autocast=cfg.run.mixed_precision != "no" and weights == 4)


def is_group(cfg: PipelineConfig) -> bool:
    return cfg.rl.algorithm in GROUP_ALGORITHMS


@dataclass(frozen=True)
class RLSequences:
    """The RL stage's sequences: tokens of a prompt and of a response, the completions decoded at once (0: none
    here), the prompts prefilled at once, the sequences of the largest micro-batch and of an evaluation batch."""

    prompt: int
    response: int
    generation: int
    prefill: int
    micro: int
    evaluation: int

    @property
    def length(self) -> int:
        return self.prompt + self.response


def rl_sequences(cfg: PipelineConfig) -> RLSequences:
    """The micro-batch as the trainers cut it (rlhf_core/rl: grpo_batch_sizes, ppo_batch_sizes; online DPO: groups
    of two, one optimizer step; offline DPO: pairs, chosen and rejected in one forward), or under
    rl.max_tokens_per_micro_batch as many of an optimizer step's completions as the budget holds at full length
    (one at least: `rlhf_core.data.batching.micro_batch_plan`); the budget bounds the rows decoded at once too, in
    whole groups."""
    rl, data, algorithm = cfg.rl, cfg.data, cfg.rl.algorithm
    prompt = data.max_prompt_length
    response = data.max_length - prompt if algorithm == "dpo" else rl.response_length
    group = cfg.grpo.num_generations if is_group(cfg) else 2 if algorithm == "online_dpo" else 1  # per prompt
    if is_group(cfg):
        generation = cfg.grpo.generation_batch(rl.batch_size)
        per_generation = cfg.grpo.steps_per_generation or rl.gradient_accumulation_steps
        mini, micro = (
            generation // max(1, per_generation // rl.gradient_accumulation_steps),
            generation // per_generation,
        )
    elif algorithm == "ppo":
        generation, mini = rl.batch_size, rl.batch_size // cfg.ppo.num_mini_batches
        micro = mini // rl.gradient_accumulation_steps
    else:
        generation = rl.batch_size if algorithm == "online_dpo" else 0
        mini = micro = rl.batch_size // rl.gradient_accumulation_steps * (2 if algorithm == "dpo" else 1)
    micro, cap = max(1, micro), rl.max_tokens_per_micro_batch
    if cap is not None:
        micro = max(1, min(mini, cap // (prompt + response)))
        generation = min(generation, max(1, cap // ((prompt + response) * group)) * group)
    if cfg.rollout.engine == "vllm":  # the server decodes, in its own memory
        generation = 0
    evaluation = 0 if cfg.rollout.engine == "vllm" and cfg.rollout.vllm.evaluate else cfg.eval.batch_size
    return RLSequences(prompt, response, generation, generation // group, micro, min(evaluation, cfg.eval.num_prompts))


def reference_kind(cfg: PipelineConfig) -> str:
    """As the init stage decides it (tasks/stages/initialization.py): 'copy', 'adapter_disabled' or 'none'."""
    if is_group(cfg) and cfg.grpo.beta == 0:
        return "none"
    if cfg.rl.algorithm in ("dpo", "online_dpo") and cfg.dpo.reference_free:
        return "none"
    if cfg.init.reference == "auto":
        return "adapter_disabled" if cfg.model.lora.enabled else "copy"
    return cfg.init.reference


def frozen_models(cfg: PipelineConfig, policy: ModelShape, shapes, not_counted: list[str]) -> list[Part]:
    """The weights the RL stage holds without training them: the reference (with none for the loss, the copy the
    evaluations measure their KL to), PPO's reward model, the in-process reward models of grpo.rewards."""
    weights = policy.parameters * DTYPE_BYTES[policy.dtype]
    kind = reference_kind(cfg)
    parts = [Part("reference weights", weights)] if kind == "copy" else []
    if kind == "none":
        parts.append(Part("reference weights (evaluations' KL)", weights))
    named = []
    if cfg.rl.algorithm == "ppo":
        named.append(("reward model weights", reward_shape(cfg, shapes, policy)))
    elif cfg.rl.algorithm != "dpo":
        for i, r in enumerate(cfg.grpo.rewards):
            if r.kind is None and r.model is not None:
                shape = (
                    reward_shape(cfg, shapes, policy)
                    if r.model == "reward_stage"
                    else shapes(r.model, f"grpo.rewards[{i}].model")
                )
                named.append((f"reward model weights ({r.name})", shape))
    for name, shape in named:
        if isinstance(shape, str):
            not_counted.append(shape)
        else:
            parts.append(Part(name, shape.classifier_parameters * DTYPE_BYTES[shape.dtype]))
    return parts


def rl_stage(cfg: PipelineConfig, policy: ModelShape, shapes, device: str, not_counted: list[str]) -> StageEstimate:
    """The RL stage: the policy (LoRA: its adapters trained), what frozen_models names, PPO's value model
    (trained whole); its update, its generation and its passes without gradients."""
    precision, seq, shards = precision_of(cfg, policy), rl_sequences(cfg), shards_of(cfg)
    lora = cfg.model.lora.enabled
    held = [Part("policy weights", policy.parameters * precision.weights / shards["weights"]), runtime_part(device)]
    held += frozen_models(cfg, policy, shapes, not_counted)
    trained = policy.lora_parameters(cfg.model.lora) * LORA_BYTES if lora else policy.parameters * precision.weights
    copies = 0 if lora else policy.parameters  # trained weights that autocast keeps a 16-bit copy of
    tokens = seq.micro * seq.length
    activations = activation_bytes(policy, precision, tokens, cfg.model.checkpointing)
    if lora:
        held.append(Part("LoRA adapters", trained))
    if cfg.rl.algorithm == "ppo":
        value = policy if cfg.init.value_from == "policy" else reward_shape(cfg, shapes, policy)
        if isinstance(value, str):
            not_counted.append(value)
        else:
            value_bytes = value.classifier_parameters * DTYPE_BYTES[value.dtype]
            held.append(Part("value model weights", value_bytes / shards["weights"]))
            trained, copies = trained + value_bytes, copies + value.classifier_parameters
            activations += activation_bytes(value, precision_of(cfg, value), tokens, cfg.model.checkpointing)
    state, chunked = Trained(trained, shards), shards["weights"] == 1  # ZeRO-3, FSDP: the head runs in the forward
    update = [
        state.gradients(),
        Part(f"activations ({seq.micro} x {seq.length} tokens)", activations),
        Part(
            "logits chunk" if chunked else "logits (whole: the head is sharded)",
            logits_bytes(policy, seq.micro * seq.response, chunked=chunked),
        ),
    ]
    if precision.autocast and copies:
        update.append(Part("autocast weight copies", copies * 2 / shards["weights"]))
    decoded = max(seq.generation, seq.evaluation)
    kl_rows = -(-logits_chunk_tokens() // seq.response)  # evaluation's exact KL: one chunk of positions at a time
    widest = max(seq.prefill * seq.prompt, min(seq.evaluation, kl_rows) * seq.length, tokens)
    phases = {
        "update": tuple(update),
        "generation": (
            Part(
                f"KV cache ({decoded} x {seq.length} tokens)",
                kv_cache_bytes(policy, decoded, seq.length, precision.activations),
            ),
        ),
        "forward without gradients": (
            Part(f"forward without gradients ({widest} tokens)", no_grad_bytes(policy, precision, widest)),
            Part("logits chunk", logits_bytes(policy, widest)),
        ),
    }
    return StageEstimate(f"rl ({cfg.rl.algorithm})", tuple(held) + state.held(), phases)


def trained_stage(stage: str, cfg: PipelineConfig, shape: ModelShape, device: str, batch: tuple[int, int, float]):
    """A stage that trains one model and generates nothing (sft: the policy; reward: a sequence classifier), on
    `batch` = (sequences of a micro-batch, tokens each, bytes of the trained parameters); SFT's loss takes the
    whole logits."""
    sequences, tokens, trained = batch
    precision, shards = precision_of(cfg, shape), shards_of(cfg) if stage == "reward" else NOT_SHARDED
    model, parameters = (
        ("policy", shape.parameters) if stage == "sft" else ("reward model", shape.classifier_parameters)
    )
    state = Trained(trained, shards)
    held = (Part(f"{model} weights", parameters * precision.weights / shards["weights"]), runtime_part(device))
    activations = activation_bytes(shape, precision, sequences * tokens, cfg.model.checkpointing)
    update = [state.gradients(), Part(f"activations ({sequences} x {tokens} tokens)", activations)]
    if stage == "sft":
        update.append(Part("logits (whole)", logits_bytes(shape, sequences * tokens, chunked=False)))
    return StageEstimate(stage, held + state.held(), {"update": tuple(update)})


def sft_stage(cfg: PipelineConfig, policy: ModelShape, device: str) -> StageEstimate:
    """SFT: the policy trained whole on sft.batch_size sequences of data.max_length tokens (one process)."""
    trained = policy.parameters * DTYPE_BYTES[policy.dtype]
    return trained_stage("sft", cfg, policy, device, (cfg.sft.batch_size, cfg.data.max_length, trained))


def reward_stage(cfg: PipelineConfig, shape: ModelShape, device: str) -> StageEstimate:
    """Reward training: a sequence classifier (reward.lora: adapters and its score head) on reward.batch_size
    pairs, chosen and rejected in one forward."""
    if cfg.reward.lora:
        trained = (shape.lora_parameters(cfg.model.lora) + shape.hidden) * LORA_BYTES
    else:
        trained = shape.classifier_parameters * DTYPE_BYTES[shape.dtype]
    return trained_stage("reward", cfg, shape, device, (2 * cfg.reward.batch_size, cfg.data.max_length, trained))


def estimate_memory(cfg: PipelineConfig, shapes: ShapeReader | None = None) -> MemoryEstimate:
    """The peak memory per device of each stage `cfg` runs that trains: SFT (when it runs), the reward model
    (when the reward stage runs) and the RL stage. `shapes`: the models' shapes (read offline from `cfg`'s sources
    when None)."""
    shapes = shapes or ShapeReader(cfg.model, cfg.run.output_dir / "demo_world", cfg.data.demo.world)
    device = device_kind(cfg.run.device)
    policy = shapes(cfg.model.base, "model.base")
    if isinstance(policy, str):
        return MemoryEstimate(device, (), (policy,))
    not_counted: list[str] = []
    stages = [rl_stage(cfg, policy, shapes, device, not_counted)]
    if cfg.trains_reward_model():
        reward = reward_shape(cfg, shapes, policy)
        if isinstance(reward, str):
            not_counted.append(reward)
        else:
            stages.insert(0, reward_stage(cfg, reward, device))
    if cfg.sft.enabled:
        stages.insert(0, sft_stage(cfg, policy, device))
    if cfg.rollout.engine == "vllm" or cfg.rollout.max_staleness > 0:
        not_counted.append(
            "the generator apart (rollout.engine vllm or rollout.max_staleness > 0) holds its own memory"
        )
    return MemoryEstimate(device, tuple(stages), tuple(dict.fromkeys(not_counted)))


def reward_shape(cfg: PipelineConfig, shapes, policy: ModelShape) -> ModelShape | str:
    """The reward stage's model: reward.base, 'policy' being the policy's shape."""
    return policy if cfg.reward.base == "policy" else shapes(cfg.reward.base, "reward.base")
