"""`make demo-seeds`: the demo (configs/demo.yaml) on several seeds, for PPO and GRPO, one line per run.

`run.seed` changes the demo world's data, the initialization and the sampling, so each seed is a new
user's run. Each line holds what tells learning from reward hacking: the gold (VADER) gain of the
exported policy over its SFT policy on the held-out prompts, the exported policy's eval KL to the SFT
policy (exact, nats per completion), its mean sampled length and distinct-2 as ratios to the SFT
policy's, the guard's triggers and rollbacks, and whether the run meets the recipe's targets
(docs/guard.md), and the run's reward model: its held-out accuracy and its length bias on pairs of
equally good answers of different lengths (`reward_model.length_bias`: 0 and 0.5 mean none). Runs go `--jobs` at a time, each in its own process with one torch thread and its own
Prefect home (two torch processes with two threads each on two cores run far slower than one each).

Writes bench/results/demo_seeds.md and .json.
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

# the recipe's targets (issue [4/5]): what every seed must meet
TARGETS = {"gain": 0.45, "length_change": 0.30, "distinct_2_ratio": 0.5, "kl": 3.0, "guard_triggers": 1}


def row_from_summary(summary: dict, ledger: dict) -> dict:
    """One run's line from the pipeline's summary and the guard's ledger (guard.json)."""
    from rlhf_core.evaluation.promotion import eval_kl

    gold = summary["gold_metric"]
    history = {int(step): row for step, row in summary["eval_history"].items()}
    step = summary["selected_step"] if summary.get("selected_step") in history else max(history)
    first, last = history[0], history[step]
    kl = eval_kl(last)
    return {
        "gold_before": first[f"eval/{gold}_mean"],
        "gold_after": last[f"eval/{gold}_mean"],
        "gain": last[f"eval/{gold}_mean"] - first[f"eval/{gold}_mean"],
        "kl": kl,
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
    """In the child process: run the pipeline, write result.json."""
    from flows.rlhf_pipeline import rlhf_pipeline
    from rlhf_core.config import load_config

    start = time.perf_counter()
    summary = rlhf_pipeline(config_path=config, overrides=overrides)
    seconds = time.perf_counter() - start
    # this run's ledger: the newest (a run directory reused with another RL config holds older ones)
    ledger_path = max(Path(summary["output_dir"]).rglob("guard.json"), key=lambda p: p.stat().st_mtime, default=None)
    ledger = json.loads(ledger_path.read_text()) if ledger_path else {}
    row = row_from_summary(summary, ledger)
    row["seconds"] = seconds
    row["reward_accuracy"] = summary["metrics"].get("reward/eval_accuracy")
    if summary.get("reward_model_path"):
        row.update(reward_length_bias(summary["reward_model_path"], load_config(config, overrides).run.seed))
    row["samples"] = [r["completion"] for r in summary.get("final_eval_rows", [])]
    (out / "result.json").write_text(json.dumps(row, indent=2))


def one_run(config: str, seed: int, algorithm: str, overrides: list[str], threads: int, name: str) -> dict:
    out = OUT / name / f"{algorithm}-seed-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    sets = [
        f"run.seed={seed}",
        f"rl.algorithm={algorithm}",
        f"run.output_dir={out / 'run'}",
        f"tracking.uri=sqlite:///{out / 'mlflow.db'}",
        f"run.cpu_threads={threads}",
        *overrides,
    ]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PREFECT_HOME": str(out / "prefect"), "PYTHONPATH": path}
    args = [sys.executable, __file__, "--worker", json.dumps({"config": config, "out": str(out), "sets": sets})]
    with (out / "log.txt").open("w") as log:
        done = subprocess.run(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, check=False)
    if done.returncode != 0:
        return {"seed": seed, "algorithm": algorithm, "error": f"exit {done.returncode}, see {out / 'log.txt'}"}
    return {"seed": seed, "algorithm": algorithm, **json.loads((out / "result.json").read_text())}


def line(r: dict) -> str:
    if "error" in r:
        return f"| {r['algorithm']} | {r['seed']} | failed: {r['error']} |"
    return (
        f"| {r['algorithm']} | {r['seed']} | {r['gold_before']:+.3f} -> {r['gold_after']:+.3f} | {r['gain']:+.3f} | "
        f"{r['kl']:.2f} | x{r['length_ratio']:.2f} | x{r['distinct_2_ratio']:.2f} | {r['guard_triggers']} | "
        f"{r['rollbacks']} | {r['exported_step']} | {r['seconds']:.0f} | {'yes' if meets_targets(r) else 'NO'} | "
        f"{r.get('reward_accuracy') or float('nan'):.3f} | {r.get('length_correlation', float('nan')):+.2f} | "
        f"{r.get('longer_preferred', float('nan')):.2f} |"
    )


HEADER = [
    "| algorithm | seed | gold SFT -> exported | gain | eval KL (nats) | length | distinct-2 | guard triggers | rollbacks "
    "| step | s | meets targets | RM accuracy | RM length correlation (positive answers) | RM prefers longer (positive answers) |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--algorithms", nargs="+", default=["ppo", "grpo"])
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one torch thread each")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
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
    runs = [(seed, algorithm) for algorithm in args.algorithms for seed in args.seeds]
    threads = 1 if args.jobs > 1 else 2
    print("\n".join(HEADER), flush=True)
    results = []
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(one_run, args.config, s, a, args.overrides, threads, args.name) for s, a in runs]
        for future in futures:
            results.append(future.result())
            print(line(results[-1]), flush=True)
    met = sum("error" not in r and meets_targets(r) for r in results)
    text = "\n".join(
        [
            f"# The demo on {len(args.seeds)} seeds (`{args.config}`{' ' + ' '.join(args.overrides) if args.overrides else ''})",
            "",
            *HEADER,
            *map(line, results),
            "",
            f"{met} of {len(results)} runs meet the targets: gain >= {TARGETS['gain']}, length within "
            f"{TARGETS['length_change']:.0%}, distinct-2 >= {TARGETS['distinct_2_ratio']}x, eval KL <= "
            f"{TARGETS['kl']:g} nats, at most {TARGETS['guard_triggers']} guard trigger.",
        ]
    )
    (BENCH / "results").mkdir(exist_ok=True)
    (BENCH / "results" / f"{args.name}.md").write_text(text + "\n")
    (BENCH / "results" / f"{args.name}.json").write_text(json.dumps(results, indent=2))
    print(text.splitlines()[-1])


if __name__ == "__main__":
    main()
