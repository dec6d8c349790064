"""The Ray launcher: one stage on 2 Ray workers against 2 torchrun processes and 1 process, and Ray's start-up.

The stage is the pipeline's reward task (`tasks.stages.reward_model.reward_stage`, the whole task: launch, the
workers' start, training, checkpoints, registration into a SQLite store, the result back) on the demo
world of configs/demo.yaml with STEPS steps of a global batch of BATCH pairs: 1 process with 2 torch
threads; `run.launcher: local` (torchrun, 2 gloo processes x 1 thread, BATCH / 2 pairs each); and
`run.launcher: ray` with `run.ray_address: null` (a private local Ray instance started and stopped by the
stage, a Ray Train TorchTrainer of 2 workers x 1 CPU). Each run in a fresh process with its own output
directory and tracking store (so nothing is reused); order 1, torchrun, Ray, Ray, torchrun, 1; best of two.
Ray's start-up is measured apart: `ray.init` of a private instance (with the dashboard, as the launcher
starts it), then a 2-worker TorchTrainer whose training function returns at once, then `ray.shutdown`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from bench.helpers.anchors import side_process_main

REPO = Path(__file__).resolve().parents[2]
STEPS, BATCH = 60, 32  # BATCH pairs per step in all: BATCH / N on each of N processes
OVERRIDES = [f"reward.max_steps={STEPS}", f"reward.eval_steps={STEPS}"]
OVERRIDES += [f"reward.save_steps={STEPS}", "sft.enabled=false", "init.policy=base"]
SHAPES = {"one": ("local", 1), "torchrun": ("local", 2), "ray": ("ray", 2)}


def config(root: Path, name: str, launcher: str = "local", processes: int = 1):
    from rlhf_core.config import load_config

    out = root / name
    return load_config(
        REPO / "configs" / "demo.yaml",
        [
            *OVERRIDES,
            f"run.output_dir={out}",
            f"tracking.uri=sqlite:///{out / 'mlflow.db'}",
            f"run.launcher={launcher}",
            f"run.num_processes={processes}",
            f"reward.batch_size={BATCH // processes}",
        ],
    )


def prepare(root: Path) -> None:
    """The demo world and its tables, once, shared by every run (the data task, in a flow of its own)."""
    from prefect import flow
    from prefect.testing.utilities import prefect_test_harness

    from tasks import tracking
    from tasks.stages.data import data_stage

    cfg = config(root, "base")

    @flow
    def data_only(run_id: str):
        return data_stage(cfg, run_id)

    with prefect_test_harness(server_startup_timeout=180), tracking.runs.pipeline_run(cfg) as run_id:
        data = data_only(run_id)
    (root / "data.json").write_text(json.dumps(data.__dict__, default=str))


def stage(shape: str):
    def run(root: Path) -> dict:
        from tasks import tracking
        from tasks.stages.data import PreparedData
        from tasks.stages.reward_model import reward_stage

        launcher, processes = SHAPES[shape]
        data = PreparedData(**json.loads((root / "data.json").read_text()))
        cfg = config(root, f"{shape}-{time.time_ns()}", launcher, processes)
        with tracking.runs.pipeline_run(cfg) as run_id:
            start = time.perf_counter()
            out = reward_stage.fn(cfg, data, None, run_id)
            seconds = time.perf_counter() - start
        accuracy = next((v for k, v in out.metrics.items() if k.endswith("eval_accuracy")), float("nan"))
        return {"seconds": seconds, "accuracy": accuracy}

    return run


def train_nothing(config: dict) -> dict:
    return {}


def startup(root: Path) -> dict:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    start = time.perf_counter()
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=True)
    started = time.perf_counter()
    TorchTrainer(
        train_nothing,
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="startup", storage_path=str(root / "ray-train")),
    ).fit()
    fitted = time.perf_counter()
    ray.shutdown()
    return {"init_s": started - start, "workers_s": fitted - started, "shutdown_s": time.perf_counter() - fitted}


def measure(run_side) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in SHAPES}
    for name in ("one", "torchrun", "ray", "ray", "torchrun", "one"):
        runs[name].append(run_side(name))
    best = {name: min(r["seconds"] for r in found) for name, found in runs.items()}
    boot = run_side("startup")
    table = [
        "| shape | best of 2 (s) | / 1 process | held-out accuracy |",
        "|---|---|---|---|",
        *(
            f"| {label} | {best[name]:.1f} | {best[name] / best['one']:.2f} | {runs[name][0]['accuracy']:.3f} |"
            for name, label in (
                ("one", "1 process x 2 threads"),
                ("torchrun", "torchrun, 2 processes x 1 thread"),
                ("ray", "Ray (private instance), 2 workers x 1 CPU"),
            )
        ),
        "",
        f"Ray start-up apart: ray.init {boot['init_s']:.1f} s, a 2-worker TorchTrainer that does nothing "
        f"{boot['workers_s']:.1f} s, ray.shutdown {boot['shutdown_s']:.1f} s.",
    ]
    return {
        "unit": "s/stage",
        "ours": best["ray"],
        "anchor": best["torchrun"],
        "anchor_name": "the same stage under torchrun, 2 processes",
        "ratio": best["ray"] / best["torchrun"],
        "one_process_s": best["one"],
        "startup": boot,
        "table_md": "\n".join(table),
        "notes": (
            f"reward stage, {STEPS} steps x {BATCH} pairs, demo world, CPU; Ray / 1 process "
            f"{best['ray'] / best['one']:.2f}, torchrun / 1 process {best['torchrun'] / best['one']:.2f}; "
            f"Ray start-up {boot['init_s']:.1f} s + {boot['workers_s']:.1f} s for the workers; best of 2"
        ),
    }


if __name__ == "__main__":
    side_process_main(
        __file__,
        {"prepare": prepare, "startup": startup, **{name: stage(name) for name in SHAPES}},
        ("trl", "1.16.0"),  # no side here uses an anchor package
        measure,
    )
