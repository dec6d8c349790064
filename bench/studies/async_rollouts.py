"""Generation ahead of training against the synchronous step, on several seeds: `make async-rollouts`
(docs/async-rollouts.md).

For each seed, `rlhf run --config configs/tools.yaml` with rollout.max_staleness 0, 1 and 2, one after the other in
one run directory (the data and SFT stages are made once and reused; the RL stage's key holds max_staleness). Per
run, two seconds per RL step: the RL stage's whole wall-clock (its MLflow run, start to end: evaluations,
checkpoints, registrations and the generator process's start included) over its steps, and the loop's
own perf/step_seconds at each log step (every rl.log_steps steps; the first step, which waits for the generator to
start, is never among them). And the exported policy's exact match on the world's held-out problems with the tool
at hand, sampled at rl.temperature (greedy in brackets), measured as `make tools` measures it. Writes
bench/results/async_rollouts.md and .json. Nothing else should run beside it: the seconds are wall-clock on a shared
2-core machine.

    python -m bench.studies.async_rollouts [--seeds 0 1 2] [--staleness 0 1 2] [--config configs/tools.yaml] [--set ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.studies.tool_use import held_out, pipeline

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
OUT = REPO / "outputs" / "async-showcase"


def stage_seconds(tracking_uri: str) -> tuple[float, list[float]]:
    """The newest RL stage run's wall-clock seconds and its logged perf/step_seconds, in step order."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(
        experiments, "attributes.run_name = 'grpo'", order_by=["attributes.start_time DESC"], max_results=1
    )
    history = client.get_metric_history(run.info.run_id, "perf/step_seconds")
    return (run.info.end_time - run.info.start_time) / 1000, [m.value for m in sorted(history, key=lambda m: m.step)]


def one_run(config: str, seed: int, staleness: int, overrides: list[str]) -> dict:
    from rlhf_core.config import load_config

    out = OUT / f"seed-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    sets = [
        f"run.seed={seed}",
        f"run.output_dir={out / 'run'}",
        f"tracking.uri={uri}",
        f"rollout.max_staleness={staleness}",
        *overrides,
    ]
    cfg = load_config(config, sets)
    seconds = pipeline(config, sets)
    stage, logged = stage_seconds(uri)
    run, world = out / "run", out / "run" / "demo_world"
    return {
        "seed": seed,
        "max_staleness": staleness,
        "steps": cfg.rl.total_steps,
        "step_s": stage / cfg.rl.total_steps,
        "loop_step_s": statistics.fmean(logged),
        "pipeline_s": round(seconds, 1),
        "sampled": held_out(run / "export", world, cfg, tools=True, greedy=False)["exact_match"],
        "greedy": held_out(run / "export", world, cfg, tools=True, greedy=True)["exact_match"],
    }


def report(results: list[dict], config: str, overrides: list[str]) -> str:
    sync = {r["seed"]: r for r in results if r["max_staleness"] == 0}
    lines = [
        f"# Generation ahead of training against the synchronous step (`{config}`{' ' + ' '.join(overrides) if overrides else ''})",
        "",
        "Seconds per RL step: the RL stage's wall-clock over its steps (the loop's logged perf/step_seconds in",
        "brackets); the speed-up against max_staleness 0 of the same seed, the same two ways; the exported policy's",
        "held-out exact match with the tool, sampled (greedy in brackets).",
        "",
        "| seed | max_staleness | s / step | speed-up | held-out exact match | pipeline s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        base = sync.get(r["seed"])
        speed = f"{base['step_s'] / r['step_s']:.2f}x ({base['loop_step_s'] / r['loop_step_s']:.2f}x)" if base else "-"
        lines.append(
            f"| {r['seed']} | {r['max_staleness']} | {r['step_s']:.3f} ({r['loop_step_s']:.3f}) | {speed} | "
            f"{r['sampled']:.3f} ({r['greedy']:.3f}) | {r['pipeline_s']} |"
        )
    lines += [
        "",
        "| max_staleness | mean speed-up, stage (loop) | held-out exact match sampled: mean, min - max over seeds |",
        "|---|---|---|",
    ]
    for k in sorted({r["max_staleness"] for r in results}):
        runs = [r for r in results if r["max_staleness"] == k and r["seed"] in sync]
        stage = statistics.fmean(sync[r["seed"]]["step_s"] / r["step_s"] for r in runs)
        loop = statistics.fmean(sync[r["seed"]]["loop_step_s"] / r["loop_step_s"] for r in runs)
        accuracy = [r["sampled"] for r in runs]
        lines.append(
            f"| {k} | {stage:.2f}x ({loop:.2f}x) | {statistics.fmean(accuracy):.3f}, "
            f"{min(accuracy):.3f} - {max(accuracy):.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tools.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args()
    results = []
    for seed in args.seeds:
        for k in args.staleness:
            results.append(one_run(args.config, seed, k, args.overrides))
            print(json.dumps(results[-1]), flush=True)
    text = report(results, args.config, args.overrides)
    (BENCH / "results").mkdir(exist_ok=True)
    (BENCH / "results" / "async_rollouts.md").write_text(text)
    (BENCH / "results" / "async_rollouts.json").write_text(json.dumps(results, indent=2))
    print(text)


if __name__ == "__main__":
    main()
