"""`make demo-seeds`: the demo (configs/demo.yaml) on several seeds, for PPO and GRPO, one line per run.

`run.seed` changes the demo world's data, the initialization and the sampling, so each seed is a new
user's run. Each line holds what tells learning from reward hacking:

- the pipeline's own readings of the exported policy against its SFT policy (its step-0 evaluation) on the
  held-out prompts: the gold (VADER) gain, the mean answer length as a ratio (in tokens, the stop token not
  counted: what the guard's length rule reads), distinct-2 as a ratio, the eval KL (exact, nats per
  completion), the guard's triggers and rollbacks and the exported step;
- a user's check apart from the pipeline (`bench/helpers/heldout_check.py`): on every held-out prompt, the
  greedy answer's gold gain, and the sampled answers' length in words and distinct-2 as ratios to the SFT
  policy's, through transformers' `generate` on the exported files;
- whether the run meets the recipe's targets (docs/guard.md), and the run's reward model: its held-out
  accuracy and its length bias on pairs of equally good answers of different lengths
  (`reward_model.length_bias`: 0 and 0.5 mean none).

A seed's runs share one run directory, one after the other, so its SFT policy and reward model are trained
once (the stages' keys do not hold the algorithm). Seeds go `--jobs` at a time, each in its own process with
one torch thread and its own Prefect home (two torch processes with two threads each on two cores run far
slower than one each). `--checkout DIR` runs the pipeline of another checkout of this repository (a
`git worktree` of an older commit, for an A/B) and measures it with this one's code.

Writes bench/results/<name>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
OUT = BENCH / "results" / "demo_seeds"

# the recipe's targets (issues [4/5] and [7/7]): what every seed must meet
TARGETS = {"gain": 0.45, "length_change": 0.25, "distinct_2_ratio": 0.5, "kl": 3.0, "guard_triggers": 1}


def row_from_summary(summary: dict, ledger: dict) -> dict:
    """One run's line from the pipeline's summary and the guard's ledger (guard.json)."""
    from rlhf_core.evaluation.promotion import eval_kl

    gold = summary["gold_metric"]
    history = {int(step): row for step, row in summary["eval_history"].items()}
    step = summary["selected_step"] if summary.get("selected_step") in history else max(history)
    first, last = history[0], history[step]
    return {
        "gold_before": first[f"eval/{gold}_mean"],
        "gold_after": last[f"eval/{gold}_mean"],
        "gain": last[f"eval/{gold}_mean"] - first[f"eval/{gold}_mean"],
        "kl": eval_kl(last),
        "length_ratio": last.get("eval/length_ratio"),
        "distinct_2_ratio": last.get("eval/distinct_2_ratio"),
        "guard_triggers": len(ledger.get("all_triggers", [])),
        "rollbacks": int(ledger.get("rollbacks", 0)),
        "exported_step": step,
    }


def meets_targets(row: dict) -> bool:
    return (
        row["gain"] >= TARGETS["gain"]
        and row["length_ratio"] is not None
        and abs(row["length_ratio"] - 1) <= TARGETS["length_change"]
        and row["distinct_2_ratio"] is not None
        and row["distinct_2_ratio"] >= TARGETS["distinct_2_ratio"]
        and row["kl"] is not None
        and row["kl"] <= TARGETS["kl"]
        and row["guard_triggers"] <= TARGETS["guard_triggers"]
    )


