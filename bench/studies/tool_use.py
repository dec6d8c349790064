"""The tool showcase against its controls, on several seeds: `make tools` (docs/tools.md).

For each seed, `rlhf run --config configs/tools.yaml` (SFT on chats that show the `multiply` call on a share of
the problems, then GRPO with the tool at hand), then the same run with `grpo.tools=[]`: GRPO without the tool, from
the same SFT checkpoint (the pipeline reuses the SFT stage) with the same steps. Three policies are measured the
same way on the world's held-out problems (in neither training set), with the tool available to those that were
trained with it: the SFT policy, GRPO with the tool, GRPO without it. Exact match of the last answer sampled at
rl.temperature (how the policy does as it acts) and greedy, and how often the policy calls. Writes
bench/results/tools.md and .json.

    python -m bench.studies.tool_use [--seeds 0 1 2] [--config configs/tools.yaml] [--set section.field=value ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
OUT = REPO / "outputs" / "tools-showcase"


def held_out(model_dir: Path, world: Path, cfg, *, tools: bool, greedy: bool) -> dict[str, float]:
    """Exact match on the held-out problems, and tool calls per problem, of the model at `model_dir`."""
    from rlhf_core.data.tables import read_rows
    from rlhf_core.evaluation.generations import EvalModels, EvalPrompts, EvalSampling, evaluate_generations
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer, run_stop_ids
    from rlhf_core.rewards.functions import exact_match
    from rlhf_core.rollout.sampling import SamplingSettings
    from rlhf_core.rollout.tools import load_tool_use

    rows = read_rows(str(world / "prompts" / "test.jsonl"))
    tokenizer, model = load_tokenizer(str(model_dir)), load_causal_lm(str(model_dir))
    messages = [r["prompt"] for r in rows]
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    import torch

    torch.manual_seed(cfg.run.seed)
    scored = evaluate_generations(
        EvalModels(model, tokenizer),
        EvalPrompts(prompts, messages=messages, columns={"answer": [r["answer"] for r in rows]}),
        EvalSampling(
            SamplingSettings(response_length=cfg.rl.response_length, temperature=cfg.rl.temperature, greedy=greedy),
            max_prompt_length=cfg.data.max_prompt_length,
            batch_size=len(rows),
            stop_token_ids=run_stop_ids(tokenizer, model.generation_config, cfg.rl),
            tool_use=load_tool_use(cfg.grpo) if tools else None,
        ),
        {"exact_match": exact_match},
    )
    return {
        "exact_match": sum(r["exact_match"] for r in scored) / len(scored),
        "calls": sum(r.get("tool_calls", 0) for r in scored) / len(scored),
        "sample": next((r["completion"] for r in scored if r["exact_match"]), scored[0]["completion"]),
    }


def pipeline(config: str, sets: list[str]) -> float:
    start = time.perf_counter()
    command = [str(Path(sys.executable).parent / "rlhf"), "run", "--config", config]
    subprocess.run([*command, *(a for s in sets for a in ("--set", s))], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def measure(model_dir: Path, world: Path, cfg, tools: bool) -> dict:
    return {
        "sampled": held_out(model_dir, world, cfg, tools=tools, greedy=False),
        "greedy": held_out(model_dir, world, cfg, tools=tools, greedy=True),
    }


def one_seed(config: str, seed: int, overrides: list[str]) -> dict:
    from rlhf_core.config import load_config

    out = OUT / f"seed-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    sets = [
        f"run.seed={seed}",
        f"run.output_dir={out / 'run'}",
        f"tracking.uri=sqlite:///{out / 'mlflow.db'}",
        *overrides,
    ]
    cfg = load_config(config, sets)
    run, world = out / "run", out / "run" / "demo_world"
    with_tool_seconds = pipeline(config, sets)
    results = {
        "seed": seed,
        "sft": measure(run / "sft", world, cfg, True),
        "rl_tool": measure(run / "export", world, cfg, True),
    }
    results["without_tool_seconds"] = round(pipeline(config, [*sets, "grpo.tools=[]"]), 1)  # reuses the SFT stage
    results["rl_no_tool"] = measure(run / "export", world, cfg, False)
    results["with_tool_seconds"] = round(with_tool_seconds, 1)
    return results


def report(results: list[dict], config: str, overrides: list[str]) -> str:
    lines = [
        f"# Tools: GRPO with the tool against SFT and GRPO without it (`{config}`{' ' + ' '.join(overrides) if overrides else ''})",
        "",
        "Exact match of the last answer on the held-out problems, sampled at rl.temperature (greedy in brackets);",
        "calls: tool calls per problem, sampled.",
        "",
        "| seed | SFT | GRPO with the tool | GRPO without the tool | with - SFT | with - without | calls: SFT, with | pipeline s (with, without) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        sft, tool, none = r["sft"], r["rl_tool"], r["rl_no_tool"]
        lines.append(
            f"| {r['seed']} | {sft['sampled']['exact_match']:.3f} ({sft['greedy']['exact_match']:.3f}) | "
            f"{tool['sampled']['exact_match']:.3f} ({tool['greedy']['exact_match']:.3f}) | "
            f"{none['sampled']['exact_match']:.3f} ({none['greedy']['exact_match']:.3f}) | "
            f"{tool['sampled']['exact_match'] - sft['sampled']['exact_match']:+.3f} | "
            f"{tool['sampled']['exact_match'] - none['sampled']['exact_match']:+.3f} | "
            f"{sft['sampled']['calls']:.2f}, {tool['sampled']['calls']:.2f} | "
            f"{r['with_tool_seconds']}, {r['without_tool_seconds']} |"
        )
    lines += ["", "A held-out episode of GRPO with the tool, per seed:", ""]
    lines += [f"- seed {r['seed']}: `{r['rl_tool']['sampled']['sample']!r}`" for r in results]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tools.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args()
    results = [one_seed(args.config, seed, args.overrides) for seed in args.seeds]
    text = report(results, args.config, args.overrides)
    (BENCH / "results").mkdir(exist_ok=True)
    (BENCH / "results" / "tools.md").write_text(text)
    (BENCH / "results" / "tools.json").write_text(json.dumps(results, indent=2))
    print(text)


if __name__ == "__main__":
    main()
