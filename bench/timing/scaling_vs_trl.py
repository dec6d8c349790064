"""Scaling: step time and peak memory of PPO and GRPO against TRL over model size and response length,
the fitted growth exponent per axis, and the efficiency of two data-parallel CPU processes (gloo).

Models: randomly initialized Llamas on the demo tokenizer (no SFT: timing only), sized by SIZES to
about 1M, 10M and 50M parameters (the exact counts are reported). Work, identical on both sides:
PPO 4 prompts per batch, 1 PPO epoch, 1 mini-batch, temperature 0.7, kl_coef 0.05, a value and a reward
model of the policy's size (ours `train_ppo`, TRL 1.12 `trl.experimental.ppo.PPOTrainer`); GRPO 4
prompts x 2 generations, beta 0.04 with the bias-corrected KL, loss dapo, scale_rewards group, the
VADER compound score as the reward (ours `train_grpo`, TRL 1.16 `GRPOTrainer`). Every response has
exactly N new tokens: ours with min_response_length = response_length (eos suppressed before N), TRL's
GRPO with min_new_tokens = max_completion_length, TRL's PPO with no stop token at all (its generation
kwargs are fixed; `stop_token=None` leaves the policy no eos id, so generation never ends early); the
new-token counts each side saw are recorded and shown. Each measured run is a fresh process (so its
peak RSS, ru_maxrss, is its own); 1 warm-up step, then TIMED steps; the step time is the wall time
between consecutive step-end callbacks (ours `on_step`, TRL `TrainerCallback.on_step_end`), averaged.
Best of REPEATS runs per point and side, in the order TRL, ours, ours, TRL (mirrored at every other point),
each process with GRID_THREADS torch threads.

Grid: `--grid sweep` (the default) measures two sweeps through a centre point, sizes at 64 tokens and
lengths at 10M; `--grid full` the whole 3 x 3 grid (over 15 minutes on a 2-core CPU). The exponent
per axis is the least-squares slope of log(step time) (and of log(peak RSS)) against log(parameters)
at 64 tokens and against log(length) at 10M.

Data parallel: our PPO at DP_SIZE / DP_LENGTH on a global batch of DP_BATCH prompts, one process x 2
torch threads against `torchrun --standalone --nproc_per_node 2` (gloo, CPU; as tests/distributed) x 1
thread each with half the batch per process (bench/helpers/scaling_worker.py); speedup t1 / t2, efficiency
t1 / (2 t2); one process x 1 thread is measured too. Best of 2 each, in mirrored order.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

from bench.helpers.anchors import side_process_main
from bench.helpers.scaling_sides import (
    CENTRE_LENGTH,
    CENTRE_SIZE,
    DP_BATCH,
    DP_LENGTH,
    DP_SHAPES,
    DP_SIZE,
    DP_STEPS,
    GRID_THREADS,
    PROMPTS,
    REPEATS,
    SIZES,
    TIMED,
    WARMUP,
    G,
    grid_points,
    sides,
)

# -- the measurement ---------------------------------------------------------------------------


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def fmt_tokens(values: list[float]) -> str:
    low, high = min(values, default=float("nan")), max(values, default=float("nan"))
    return f"{low:g}" if low == high else f"{low:g}-{high:g}"


def measure_grid(run_side, grid: str, params: dict[str, int]) -> dict:
    points = grid_points(grid)
    rows, failures = [], []
    for algo in ("ppo", "grpo"):
        for i, (size, length) in enumerate(points):
            done = {"trl": [], "ours": []}
            # TRL, ours, ours, TRL (mirrored at every other point), so drifting load hits both alike
            order = ("trl", "ours") if i % 2 == 0 else ("ours", "trl")
            for side in (order + order[::-1])[: 2 * REPEATS]:
                started = time.perf_counter()
                try:
                    result = run_side(f"{side}:{algo}:{size}:{length}")
                    done[side].append(result)
                except subprocess.CalledProcessError as error:
                    failures.append(f"{side} {algo} {size}/{length}: exit {error.returncode}")
                    result = {}
                print(
                    f"-- {side} {algo} {size} x {length}: {result} ({time.perf_counter() - started:.0f} s)", flush=True
                )
            if all(done.values()):
                runs = {}
                for side, results in done.items():
                    best = min(results, key=lambda r: r["seconds_per_step"])
                    runs[side] = {
                        **best,
                        "all_seconds": [r["seconds_per_step"] for r in results],
                        "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
                    }
                rows.append({"algo": algo, "size": size, "params": params[size], "length": length, **runs})
    fits = {}
    for algo in ("ppo", "grpo"):
        mine = [r for r in rows if r["algo"] == algo]
        axes = {
            "params": [r for r in mine if r["length"] == CENTRE_LENGTH],
            "length": [r for r in mine if r["size"] == CENTRE_SIZE],
        }
        for axis, sel in axes.items():
            if len(sel) < 2:
                continue
            xs = [r[axis] for r in sel]
            fits[f"{algo}/{axis}"] = {
                f"{side}_{what}": slope(xs, [r[side][key] for r in sel])
                for side in ("ours", "trl")
                for what, key in (("time", "seconds_per_step"), ("rss", "peak_rss_mb"))
            }
    return {"rows": rows, "fits": fits, "failures": failures}


def table_md(grid: dict, dp: dict, grid_name: str) -> str:
    lines = [
        f"Grid: {grid_name}; PPO {PROMPTS} prompts x 1 epoch, GRPO {PROMPTS} prompts x {G} generations; "
        f"{WARMUP} warm-up + {TIMED} timed steps; best of {REPEATS} runs per point and side (TRL, ours, ours, TRL or "
        f"mirrored), each in a fresh process with "
        f"{GRID_THREADS} torch thread, CPU.",
        "",
        "| algo | params | new tokens | ours s/step | TRL s/step | ratio (ours / TRL) | ours peak RSS MB | TRL peak RSS MB"
        " | new tokens seen (ours / TRL) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in grid["rows"]:
        o, t = r["ours"], r["trl"]
        lines.append(
            f"| {r['algo']} | {r['params'] / 1e6:.2f}M ({r['params']:,}) | {r['length']} | {o['seconds_per_step']:.3f} | "
            f"{t['seconds_per_step']:.3f} | {o['seconds_per_step'] / t['seconds_per_step']:.2f} | "
            f"{o['peak_rss_mb']:.0f} | {t['peak_rss_mb']:.0f} | {fmt_tokens(o['new_tokens'])} / {fmt_tokens(t['new_tokens'])} |"
        )
    lines += [
        "",
        "Growth exponents: least-squares slope of log(step time) and log(peak RSS) against log(parameters) at "
        f"{CENTRE_LENGTH} tokens and against log(new tokens) at {CENTRE_SIZE}.",
        "",
        "| algo | axis | ours time | TRL time | ours peak RSS | TRL peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for key, f in grid["fits"].items():
        algo, axis = key.split("/")
        lines.append(
            f"| {algo} | {axis} | {f['ours_time']:.2f} | {f['trl_time']:.2f} | {f['ours_rss']:.2f} | {f['trl_rss']:.2f} |"
        )
    if dp:
        runs = dp["runs"]
        lines += [
            "",
            f"Data parallel: our PPO, {DP_SIZE} model, {DP_LENGTH} tokens, global batch {DP_BATCH} prompts "
            f"({DP_BATCH // 2} per process when 2), {DP_STEPS - WARMUP} timed steps, best of 2, order 1x2 2x1 1x1 1x1 2x1 1x2.",
            "",
            "| processes x torch threads | s/step | peak RSS MB per process |",
            "|---|---|---|",
            *(
                f"| {shape.replace('x', ' x ')}{' (gloo, torchrun)' if shape.startswith('2') else ''} | "
                f"{run['seconds_per_step']:.3f} | {' + '.join(f'{m:.0f}' for m in run['rank_rss_mb'])} |"
                for shape, run in runs.items()
            ),
            "",
            f"Against the faster single process ({dp['baseline'].replace('x', ' process x ')} thread(s)): speedup t1 / t2 "
            f"{dp['speedup']:.2f}, scaling efficiency t1 / (2 t2) {dp['efficiency']:.2f}"
            + (
                f"; against 1 x 2 threads as such: speedup {dp['speedup_1x2']:.2f}, efficiency {dp['efficiency_1x2']:.2f}"
                if "speedup_1x2" in dp
                else ""
            )
            + (
                " (2 OpenMP threads ran slower than 1: another job held a core, so that comparison measures the "
                "contention, not the data parallelism)."
                if dp["baseline"] == "1x1" and "speedup_1x2" in dp
                else "."
            ),
        ]
    if grid["failures"]:
        lines += ["", "Failed: " + "; ".join(grid["failures"])]
    return "\n".join(lines)


def measure(run_side, grid_name: str) -> dict:
    started = time.perf_counter()
    counts = {size: n for size, n in run_side("params").items() if size in SIZES}
    grid = measure_grid(run_side, grid_name, counts)
    dp_runs = {shape: [] for shape in DP_SHAPES}
    for shape in (*DP_SHAPES, *reversed(DP_SHAPES)):  # best of 2, in mirrored order against drift
        try:
            dp_runs[shape].append(run_side(f"dp{shape[0]}x{shape[1]}"))
        except subprocess.CalledProcessError as error:
            grid["failures"].append(f"data parallel {shape[0]} x {shape[1]}: exit {error.returncode}")
    best = {shape: min(runs, key=lambda r: r["seconds_per_step"]) for shape, runs in dp_runs.items() if runs}
    dp = {}
    singles = [shape for shape in best if shape[0] == 1]
    if (2, 1) in best and singles:
        # the baseline is the faster one-process setting on the same 2 cores: 1 x 2 threads is the intended one,
        # but when another job holds a core its OpenMP threads stall and 1 x 1 thread wins
        base = min(singles, key=lambda shape: best[shape]["seconds_per_step"])
        t1, t2 = best[base]["seconds_per_step"], best[(2, 1)]["seconds_per_step"]
        dp = {
            "runs": {f"{p}x{t}": run for (p, t), run in best.items()},
            "baseline": f"{base[0]}x{base[1]}",
            "t1": t1,
            "t2": t2,
            "speedup": t1 / t2,
            "efficiency": t1 / (2 * t2),
        }
        if (1, 2) in best:
            dp["speedup_1x2"] = best[(1, 2)]["seconds_per_step"] / t2
            dp["efficiency_1x2"] = dp["speedup_1x2"] / 2
    rows, fits = grid["rows"], grid["fits"]
    by = {(r["algo"], r["size"], r["length"]): r for r in rows}
    head = by.get(("ppo", "50M", 256)) or by.get(("ppo", "50M", CENTRE_LENGTH)) or (rows[-1] if rows else None)
    geo = {}
    for algo in ("ppo", "grpo"):
        ratios = [r["ours"]["seconds_per_step"] / r["trl"]["seconds_per_step"] for r in rows if r["algo"] == algo]
        geo[algo] = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")

    def exps(algo: str) -> str:
        p, n = fits.get(f"{algo}/params"), fits.get(f"{algo}/length")
        parts = []
        if p:
            parts.append(f"params {p['ours_time']:.2f} vs {p['trl_time']:.2f}")
        if n:
            parts.append(f"length {n['ours_time']:.2f} vs {n['trl_time']:.2f}")
        return ", ".join(parts)

    nan = float("nan")
    ours = head["ours"]["seconds_per_step"] if head else nan
    anchor = head["trl"]["seconds_per_step"] if head else nan
    where = f"{head['params'] / 1e6:.0f}M params x {head['length']} tokens" if head else "no point"
    notes = (
        f"PPO s/step at {where}; geometric-mean ratio over the grid PPO {geo['ppo']:.2f}, GRPO {geo['grpo']:.2f}; "
        f"step-time exponents ours vs TRL: PPO {exps('ppo')}; GRPO {exps('grpo')}; "
        + (
            f"2 gloo CPU processes x 1 thread vs the faster single process ({dp['baseline'].replace('x', ' process x ')} "
            f"thread(s)) on the same global batch: speedup {dp['speedup']:.2f}, efficiency {dp['efficiency']:.2f}"
            + (
                f" (vs 1 x 2 threads: {dp['speedup_1x2']:.2f}, {dp['efficiency_1x2']:.2f})"
                if "speedup_1x2" in dp
                else ""
            )
            + "; "
            if dp
            else "data-parallel run failed; "
        )
        + f"{grid_name} grid ({len(rows)} of {2 * len(grid_points(grid_name))} points), "
        f"models {', '.join(f'{n / 1e6:.2f}M' for n in counts.values())}, random init, CPU; table below"
    )
    if grid["failures"]:
        notes += f"; {len(grid['failures'])} runs failed"
    return {
        "metric": "seconds per RL step across model sizes and response lengths",
        "unit": "s/step",
        "ours": ours,
        "anchor": anchor,
        "anchor_name": "trl 1.12.0 experimental PPOTrainer (PPO), trl 1.16.0 GRPOTrainer (GRPO)",
        "ratio": ours / anchor,
        "grid": grid_name,
        "params": counts,
        "rows": rows,
        "fits": fits,
        "geomean_ratio": geo,
        "data_parallel": dp,
        "failures": grid["failures"],
        "wall_s": time.perf_counter() - started,
        "notes": notes,
        "table_md": table_md(grid, dp, grid_name),
    }


def main() -> None:
    os.environ["OMP_NUM_THREADS"] = str(GRID_THREADS)  # every side process (the workers set their own)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--grid", choices=("sweep", "full"), default=os.environ.get("SCALING_GRID", "sweep"))
    known, rest = parser.parse_known_args()
    sys.argv = [sys.argv[0], *rest]  # the rest is side_process_main's (--out, --side, --root)
    side_process_main(
        __file__,
        sides(),
        ("trl", "1.16.0"),  # unused: no side is named "trl"; each TRL side puts its own version on the path
        lambda run_side: measure(run_side, known.grid),
    )


if __name__ == "__main__":
    main()
