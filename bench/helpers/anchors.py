"""Anchors and the shared harness of the benchmarks.

Anchor libraries live in bench/.anchors/<name>-<version>, installed with --no-deps --target so that
they never change the project's own pins; `use_anchor` puts one on sys.path.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ANCHORS = BENCH / ".anchors"


def use_anchor(package: str, version: str) -> Path:
    target = ANCHORS / f"{package}-{version}"
    if not (target / package).is_dir():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(target),
                f"{package}=={version}",
            ],
            check=True,
        )
    sys.path.insert(0, str(target))
    return target


def side_process_main(
    script: str, sides: dict, anchor: tuple[str, str], measure: Callable[[Callable[[str], dict]], dict]
) -> None:
    """The shared entry point of the per-process benchmarks (PPO, GRPO).

    With --side NAME this process runs one side (`sides[NAME](root)`) and writes its JSON with the
    peak RSS; without it, it prepares a temporary root, and `measure(run_side)` decides which sides
    to run (each in a fresh process: `script`, the benchmark's file, run again as its module from the
    repository root) and returns the result written to --out.
    """
    import argparse
    import json
    import resource
    import tempfile
    import time
    import warnings

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--side", choices=sorted(sides))
    parser.add_argument("--root")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.side:
        if args.side == "trl":
            use_anchor(*anchor)
        result = sides[args.side](Path(args.root))
        if result is not None:
            result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            Path(args.out).write_text(json.dumps(result))
        return

    module = ".".join(Path(script).resolve().relative_to(BENCH.parent).with_suffix("").parts)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        def run_side(name: str) -> dict:
            out = root / f"{name}-{time.time_ns()}.json"
            command = [sys.executable, "-m", module, "--side", name, "--root", str(root), "--out", str(out)]
            subprocess.run(command, check=True, cwd=BENCH.parent)
            return json.loads(out.read_text()) if out.is_file() else {}

        run_side("prepare")
        result = measure(run_side)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def interleaved(run_side: Callable[[str], dict]) -> tuple[list[dict], list[dict]]:
    """(anchor runs, our runs): TRL, ours, ours, TRL, TRL, ours, so drifting load hits both alike."""
    anchor, ours = [], []
    for side in "TOOTTO":
        (anchor if side == "T" else ours).append(run_side("trl" if side == "T" else "ours"))
    return anchor, ours


def pipeline_main(measure: Callable[[Path, float], dict]) -> None:
    """main() of a benchmark that runs the Prefect flow: `measure(root, server_startup_s)` runs inside a fresh
    temporary directory with a Prefect server up (its start-up timed apart) and returns the result written to --out."""
    import argparse
    import json
    import os
    import tempfile
    import time
    import warnings

    from prefect.testing.utilities import prefect_test_harness

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness(server_startup_timeout=180):
        result = measure(Path(tmp), time.perf_counter() - start)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


# the phases of one RL step (rlhf_core/training/timing.py), in the order a step runs them
STEP_PHASES = ("generate", "policy_logprobs", "reference", "reward", "value", "optimize")


def phase_means(logged: list[dict[str, float]]) -> dict[str, float]:
    """The mean of every `time/<phase>_s` and of `perf/step_seconds` over the metric dicts a run logged."""
    keys = [f"time/{p}_s" for p in STEP_PHASES] + ["perf/step_seconds"]
    return {k: sum(m[k] for m in logged if k in m) / n for k in keys if (n := sum(k in m for m in logged))}


def phase_table(algorithm: str, means: dict[str, float]) -> str:
    """Markdown: where one RL step's time goes, per phase, in seconds and as a share of the whole step."""
    step = means.get("perf/step_seconds", float("nan"))
    rows = [f"| {algorithm} step phase | mean s/step | share of the step |", "|---|---|---|"]
    for phase in STEP_PHASES:
        if f"time/{phase}_s" in means:
            seconds = means[f"time/{phase}_s"]
            rows.append(f"| `time/{phase}_s` | {seconds:.4f} | {seconds / step:.0%} |")
    timed = sum(means.get(f"time/{p}_s", 0.0) for p in STEP_PHASES)
    rows.append(f"| the rest of the step (batching, metrics) | {step - timed:.4f} | {(step - timed) / step:.0%} |")
    rows.append(f"| `perf/step_seconds` (whole step) | {step:.4f} | 100% |")
    return "\n".join(rows)
