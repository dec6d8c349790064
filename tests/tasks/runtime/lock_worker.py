"""A second (real) process for tests/tasks/runtime/test_run_lock.py.

python lock_worker.py register URI OUT MODEL_DIR GO_FILE: wait for GO_FILE, then register MODEL_DIR once
    (fixed identity tags) into a fresh store; print the version's URI.
python lock_worker.py run URI OUT: take the run lock of OUT, start a pipeline run and a stage run,
    print "ready <pipeline run id> <stage run id>", then sleep until killed or terminated.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from rlhf_core.config import load_config  # noqa: E402
from tasks import registry, tracking  # noqa: E402
from tasks.runtime.run_lock import run_lock, terminate_on_sigterm  # noqa: E402


def config(uri: str, out: str):
    return load_config(
        None, [f"tracking.uri={uri}", "tracking.experiment=t", f"run.output_dir={out}", "run.name=worker"]
    )


def register(uri: str, out: str, model_dir: str, go_file: str) -> None:
    cfg = config(uri, out)
    print("waiting", flush=True)
    while not Path(go_file).exists():
        time.sleep(0.01)
    with tracking.runs.pipeline_run(cfg) as parent, tracking.runs.stage_run(parent, "sft") as run_id:
        tags = {"stage": "sft", "stage_key": "k", "step": "1"}
        print(
            registry.register_once(model_dir, "race-policy", task="text-generation", tags=tags, run_id=run_id),
            flush=True,
        )


def run(uri: str, out: str) -> None:
    cfg = config(uri, out)
    Path(out).mkdir(parents=True, exist_ok=True)
    with (
        run_lock(out),
        terminate_on_sigterm(),
        tracking.runs.pipeline_run(cfg) as parent,
        tracking.runs.stage_run(parent, "sft") as stage,
    ):
        print("ready", parent, stage, flush=True)
        time.sleep(120)


if __name__ == "__main__":
    {"register": register, "run": run}[sys.argv[1]](*sys.argv[2:])
