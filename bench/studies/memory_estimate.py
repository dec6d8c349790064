"""The peak-memory estimate (rlhf_core/models/memory.py, printed by `rlhf validate`) against measured peaks, and
the table of docs/distributed.md#what-fits-where.

    python -m bench.studies.memory_estimate            # every case measured in a fresh process (15 minutes here)
    python -m bench.studies.memory_estimate table      # the tables only, and the H200 run estimated (seconds)
    python -m bench.studies.memory_estimate estimate   # results/memory_estimate.json's measurements estimated again

Measured: the peak resident set (ru_maxrss) of a fresh process that trains two GRPO steps with `train_grpo` on a
Qwen2.5-shaped body (hidden 896, 14 heads, 2 KV heads, MLP 4864, tied, random weights) of 2 or 4 layers, with the
real 151,936-token vocabulary or the offline fixture tokenizer's 512, with and without gradient checkpointing;
4 prompts of 200 tokens x 4 completions of 64 (no stop token: every completion runs to 64) in one micro-batch,
beside a frozen copy of the policy (the copy the RL stage keeps for its evaluations' KL when grpo.beta is 0).
On CPU the runtime (torch, transformers, the training stack) is resident too, and counted by the estimate. The H200
run of bench/studies/gpu_real_sizes.py is estimated beside its measured peaks. Writes results/memory_estimate.md
and .json; the check is |estimate / measured - 1| <= 25% for every case.
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
PROMPT, RESPONSE, PROMPTS, GENERATIONS = 200, 64, 4, 4
QWEN_VOCAB, FIXTURE_VOCAB = 151936, 512
TOLERANCE = 0.25
# name -> (vocabulary, layers, gradient checkpointing, run.mixed_precision)
CASES = {
    "real vocab, 2 layers": (QWEN_VOCAB, 2, False, "no"),
    "real vocab, 2 layers, checkpointing": (QWEN_VOCAB, 2, True, "no"),
    "small vocab, 4 layers": (FIXTURE_VOCAB, 4, False, "no"),
    "small vocab, 4 layers, checkpointing": (FIXTURE_VOCAB, 4, True, "no"),
    "small vocab, 4 layers, bf16 autocast": (FIXTURE_VOCAB, 4, False, "bf16"),
}
# Qwen2.5's public shapes (config.json of Qwen/Qwen2.5-{0.5B,1.5B,7B}): hidden, layers, heads, KV heads, MLP,
# vocabulary, tied embeddings
QWEN = {
    "Qwen2.5-0.5B": (896, 24, 14, 2, 4864, 151936, True),
    "Qwen2.5-1.5B": (1536, 28, 12, 2, 8960, 151936, True),
    "Qwen2.5-7B": (3584, 28, 28, 4, 18944, 152064, False),
}
DEVICES_GIB = (24, 80, 141)


def qwen_shape(hidden, layers, heads, kv_heads, intermediate, vocab, tied, dtype="float32"):
    from rlhf_core.models.shapes import llama_shape

    return llama_shape(
        vocab, hidden, layers, heads, kv_heads, intermediate, tied=tied, attention_bias=True, dtype=dtype
    )


def estimated(shape, **sections):
    """The estimate for a config of `sections` (dicts by section) on `shape`, model.base standing for it."""
    from rlhf_core.config import PipelineConfig
    from rlhf_core.models.memory import estimate_memory

    sections.setdefault("model", {}).setdefault("base", "/calibration/model")
    cfg = PipelineConfig.model_validate(sections)
    return estimate_memory(cfg, shapes=lambda source, field: shape)


def case_estimate(name: str):
    vocab, layers, checkpointing, precision = CASES[name]
    shape = qwen_shape(896, layers, 14, 2, 4864, vocab, True)
    return estimated(
        shape,
        run={"device": "cpu", "mixed_precision": precision},
        model={"gradient_checkpointing": checkpointing},
        data={"max_prompt_length": PROMPT, "max_length": PROMPT + RESPONSE + 1},
        rl={
            "algorithm": "grpo",
            "batch_size": PROMPTS * GENERATIONS,
            "response_length": RESPONSE,
            "gradient_accumulation_steps": 1,
        },
        grpo={
            "num_generations": GENERATIONS,
            "rewards": [{"name": "short", "function": "bench.studies.gpu_real_sizes:short_mentions"}],
        },
        eval={"batch_size": PROMPTS * GENERATIONS},
    )


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def measure(name: str) -> dict:
    """Train the case in this process (a fresh one) and return its peak resident set."""
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from bench.studies.gpu_real_sizes import short_mentions
    from rlhf_core.config import GRPOConfig, RLConfig, RunConfig
    from rlhf_core.models.loading import prepare_for_training
    from rlhf_core.rewards.sources import function_reward
    from rlhf_core.rl.grpo import train_grpo
    from rlhf_core.rl.inputs import rl_inputs
    from tests.fixtures.real_shapes import build_tokenizer, family
    from tests.fixtures.team_data import user_text

    vocab, layers, checkpointing, precision = CASES[name]
    torch.set_num_threads(2)
    tokenizer = build_tokenizer(family("qwen2.5-instruct"))
    tokenizer.model_max_length = 32768
    rng = random.Random(0)
    rows = [{"prompt": user_text(rng, tokenizer, PROMPT + 100)} for _ in range(PROMPTS)]
    baseline = rss_gib()
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6,
    )  # fmt: skip
    torch.manual_seed(0)
    policy, reference = Qwen2ForCausalLM(config), Qwen2ForCausalLM(config)
    policy.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id)
    prepare_for_training(policy, gradient_checkpointing=checkpointing)
    lengths: list[float] = []
    train_grpo(
        rl_inputs(
            policy,
            tokenizer,
            rows,
            tempfile.mkdtemp(),
            reference=reference,
            rewards=[function_reward("short", 1.0, short_mentions)],
            rl=RLConfig(algorithm="grpo", total_steps=2, batch_size=PROMPTS * GENERATIONS, response_length=RESPONSE, learning_rate=1e-6, save_steps=100, stop_token="none", temperature=1.0),
            grpo=GRPOConfig(num_generations=GENERATIONS),
            run=RunConfig(device="cpu", mixed_precision=precision, seed=0),
            max_prompt_length=PROMPT,
            stop_token_ids=[],
            on_log=lambda metrics, step: lengths.append(float(metrics["completions/mean_length"])),
        )
    )  # fmt: skip
    return {"case": name, "peak_gib": rss_gib(), "runtime_gib": baseline, "mean_length": lengths}


def calibration(saved: list[dict] | None = None) -> list[dict]:
    """Each case measured in a fresh process (or `saved`'s measurements, estimated again) beside its estimate."""
    rows = []
    for name in CASES:
        if saved is None:
            ran = subprocess.run(
                [sys.executable, "-m", "bench.studies.memory_estimate", "measure", name],
                cwd=REPO, capture_output=True, text=True, check=True,
            )  # fmt: skip
            result = json.loads(ran.stdout.strip().splitlines()[-1])
        else:
            result = next(r for r in saved if r["case"] == name)
        peak = case_estimate(name).peak
        result.update(estimate_gib=peak.total / 2**30, parts={p.name: p.bytes / 2**30 for p in peak.parts})
        result["error"] = result["estimate_gib"] / result["peak_gib"] - 1
        print(f"{name}: estimated {result['estimate_gib']:.2f} GiB, measured {result['peak_gib']:.2f} GiB "
              f"({result['error']:+.0%}), runtime {result['runtime_gib']:.2f} GiB, lengths {result['mean_length']}", flush=True)  # fmt: skip
        rows.append(result)
    return rows


def gpu_check() -> list[dict]:
    """The H200 run of docs/distributed.md#what-has-run-where (bench/studies/gpu_real_sizes.py, 2026-11-27), estimated:
    the 0.5B-shaped body with the 512-token vocabulary, 64 completions of up to 188 + 256 tokens in one micro-batch,
    no checkpointing, no reference; torch.cuda.max_memory_allocated, which leaves out the CUDA context."""
    shape, rows = qwen_shape(896, 24, 14, 2, 4864, FIXTURE_VOCAB, True), []
    for precision, measured in (("no", 77.9), ("bf16", 49.7)):
        peak = estimated(
            shape,
            run={"device": "cuda", "mixed_precision": precision},
            model={"gradient_checkpointing": False},
            data={"max_prompt_length": 188, "max_length": 188 + 256 + 1},
            rl={"algorithm": "grpo", "batch_size": 64, "gradient_accumulation_steps": 1},
            grpo={"num_generations": 8, "rewards": [{"name": "short", "function": "bench.studies.gpu_real_sizes:short_mentions"}]},
            eval={"batch_size": 64},
        ).peak  # fmt: skip
        left_out = ("CUDA context", "reference weights (evaluations' KL)")
        gib = sum(p.bytes for p in peak.parts if p.name not in left_out) / 2**30
        rows.append({"case": f"H200, {'fp32' if precision == 'no' else 'bf16 autocast'}", "estimate_gib": gib, "peak_gib": measured, "error": gib / measured - 1})  # fmt: skip
    return rows


# the defaults (outside the demo: micro-batches of 8 sequences), then the batches whole as the defaults were before
VARIANTS = {
    "at the defaults": {},
    "whole batches": {
        "rl": {"gradient_accumulation_steps": 1},
        "reward": {"batch_size": 32, "gradient_accumulation_steps": 1},
    },
}


def fits_table(variant: str) -> list[dict]:
    """Per Qwen2.5 shape, full fine-tuning and LoRA (the reward model's too), fp32 and bf16 weights, on one CUDA
    device: the reward stage, GRPO's and PPO's RL stage, and each pipeline's largest stage."""
    rows, changes = [], VARIANTS[variant]
    for model, dims in QWEN.items():
        for lora in (False, True):
            for dtype in ("float32", "bfloat16"):
                shape = qwen_shape(*dims, dtype=dtype)
                stages = {}
                for algorithm in ("grpo", "ppo"):
                    result = estimated(
                        shape,
                        run={"device": "cuda"},
                        model={"torch_dtype": dtype, "lora": {"enabled": lora}},
                        rl={"algorithm": algorithm, **changes.get("rl", {})},
                        reward={"lora": lora, **changes.get("reward", {})},
                    )
                    stages |= {s.stage: s.total / 2**30 for s in result.stages}
                    stages[algorithm] = result.peak.total / 2**30
                rows.append({"model": model, "training": "LoRA" if lora else "full", "weights": dtype, **stages})
    return rows


def markdown(calibrated: list[dict], gpu: list[dict], tables: dict[str, list[dict]]) -> str:
    lines = ["| case | estimated GiB | measured GiB | error |", "|---|---|---|---|"]
    rows = [*calibrated, *gpu]
    errors = [f"{r['error']:+.0%}" if abs(r["error"]) >= 0.005 else "0%" for r in rows]
    lines += [f"| {r['case']} | {r['estimate_gib']:.2f} | {r['peak_gib']:.2f} | {e} |" for r, e in zip(rows, errors)]
    head = " | ".join(f"{d} GiB" for d in DEVICES_GIB)
    for variant, table in tables.items():
        lines += ["", f"{variant[0].upper()}{variant[1:]}:", ""]
        lines += [f"| model | training | weights | reward stage | GRPO stage | PPO stage | {head} |"]
        lines.append("|---" * (6 + len(DEVICES_GIB)) + "|")
        for r in table:
            fits = (("GRPO, PPO" if r["ppo"] <= d else "GRPO") if r["grpo"] <= d else "no" for d in DEVICES_GIB)
            sizes = f"{r['reward']:.1f} | {r['rl (grpo)']:.1f} | {r['rl (ppo)']:.1f}"
            lines.append(f"| {r['model']} | {r['training']} | {r['weights']} | {sizes} | {' | '.join(fits)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    """No argument: measure and estimate every case, then the table; `table`: the table and the GPU check only;
    `estimate`: the measurements saved in results/memory_estimate.json estimated again (after the estimator
    changed), then the table."""
    sys.path.insert(0, str(REPO))
    if argv[:1] == ["measure"]:
        print(json.dumps(measure(argv[1])))
        return
    saved = RESULTS / "memory_estimate.json"
    if argv[:1] == ["table"]:
        calibrated = []
    else:
        calibrated = calibration(json.loads(saved.read_text())["calibration"] if argv[:1] == ["estimate"] else None)
    gpu, tables = gpu_check(), {variant: fits_table(variant) for variant in VARIANTS}
    text = markdown(calibrated, gpu, tables)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "memory_estimate.md").write_text(text)
    if calibrated:
        saved.write_text(json.dumps({"calibration": calibrated, "gpu": gpu, "tables": tables}, indent=1))
    bad = [r["case"] for r in calibrated + gpu if abs(r["error"]) > TOLERANCE]
    if bad:
        raise SystemExit(f"estimate off by more than {TOLERANCE:.0%}: {', '.join(bad)}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
