"""Run every benchmark of bench/timing/, collect their JSON results into bench/results.json and results.md.

Each benchmark measures our code and its anchor in the same process, on identical work, and reports
ratios: absolute seconds on a shared machine mean little, ratios measured side by side do.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGES = ("torch", "transformers", "accelerate", "prefect", "mlflow")
# each row of results.json and the module of bench/timing/ that measures it, in the order they run
BENCHMARKS = {
    "async": "async_vs_sync",
    "demo": "demo_gold_gain",
    "dpo": "dpo_vs_trl",
    "engines": "hf_engine_vs_vllm",
    "generate": "generate_vs_transformers",
    "grpo": "grpo_vs_trl",
    "memory": "memory_vs_trl",
    "overhead": "flow_vs_bare_loops",
    "ppo": "ppo_vs_trl",
    "ray": "ray_vs_torchrun",
    "reward": "reward_model_vs_trl",
    "rloo": "rloo_vs_trl",
    "scaling": "scaling_vs_trl",
    "sft": "sft_vs_trainer",
}


def main(selected: list[str]) -> int:
    if {"-h", "--help", "--list"} & set(selected):
        print("usage: bench/run.py [NAME ...] (every row, or the rows named, keeping the others); the rows:")
        print("\n".join(f"  {name}: bench/timing/{module}.py" for name, module in BENCHMARKS.items()))
        return 0
    unknown = [name for name in selected if name not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmarks: {', '.join(unknown)} (the rows: {', '.join(BENCHMARKS)})", file=sys.stderr)
        return 2
    previous = HERE / "results.json"
    # a partial run (`bench/run.py reward`) updates its rows and keeps the others
    results = json.loads(previous.read_text())["results"] if selected and previous.is_file() else {}
    failed = []
    for name, module in BENCHMARKS.items():
        if selected and name not in selected:
            continue
        out = HERE / "results" / f"{name}.json"
        out.parent.mkdir(exist_ok=True)
        print(f"== {name}", flush=True)
        command = [sys.executable, "-m", f"bench.timing.{module}", "--out", str(out)]
        proc = subprocess.run(command, cwd=HERE.parent)
        if proc.returncode != 0 or not out.is_file():
            failed.append(name)
            continue
        results[name] = json.loads(out.read_text())
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {__import__('os').cpu_count()} cores",
        "python": platform.python_version(),
        "versions": {p: metadata.version(p) for p in PACKAGES},
        "results": results,
    }
    (HERE / "results.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"Measured {report['date']} on {report['machine']}; "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        "",
        "| benchmark | ours | anchor | ratio (ours / anchor) | notes |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        # a quality row (the demo's gold gain) shows the difference: a ratio of scores near zero means nothing
        compared = f"{r['gain']:+.3f} (gain)" if r.get("kind") == "gain" else f"{r['ratio']:.3f}"
        lines.append(
            f"| {name} | {r['ours']:.4g} {r['unit']} | {r['anchor']:.4g} {r['unit']} ({r['anchor_name']}) | "
            f"{compared} | {r.get('notes', '')} |"
        )
    for name, r in results.items():  # a benchmark's own table (e.g. a grid) goes in a section after the main one
        if r.get("table_md"):
            lines += ["", f"## {name}", "", r["table_md"]]
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if failed:
        print(f"failed benchmarks: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
