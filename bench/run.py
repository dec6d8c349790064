"""Run every bench/bench_*.py, collect their JSON results into bench/results.json and results.md.

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


def main(selected: list[str]) -> int:
    previous = HERE / "results.json"
    # a partial run (`bench/run.py reward`) updates its rows and keeps the others
    results = json.loads(previous.read_text())["results"] if selected and previous.is_file() else {}
    failed = []
    for script in sorted(HERE.glob("bench_*.py")):
        name = script.stem.removeprefix("bench_")
        if selected and name not in selected:
            continue
        out = HERE / "results" / f"{name}.json"
        out.parent.mkdir(exist_ok=True)
        print(f"== {name}", flush=True)
        proc = subprocess.run([sys.executable, str(script), "--out", str(out)], cwd=HERE.parent)
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