def reward_length_bias(reward_model_path: str, seed: int, num_pairs: int = 400) -> dict[str, float]:
    """The run's reward model on held-out pairs of answers that VADER scores the same but that differ in
    length (`equal_gold_length_pairs`): `reward_model.length_bias` over the pairs whose answers are positive
    (where RL takes the policy: `length_correlation`, `longer_preferred`) and over all (`..._all`)."""
    import random

    import torch
    from transformers import AutoModelForSequenceClassification

    from rlhf_core.data.chat import render_completions
    from rlhf_core.demo.text import ReviewWriter, equal_gold_length_pairs, load_vader_lexicon, sample_prefixes
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rewards.reward_model import encoded_scores, length_bias, tokenize_pairs

    writer = ReviewWriter(random.Random(10_000 + seed), load_vader_lexicon())
    pairs = equal_gold_length_pairs(writer, sample_prefixes(writer, True, num_pairs))
    tokenizer = load_tokenizer(reward_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_path)
    rows = []
    for pair in pairs:
        prompt, (a, b) = render_completions(tokenizer, pair["prompt"], [pair["a"], pair["b"]])
        rows.append({"prompt": prompt, "chosen": a, "rejected": b})
    items = tokenize_pairs(tokenizer, rows, max_length=128)
    score_a, score_b, _ = encoded_scores(model, items, tokenizer.pad_token_id, batch_size=64)
    lengths = [torch.tensor([len(it[k]) for it in items], dtype=torch.float) for k in ("chosen", "rejected")]
    positive = torch.tensor([pair["gold"] > 0 for pair in pairs])
    everything = {f"{k}_all": v for k, v in length_bias(score_a, score_b, *lengths).items()}
    return {**length_bias(score_a[positive], score_b[positive], *(x[positive] for x in lengths)), **everything}


def worker(config: str, out: Path, overrides: list[str]) -> None:
    """In the child process, in the checkout: run the pipeline, write its summary and this run's guard ledger."""
    from flows.rlhf_pipeline import rlhf_pipeline

    start = time.perf_counter()
    summary = rlhf_pipeline(config_path=config, overrides=overrides)
    seconds = time.perf_counter() - start
    # this run's ledger: the newest (the seed's run directory holds the other algorithms' too)
    ledger_path = max(Path(summary["output_dir"]).rglob("guard.json"), key=lambda p: p.stat().st_mtime, default=None)
    ledger = json.loads(ledger_path.read_text()) if ledger_path else {}
    (out / "summary.json").write_text(json.dumps({**summary, "seconds": seconds, "ledger": ledger}, default=str))


def measure(out: Path, seed: int) -> None:
    """In a child process, with this checkout's code: the line's numbers from the run's summary, the reward
    model's length bias and the user's check of the exported policy against the SFT policy."""
    from bench.helpers.heldout_check import compare

    summary = json.loads((out / "summary.json").read_text())
    row = row_from_summary(summary, summary["ledger"])
    row["seconds"] = summary["seconds"]
    row["reward_accuracy"] = summary["metrics"].get("reward/eval_accuracy")
    if summary.get("reward_model_path"):
        row.update(reward_length_bias(summary["reward_model_path"], seed))
    run = Path(summary["output_dir"])
    row.update(compare(run / "sft", run / "export"))
    row["samples"] = [r["completion"] for r in summary.get("final_eval_rows", [])]
    (out / "result.json").write_text(json.dumps(row, indent=2))


def _child(args: list[str], out: Path, cwd: Path, env: dict) -> bool:
    with (out / "log.txt").open("a") as log:
        return subprocess.run(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, check=False).returncode == 0


def one_run(spec: dict, seed: int, algorithm: str) -> dict:
    """One algorithm's run on one seed, in the seed's run directory, then measured."""
    base = OUT / spec["name"] / f"seed-{seed}"
    out = base / algorithm
    out.mkdir(parents=True, exist_ok=True)
    sets = [
        f"run.seed={seed}",
        f"rl.algorithm={algorithm}",
        f"run.output_dir={base / 'run'}",
        f"tracking.uri=sqlite:///{base / 'mlflow.db'}",
        f"run.cpu_threads={spec['threads']}",
        *spec["overrides"],
    ]
    checkout = Path(spec["checkout"])
    env = {**os.environ, "PREFECT_HOME": str(base / "prefect"), "OMP_NUM_THREADS": str(spec["threads"])}
    run_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
    work = json.dumps({"config": spec["config"], "out": str(out), "sets": sets})
    here = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if not _child([sys.executable, __file__, "--worker", work], out, checkout, run_env):
        return {"seed": seed, "algorithm": algorithm, "error": f"the run failed, see {out / 'log.txt'}"}
    if not _child([sys.executable, __file__, "--measure", str(out), str(seed)], out, ROOT, {**env, "PYTHONPATH": here}):
        return {"seed": seed, "algorithm": algorithm, "error": f"measuring failed, see {out / 'log.txt'}"}
    return {"seed": seed, "algorithm": algorithm, **json.loads((out / "result.json").read_text())}


