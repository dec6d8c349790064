"""The demo's gold-metric gain: `make demo` (configs/demo.yaml, unchanged) end to end, and how much
the trained policy improves on the gold metric (VADER sentiment, which the reward model never sees:
it learns from preference pairs) over the policy it started from, on the same held-out prompts.

"ours" is the final policy's mean gold score, "anchor" the starting (SFT) policy's, both from the
pipeline's own evaluations in this run (sampled at the training temperature); the table shows the
gain (ours - anchor) since a ratio of scores near zero means nothing. Beside it, what tells learning
from reward hacking: the exported policy's eval KL to the starting one (exact, nats), its mean
completion length and distinct-2 as ratios to the starting policy's, and the guard's triggers.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.helpers.anchors import pipeline_main

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def measure(root: Path, server_startup_s: float) -> dict:
    from flows.rlhf_pipeline import rlhf_pipeline
    from rlhf_core.config import load_config
    from rlhf_core.evaluation.promotion import eval_kl

    overrides = [f"run.output_dir={root / 'demo'}", f"tracking.uri=sqlite:///{root / 'mlflow.db'}"]
    start = time.perf_counter()
    summary = rlhf_pipeline(config_path=str(DEMO), overrides=overrides)
    seconds = time.perf_counter() - start
    gold = summary["gold_metric"]
    history = {int(step): row for step, row in summary["eval_history"].items()}
    step = summary.get("selected_step") if summary.get("selected_step") in history else max(history)
    first, last = history[min(history)], history[step]
    before, after = first[f"eval/{gold}_mean"], last[f"eval/{gold}_mean"]
    kl = eval_kl(last) if eval_kl(last) is not None else float("nan")
    length = last.get("eval/length_ratio", float("nan"))
    distinct = last.get("eval/distinct_2_ratio", float("nan"))
    triggers = len(summary.get("guard_triggers") or [])
    return {
        "metric": f"mean gold score ({gold}) on the held-out prompts",
        "unit": "gold",
        "kind": "gain",
        "ours": after,
        "anchor": before,
        "anchor_name": f"the starting policy, step {min(history)}",
        "ratio": after - before,
        "gain": after - before,
        "kl": kl,
        "length_ratio": length,
        "distinct_2_ratio": distinct,
        "guard_triggers": triggers,
        "seconds": seconds,
        "server_startup_s": server_startup_s,  # the Prefect server, started before the flow (not in `seconds`)
        "notes": (
            f"`make demo` end to end in {seconds:.0f} s: gold ({gold}) {before:.2f} -> {after:.2f} "
            f"({after - before:+.2f}) at eval KL {kl:.2f} nats, length x{length:.2f}, distinct-2 x{distinct:.2f}, "
            f"{triggers} guard triggers; exported step {step} of {max(history)} PPO steps; "
            f"{len(history)} evaluations of {load_config(DEMO).eval.num_prompts} prompts, CPU"
        ),
    }


if __name__ == "__main__":
    pipeline_main(measure)
