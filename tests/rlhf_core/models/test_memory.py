"""rlhf_core/models/memory.py: the peak-memory estimate's parts pinned by hand (weights, gradients, AdamW, their
shards), the micro-batches as the trainers cut them, what each algorithm holds, and the peak of stages and phases
(the per-token arithmetic: test_shapes.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.config import load_config
from rlhf_core.data.batching import micro_batch_plan
from rlhf_core.models import memory
from rlhf_core.models.memory import GIB, estimate_memory, rl_sequences
from rlhf_core.models.shapes import llama_shape

REPO = Path(__file__).resolve().parents[3]
# Qwen2.5-0.5B's public shape: hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151936, tied
QWEN_05B = llama_shape(151936, 896, 24, 14, 2, 4864, attention_bias=True)


# the batches whole, as before micro-batches of 8 became the default outside the demo: the hand-computed figures
WHOLE = ["sft.batch_size=32", "reward.batch_size=32", "rl.gradient_accumulation_steps=1"]


def config(*overrides: str):
    return load_config(None, ["model.base=/models/qwen", "run.device=cuda", *WHOLE, *overrides])


def estimate(*overrides: str, shape=QWEN_05B):
    return estimate_memory(config(*overrides), shapes=lambda source, field: shape)


def parts(stage) -> dict[str, float]:
    """Every part of a stage, held and of each phase, by name."""
    return {p.name: p.bytes for p in stage.held} | {p.name: p.bytes for ps in stage.phases.values() for p in ps}


def rl_parts(*overrides: str, shape=QWEN_05B) -> dict[str, float]:
    return parts(next(s for s in estimate(*overrides, shape=shape).stages if s.stage.startswith("rl")))


@pytest.mark.parametrize(
    "overrides",
    [
        ["rl.algorithm=grpo"],
        ["rl.algorithm=grpo", "rl.batch_size=48", "grpo.num_generations=4", "grpo.steps_per_generation=6"],
        ["rl.algorithm=rloo", "grpo.generation_batch_size=64", "rl.gradient_accumulation_steps=4"],
        ["rl.algorithm=ppo", "rl.batch_size=64", "ppo.num_mini_batches=2", "rl.gradient_accumulation_steps=4"],
    ],
)
def test_the_micro_batch_is_the_trainers(overrides):
    from rlhf_core.rl.grpo import grpo_batch_sizes
    from rlhf_core.rl.ppo import ppo_batch_sizes

    cfg = config(*overrides)
    sizes = ppo_batch_sizes(cfg.rl, cfg.ppo) if cfg.rl.algorithm == "ppo" else grpo_batch_sizes(cfg.rl, cfg.grpo)
    seq = rl_sequences(cfg)
    assert seq.micro == sizes.micro_batch and seq.generation == sizes.rollout
    assert seq.prefill == sizes.prompts_per_step and seq.length == 512 + 256


def test_a_token_budget_sets_the_micro_batch_and_the_decoded_rows_in_whole_groups():
    cfg = config("rl.algorithm=grpo", "rl.gradient_accumulation_steps=4")  # 32 completions (4 groups of 8), 8 each
    for budget, micro, decoded in ((None, 8, 32), (40000, 32, 32), (20000, 26, 24), (4000, 5, 8), (100, 1, 8)):
        seq = rl_sequences(
            cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"max_tokens_per_micro_batch": budget})})
        )
        assert (seq.micro, seq.generation, seq.prefill) == (micro, decoded, decoded // 8)
        # the trainers' plan of one optimizer step's 32 completions, each at full length
        assert max(len(m) for m in micro_batch_plan([768] * 32, 8, budget)) == micro


def test_what_each_algorithm_holds():
    weights = QWEN_05B.parameters * 4
    grpo = rl_parts("rl.algorithm=grpo")  # beta 0: no reference for the loss, a copy for the evaluations' KL
    assert grpo["reference weights (evaluations' KL)"] == weights and "reference weights" not in grpo
    assert grpo["reward model weights (reward_model)"] == QWEN_05B.classifier_parameters * 4  # this run's
    assert grpo["AdamW state"] == 2 * weights and grpo["gradients"] == weights
    with_kl = rl_parts("rl.algorithm=grpo", "grpo.beta=0.04")
    assert with_kl["reference weights"] == weights
    lora = rl_parts("rl.algorithm=grpo", "grpo.beta=0.04", "model.lora.enabled=true")
    adapters = QWEN_05B.lora_parameters(config().model.lora) * 4  # float32 adapters
    assert "reference weights" not in lora and lora["LoRA adapters"] == adapters  # the disabled adapters
    assert lora["AdamW state"] == 2 * adapters and lora["gradients"] == adapters
    ppo = rl_parts("rl.algorithm=ppo")
    value = QWEN_05B.classifier_parameters * 4
    assert ppo["reference weights"] == weights and ppo["reward model weights"] == ppo["value model weights"] == value
    assert ppo["AdamW state"] == 2 * (weights + value)  # the value model trains whole, beside the policy
    assert ppo["activations (32 x 768 tokens)"] > grpo["activations (32 x 768 tokens)"]


def test_rewards_served_elsewhere_or_computed_hold_no_model():
    served = "grpo.rewards=[{name: rm, kind: reward_model, url: 'http://host:1/invocations'}]"
    function = "grpo.rewards=[{name: f, function: 'rlhf_core.rewards.functions:vader_compound'}]"
    for rewards in (served, function):
        held = estimate("rl.algorithm=grpo", rewards)
        assert [s.stage for s in held.stages] == ["rl (grpo)"]  # no reward stage either
        assert not any(name.startswith("reward model") for name in parts(held.stages[0]))


def test_bf16_halves_weights_and_activations_and_autocast_keeps_fp32_weights():
    bf16 = estimate_memory(
        config("rl.algorithm=grpo"), shapes=lambda s, f: llama_shape(151936, 896, 24, 14, 2, 4864, dtype="bfloat16")
    )
    fp32 = estimate_memory(config("rl.algorithm=grpo"), shapes=lambda s, f: llama_shape(151936, 896, 24, 14, 2, 4864))
    a, b = parts(bf16.stages[-1]), parts(fp32.stages[-1])
    assert (
        a["policy weights"] * 2 == b["policy weights"]
        and a["KV cache (64 x 768 tokens)"] * 2 == b["KV cache (64 x 768 tokens)"]
    )
    autocast = rl_parts("rl.algorithm=grpo", "run.mixed_precision=bf16")
    assert autocast["policy weights"] == QWEN_05B.parameters * 4
    assert autocast["autocast weight copies"] == QWEN_05B.parameters * 2
    assert autocast["activations (32 x 768 tokens)"] < rl_parts("rl.algorithm=grpo")["activations (32 x 768 tokens)"]


def test_zero_shards_the_optimizer_state_and_gradients():
    zero2 = REPO / "configs" / "accelerate" / "deepspeed_zero2.yaml"
    deepspeed = ["rl.max_nonfinite_steps_in_a_row=0", "reward.max_nonfinite_steps_in_a_row=0"]
    sharded = rl_parts("rl.algorithm=grpo", "run.num_processes=4", f"run.accelerate_config={zero2}", *deepspeed)
    whole = rl_parts("rl.algorithm=grpo")
    assert sharded["AdamW state"] * 4 == whole["AdamW state"] and sharded["gradients"] * 4 == whole["gradients"]
    assert sharded["policy weights"] == whole["policy weights"]


def test_the_peak_is_the_largest_stage_and_its_largest_phase():
    result = estimate("rl.algorithm=ppo", "sft.enabled=true")
    assert [s.stage for s in result.stages] == ["sft", "reward", "rl (ppo)"]
    assert result.peak.total == max(s.total for s in result.stages)
    sft = result.stages[0]  # the SFT loss takes the whole logits: 32 x 1024 tokens x the vocabulary
    assert parts(sft)["logits (whole)"] == 3 * 32 * 1024 * 151936 * 4
    rl = result.stages[-1]
    assert rl.total == max(rl.phase_total(name) for name in rl.phases)
    assert parts(rl)["CUDA context"] == memory.CUDA_CONTEXT_BYTES and result.device == "cuda"


def test_an_unknown_policy_leaves_no_estimate_and_says_why():
    result = estimate_memory(config(), shapes=lambda source, field: f"{field} {source} is unknown")
    assert result.stages == () and result.peak is None and result.unknown == ("model.base /models/qwen is unknown",)


def test_the_demo_s_estimate_imports_no_torch():
    script = (
        "import sys\n"
        "from rlhf_core.config import load_config\n"
        "from rlhf_core.models.memory import estimate_memory\n"
        "peak = estimate_memory(load_config(None, ['run.device=cpu'])).peak\n"
        "print(peak.total > 0, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    ran = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert ran.stdout.split() == ["True", "False", "False"]
    assert memory.runtime_part("cpu").bytes == memory.CPU_RUNTIME_BYTES < GIB
