"""Memory: the peak resident set of our GRPO training against TRL 1.16's GRPOTrainer at Qwen2.5's real vocabulary.

The same work on both sides: a Qwen2.5-0.5B-shaped body (hidden 896, 14 heads, 2 KV heads, intermediate 4864, tied
embeddings) cut to 2 layers, with random weights and the real vocabulary of 151,936 rows (the logits of 8 x 256
tokens are 1.2 GB in fp32: the vocabulary, not the depth, is what decides the peak), written once and loaded by
both; chat-templated prompts all of one length; 8 completions per step of exactly 256 new tokens (min_new_tokens
on both sides); fp32, CPU, beta 0 (no reference model, TRL's default), temperature 1.0, one optimizer step per
generation batch; 2 steps, the first a warm-up (the optimizer's state exists from its end on, so the second
step's peak is the run's). Two configurations, each a pair of processes (bench/helpers/memory_sides.py):

- defaults: each side at its own defaults for memory. TRL's GRPOConfig: per_device_train_batch_size 8,
  steps_per_generation 1, gradient_checkpointing on. Ours: rl.batch_size 8 in one micro-batch
  (rl.gradient_accumulation_steps 1), model.gradient_checkpointing unset, which the RL stage turns on for every
  model but the demo (`prepare_for_training`).
- micro4: both sides with micro-batches of 4 completions (2 per optimizer step) and gradient checkpointing on.

Peak memory is each process's ru_maxrss (imports, weights, the optimizer's state and the step's activations
together; ours read before the loop's closing checkpoint, TRL saves none); seconds per step are those of the
second step. Order: TRL, ours (defaults), ours, TRL (micro4), so a drifting load hits both alike.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.helpers.anchors import side_process_main, use_anchor
from bench.helpers.memory_sides import BATCH, LAYERS, TOKENS, VOCAB, ours_side, trl_side, write_policy

ANCHOR = ("trl", "1.16.0")
STEPS, GENERATIONS, PROMPTS = 2, 8, 16
# configuration -> (our side's settings, TRL's GRPOConfig fields beyond its defaults)
CONFIGS = {
    "defaults": ({"micro_batches": 1, "checkpointing": None}, {}),
    "micro4": (
        {"micro_batches": 2, "checkpointing": True},
        {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "gradient_checkpointing": True},
    ),
}
ORDER = [("defaults", "trl"), ("defaults", "ours"), ("micro4", "ours"), ("micro4", "trl")]


def prepare(root: Path) -> None:
    write_policy(root, PROMPTS)


def side(configuration: str, who: str):
    """The side `who` ("ours" or "trl") of `configuration`, as side_process_main calls it (with the root)."""
    ours, trl = CONFIGS[configuration]

    def run(root: Path) -> dict:
        if who == "ours":
            return ours_side(root, steps=STEPS, generations=GENERATIONS, **ours)
        use_anchor(*ANCHOR)
        return trl_side(root, steps=STEPS, generations=GENERATIONS, overrides=trl)

    return run


def settings(run: dict) -> str:
    return f"{run['micro_batch']}, {'on' if run['checkpointing'] else 'off'}"


def table(configurations: dict) -> str:
    rows = [
        "| configuration | micro-batch, checkpointing (ours; TRL) | peak MiB ours | peak MiB TRL | peak ours / TRL "
        "| s/step ours | s/step TRL | s/step ours / TRL |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in configurations.items():
        ours, trl = c["ours"], c["trl"]
        rows.append(
            f"| {name} | {settings(ours)}; {settings(trl)} | {ours['peak_mib']:.0f} | {trl['peak_mib']:.0f} | "
            f"{c['peak_ratio']:.2f} | {ours['seconds_per_step']:.1f} | {trl['seconds_per_step']:.1f} | "
            f"{c['step_ratio']:.2f} |"
        )
    loaded = "; ".join(
        f"{name}: ours {c['ours']['loaded_mib']:.0f}, TRL {c['trl']['loaded_mib']:.0f}"
        for name, c in configurations.items()
    )
    phases = "; ".join(
        f"{name}: " + ", ".join(f"{phase} {mib:.0f}" for phase, mib in c["ours"]["phase_peak_mib"].items())
        for name, c in configurations.items()
    )
    return "\n".join(rows) + (
        f"\n\nBefore training (imports, weights, trainer built), MiB: {loaded}. Our peak by phase (each phase of"
        f" a step during which the peak grew, and the peak it reached, MiB): {phases}."
    )


def measure(run_side) -> dict:
    start = time.perf_counter()
    runs = {(name, who): run_side(f"{who}-{name}") for name, who in ORDER}
    wall = time.perf_counter() - start
    configurations = {}
    for name in CONFIGS:
        ours, trl = runs[name, "ours"], runs[name, "trl"]
        configurations[name] = {
            "ours": ours,
            "trl": trl,
            "peak_ratio": ours["peak_mib"] / trl["peak_mib"],
            "step_ratio": ours["seconds_per_step"] / trl["seconds_per_step"],
        }
    defaults, micro = configurations["defaults"], configurations["micro4"]
    work = (
        f"Qwen2.5-shaped, {LAYERS} layers, vocabulary {VOCAB:,}, {BATCH} completions x {TOKENS} new tokens, "
        f"{PROMPTS} prompts of {defaults['ours']['prompt_tokens']} tokens, fp32, beta 0, 1 warm-up + {STEPS - 1} timed step, each side "
        "in its own process, CPU"
    )
    return {
        "metric": "peak resident set of GRPO training, each side at its defaults",
        "unit": "MiB",
        "ours": defaults["ours"]["peak_mib"],
        "anchor": defaults["trl"]["peak_mib"],
        "anchor_name": "trl 1.16.0 GRPOTrainer",
        "ratio": defaults["peak_ratio"],
        "step_ratio": defaults["step_ratio"],
        "micro4_peak_ratio": micro["peak_ratio"],
        "micro4_step_ratio": micro["step_ratio"],
        "configurations": configurations,
        "sides_wall_s": wall,
        "table_md": table(configurations),
        "notes": (
            f"defaults: peak ours {defaults['ours']['peak_mib']:.0f} MiB vs TRL {defaults['trl']['peak_mib']:.0f}, "
            f"s/step ours {defaults['ours']['seconds_per_step']:.1f} vs TRL "
            f"{defaults['trl']['seconds_per_step']:.1f} ({defaults['step_ratio']:.2f}); micro4 (micro-batches "
            f"of 4, checkpointing on both): peak {micro['ours']['peak_mib']:.0f} vs {micro['trl']['peak_mib']:.0f} "
            f"MiB ({micro['peak_ratio']:.2f}), s/step {micro['ours']['seconds_per_step']:.1f} vs "
            f"{micro['trl']['seconds_per_step']:.1f} ({micro['step_ratio']:.2f}); {work}; table below"
        ),
    }


if __name__ == "__main__":
    sides = {f"{who}-{name}": side(name, who) for name, who in ORDER}
    side_process_main(__file__, {"prepare": prepare, **sides}, ANCHOR, measure)
