"""Anchors and the shared harness of the benchmarks.

Anchor libraries live in bench/.anchors/<name>-<version>, installed with --no-deps --target so that
they never change the project's own pins; `use_anchor` puts one on sys.path.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ANCHORS = Path(__file__).resolve().parent / ".anchors"


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
    to run (each in a fresh process) and returns the result written to --out.
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

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        def run_side(name: str) -> dict:
            out = root / f"{name}-{time.time_ns()}.json"
            subprocess.run([sys.executable, script, "--side", name, "--root", str(root), "--out", str(out)], check=True)
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


def pipeline_main(measure: Callable[[Path], dict]) -> None:
    """main() of a benchmark that runs the Prefect flow: `measure(root)` runs inside a fresh temporary
    directory with a Prefect server up (not timed) and returns the result written to --out."""
    import argparse
    import json
    import os
    import tempfile
    import warnings

    from prefect.testing.utilities import prefect_test_harness

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness(server_startup_timeout=180):
        result = measure(Path(tmp))
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
