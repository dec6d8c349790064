"""The demo's reward model in the stage's process against the same model behind `mlflow models serve`:
`make served-rewards` (docs/served-rewards.md).

`rlhf run --config configs/demo.yaml` with rl.algorithm grpo, twice in one run directory: first with the in-process
reward model (`grpo.rewards`' default), then with `{kind: reward_model, model: reward_stage}`, which the RL stage
serves itself. The data, SFT and reward stages are made once and reused. Reported:
- the largest difference of rewards/reward_model/mean over the steps;
- the largest difference of any exported weight;
- each RL stage's wall-clock seconds per step;
- the served source's latency p50/p95 and its request count.

Writes bench/results/served_rewards.md and .json. Nothing else should run beside it: the seconds are wall-clock on a
shared 2-core machine.

    python -m bench.studies.served_rewards [--seed 42] [--steps 40] [--set ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.studies.tool_use import pipeline

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
OUT = REPO / "outputs" / "served-rewards"
SERVED = "grpo.rewards=[{name: reward_model, kind: reward_model, model: reward_stage}]"


def newest_grpo_run(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(
        experiments, "attributes.run_name = 'grpo'", order_by=["attributes.start_time DESC"], max_results=1
    )
    return client, run


def history(client, run, name: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)]


def one_run(sets: list[str], uri: str, steps: int) -> dict:
    from safetensors.torch import load_file

    pipeline(str(REPO / "configs" / "demo.yaml"), sets)
    client, run = newest_grpo_run(uri)
    weights = load_file(OUT / "run" / "export" / "model.safetensors")
    return {
        "rewards": history(client, run, "rewards/reward_model/mean"),
        "seconds_per_step": (run.info.end_time - run.info.start_time) / 1000 / steps,
        "p50": history(client, run, "rewards/reward_model/latency_p50_s"),
        "p95": history(client, run, "rewards/reward_model/latency_p95_s"),
        "requests": sum(history(client, run, "rewards/reward_model/requests")),
        "weights": weights,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{OUT / 'mlflow.db'}"
    sets = [f"run.seed={args.seed}", f"run.output_dir={OUT / 'run'}", f"tracking.uri={uri}", "rl.algorithm=grpo"]
    sets += [f"rl.total_steps={args.steps}", *args.sets]
    in_process = one_run(sets, uri, args.steps)
    served = one_run([*sets, SERVED], uri, args.steps)
    reward_gap = max(abs(a - b) for a, b in zip(in_process["rewards"], served["rewards"], strict=True))
    weight_gap = max(
        float((in_process["weights"][k] - served["weights"][k]).abs().max()) for k in in_process["weights"]
    )
    result = {
        "seed": args.seed,
        "steps": args.steps,
        "max_reward_difference": reward_gap,
        "max_weight_difference": weight_gap,
        "seconds_per_step": {"in_process": in_process["seconds_per_step"], "served": served["seconds_per_step"]},
        "latency_p50_s_median": sorted(served["p50"])[len(served["p50"]) // 2],
        "latency_p95_s_max": max(served["p95"]),
        "requests": served["requests"],
        "final_reward": {"in_process": in_process["rewards"][-1], "served": served["rewards"][-1]},
    }
    results = BENCH / "results"
    results.mkdir(exist_ok=True)
    (results / "served_rewards.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [
        "| | in process | served (`mlflow models serve`) |",
        "|---|---|---|",
        f"| seconds per RL step | {in_process['seconds_per_step']:.2f} | {served['seconds_per_step']:.2f} |",
        f"| final rewards/reward_model/mean | {in_process['rewards'][-1]:.5f} | {served['rewards'][-1]:.5f} |",
    ]
    text = "\n".join(
        [
            f"Seed {args.seed}, {args.steps} GRPO steps of configs/demo.yaml.",
            "",
            *rows,
            "",
            f"Largest reward difference over the steps: {reward_gap:.2e}; largest weight difference: {weight_gap:.2e}.",
            f"Served: {served['requests']:.0f} requests, latency p50 {result['latency_p50_s_median'] * 1000:.0f} ms "
            f"(median over steps), p95 at most {result['latency_p95_s_max'] * 1000:.0f} ms.",
        ]
    )
    (results / "served_rewards.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