def one_seed(spec: dict, seed: int) -> list[dict]:
    return [one_run(spec, seed, algorithm) for algorithm in spec["algorithms"]]


def line(r: dict) -> str:
    if "error" in r:
        return f"| {r['algorithm']} | {r['seed']} | failed: {r['error']} |"
    words = r.get("check_words", [float("nan")] * 2)
    return (
        f"| {r['algorithm']} | {r['seed']} | {r['gold_before']:+.3f} -> {r['gold_after']:+.3f} | {r['gain']:+.3f} | "
        f"x{r['length_ratio']:.2f} | x{r['distinct_2_ratio']:.2f} | {r['kl']:.2f} | {r['guard_triggers']} | "
        f"{r['rollbacks']} | {r['exported_step']} | {'yes' if meets_targets(r) else 'NO'} | "
        f"{r.get('check_gain', float('nan')):+.3f} | x{r.get('check_length_ratio', float('nan')):.2f} "
        f"({words[0]:.1f} -> {words[1]:.1f}) | x{r.get('check_distinct_2_ratio', float('nan')):.2f} | "
        f"{r['seconds']:.0f} | {r.get('reward_accuracy') or float('nan'):.3f} | "
        f"{r.get('length_correlation', float('nan')):+.2f} | {r.get('longer_preferred', float('nan')):.2f} |"
    )


HEADER = [
    "| algorithm | seed | gold SFT -> exported | gain | length | distinct-2 | eval KL (nats) | guard triggers | "
    "rollbacks | step | meets targets | check: greedy gold gain | check: length in words | check: distinct-2 | s | "
    "RM accuracy | RM length correlation (positive answers) | RM prefers longer (positive answers) |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def report(args: argparse.Namespace, results: list[dict]) -> str:
    met = sum("error" not in r and meets_targets(r) for r in results)
    where = f" at {args.checkout}" if args.checkout != ROOT else ""
    sets = " " + " ".join(args.overrides) if args.overrides else ""
    return "\n".join(
        [
            f"# The demo on {len(args.seeds)} seeds (`{args.config}`{sets}){where}",
            "",
            *HEADER,
            *map(line, results),
            "",
            f"{met} of {len(results)} runs meet the targets: gain >= {TARGETS['gain']}, length within "
            f"{TARGETS['length_change']:.0%}, distinct-2 >= {TARGETS['distinct_2_ratio']}x, eval KL <= "
            f"{TARGETS['kl']:g} nats, at most {TARGETS['guard_triggers']} guard trigger.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--algorithms", nargs="+", default=["ppo", "grpo"])
    parser.add_argument("--jobs", type=int, default=2, help="seeds at a time, one torch thread each")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the checkout whose pipeline runs (an A/B)")
    parser.add_argument(
        "--name",
        default="demo_seeds",
        help="the results' name: bench/results/<name>.md, runs in bench/results/demo_seeds/<name>/",
    )
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        worker(spec["config"], Path(spec["out"]), spec["sets"])
        return
    if args.measure:
        measure(Path(args.measure[0]), int(args.measure[1]))
        return
    spec = {
        "name": args.name,
        "config": args.config,
        "algorithms": args.algorithms,
        "overrides": args.overrides,
        "threads": 1 if args.jobs > 1 else 2,
        "checkout": str(args.checkout.resolve()),
    }
    print("\n".join(HEADER), flush=True)
    results = []
    with ThreadPoolExecutor(args.jobs) as pool:
        for lines in pool.map(lambda seed: one_seed(spec, seed), args.seeds):
            results += lines
            print("\n".join(map(line, lines)), flush=True)
    text = report(args, results)
    (BENCH / "results").mkdir(exist_ok=True)
    (BENCH / "results" / f"{args.name}.md").write_text(text + "\n")
    (BENCH / "results" / f"{args.name}.json").write_text(json.dumps(results, indent=2))
    print(text.splitlines()[-1])


if __name__ == "__main__":
    main()
