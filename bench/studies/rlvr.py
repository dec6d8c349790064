"""RLVR against its control, on several seeds: `make rlvr` (docs/rlvr.md).

For each seed, `rlhf run --config configs/rlvr.yaml` (SFT on the labelled problems to its plateau, then
RL on problems without answers, scored by the exact-match checker), then the control a skeptic asks for:
continued SFT from the same SFT checkpoint on the same labelled problems, with the same compute: as many
optimizer steps as take the RL stage's optimizer-loop seconds (its logged perf/step_seconds; evaluations
left out of both), timed on a 100-step probe first, or --control-steps. Both times are in the table. The SFT checkpoint, the exported policy and the control are evaluated the same
way: greedy exact match on the world's held-out problems (in neither training set). Writes
bench/results/rlvr.md and .json.

    python -m bench.studies.rlvr [--seeds 1 2 3] [--config configs/rlvr.yaml] [--set section.field=value ...]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
OUT = REPO / "outputs" / "rlvr-showcase"


def held_out_accuracy(model_dir: Path, world: Path, cfg) -> float:
    """Greedy exact match of the model at `model_dir` on the world's held-out problems."""
    from rlhf_core.data.tables import read_rows
    from rlhf_core.evaluation.generations import EvalModels, EvalPrompts, EvalSampling, evaluate_generations
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer, run_stop_ids
    from rlhf_core.rewards.functions import exact_match
    from rlhf_core.rollout.sampling import SamplingSettings

    rows = read_rows(str(world / "prompts" / "test.jsonl"))
    tokenizer, model = load_tokenizer(str(model_dir)), load_causal_lm(str(model_dir))
    scored = evaluate_generations(
        EvalModels(model, tokenizer),
        EvalPrompts([r["prompt"] for r in rows], columns={"answer": [r["answer"] for r in rows]}),
        EvalSampling(
            SamplingSettings(response_length=cfg.rl.response_length, greedy=True),
            max_prompt_length=cfg.data.max_prompt_length,
            batch_size=len(rows),
            stop_token_ids=run_stop_ids(tokenizer, model.generation_config, cfg.rl),
        ),
        {"exact_match": exact_match},
    )
    return sum(r["exact_match"] for r in scored) / len(scored)


def rl_seconds(tracking_uri: str, algorithm: str) -> float:
    """The RL stage's optimizer-loop seconds: the sum of its logged perf/step_seconds (evaluations excluded)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    [run] = [
        r
        for e in client.search_experiments()
        for r in client.search_runs([e.experiment_id])
        if r.info.run_name == algorithm
    ]
    history = client.get_metric_history(run.info.run_id, "perf/step_seconds")
    steps = sorted({m.step for m in history})
    logged = {m.step: m.value for m in history}
    # logged every rl.log_steps: each value stands for the steps since the previous one
    return sum(logged[s] * (s - p) for p, s in zip([0, *steps[:-1]], steps))


def continued_sft(sft_dir: Path, world: Path, cfg, steps: int, out: Path) -> float:
    """Continued SFT from the SFT checkpoint on the labelled problems for `steps` steps into `out`: seconds."""
    from rlhf_core.data.tables import read_rows
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.training.loop import Hooks
    from rlhf_core.training.sft import train_sft

    shutil.rmtree(out, ignore_errors=True)  # this script's own: a rerun trains afresh
    tokenizer, model = load_tokenizer(str(sft_dir)), load_causal_lm(str(sft_dir))
    texts = [r["text"] for r in read_rows(str(world / "corpus.jsonl"))]
    settings = cfg.sft.model_copy(update={"max_steps": steps, "log_steps": steps})
    run = cfg.run.model_copy(update={"seed": cfg.run.seed + 1})  # a fresh order of the same examples
    start = time.perf_counter()
    train_sft(
        model,
        tokenizer,
        texts,
        settings,
        run,
        max_length=cfg.data.max_length,
        output_dir=out,
        hooks=Hooks(show_progress=False),
    )
    return time.perf_counter() - start


def control(sft_dir: Path, world: Path, cfg, seconds: float, out: Path, steps: int | None) -> tuple[int, float, float]:
    """The control: continued SFT for as many steps as take the RL stage's optimizer seconds (timed on a short
    run first), or `steps`: (steps, seconds, held-out accuracy)."""
    from rlhf_core.training.parallel import use_cpu_threads

    use_cpu_threads(cfg.run.cpu_threads)
    if steps is None:
        probe = 100
        per_step = continued_sft(sft_dir, world, cfg, probe, out) / probe
        steps = max(1, math.ceil(seconds / per_step))
    spent = continued_sft(sft_dir, world, cfg, steps, out)
    return steps, spent, held_out_accuracy(out, world, cfg)


def one_seed(config: str, seed: int, overrides: list[str], control_steps: int | None) -> dict:
    from rlhf_core.config import load_config

    out = OUT / f"seed-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    sets = [f"run.seed={seed}", f"run.output_dir={out / 'run'}", f"tracking.uri={uri}", *overrides]
    cfg = load_config(config, sets)
    start = time.perf_counter()
    command = [str(Path(sys.executable).parent / "rlhf"), "run", "--config", config]
    subprocess.run([*command, *(a for s in sets for a in ("--set", s))], check=True, stdout=subprocess.DEVNULL)
    pipeline_seconds = time.perf_counter() - start
    world, run_dir = out / "run" / "demo_world", out / "run"
    seconds = rl_seconds(uri, cfg.rl.algorithm)
    steps, control_seconds, control_accuracy = control(
        run_dir / "sft", world, cfg, seconds, out / "control", control_steps
    )
    return {
        "seed": seed,
        "pipeline_seconds": round(pipeline_seconds, 1),
        "sft": held_out_accuracy(run_dir / "sft", world, cfg),
        "rl": held_out_accuracy(run_dir / "export", world, cfg),
        "control": control_accuracy,
        "rl_steps": cfg.rl.total_steps,
        "rl_seconds": round(seconds, 1),
        "control_steps": steps,
        "control_seconds": round(control_seconds, 1),
    }


def report(results: list[dict], config: str, overrides: list[str]) -> str:
    lines = [
        f"# RLVR against continued SFT (`{config}`{' ' + ' '.join(overrides) if overrides else ''})",
        "",
        "Greedy exact match on the held-out problems (in neither training set).",
        "",
        "| seed | SFT (plateau) | RL (exported) | continued SFT (control) | RL - SFT | RL - control | RL steps, s | control steps, s | pipeline s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['seed']} | {r['sft']:.3f} | {r['rl']:.3f} | {r['control']:.3f} | {r['rl'] - r['sft']:+.3f} | "
            f"{r['rl'] - r['control']:+.3f} | {r['rl_steps']}, {r['rl_seconds']} | {r['control_steps']}, "
            f"{r['control_seconds']} | {r['pipeline_seconds']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/rlvr.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--control-steps", type=int, default=None, help="default: the RL stage's optimizer seconds")
    args = parser.parse_args()
    results = [one_seed(args.config, seed, args.overrides, args.control_steps) for seed in args.seeds]
    text = report(results, args.config, args.overrides)
    (BENCH / "results").mkdir(exist_ok=True)
    (BENCH / "results" / "rlvr.md").write_text(text)
    (BENCH / "results" / "rlvr.json").write_text(json.dumps(results, indent=2))
    print(text)


if __name__ == "__main__":
    main()
