"""Data-parallel stages, the launching side: the Prefect task starts N training processes and streams their log.

With `run.num_processes > 1`, the reward and RL tasks call `launch(...)` instead of training in
the task's own process: it writes the task's inputs to a JSON spec (`worker_spec`: no credential
ever goes into it) and runs, by `run.launcher`,
- local: `torchrun --standalone --nproc_per_node N -m tasks.launch.worker <spec> <result>` (CPU: gloo) or
  `accelerate launch --num_processes N [--config_file run.accelerate_config] -m tasks.launch.worker ...` (CUDA);
- ray: `python -m tasks.launch.ray_driver <spec> <result>`, which joins or starts a Ray cluster and runs a Ray
  Train TorchTrainer of N workers (tasks/launch/ray_driver.py).
tasks/launch/worker.py, the worker side, runs the same task body in every process; the core loops shard
the data and average the gradients, and only rank 0 talks to MLflow (runs, metrics, registration:
`tasks.tracking` and `tasks.registry` are no-ops elsewhere), writes checkpoints and hands the result
back. The stage tasks import this module, never the worker's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

from rlhf_core.config.base import ConfigError
from rlhf_core.config.redaction import has_secret, redact, split_credentials
from tasks.stage_io import Checkpoint

WORKER_ENV = "RLHF_STAGE_WORKER"
WORKER_MODULE = "tasks.launch.worker"  # the worker entry point under torchrun / accelerate launch, run with -m
RAY_DRIVER_MODULE = "tasks.launch.ray_driver"  # the Ray Train driver, run with -m
# spec key: the environment variables every worker must have (the credentials that never enter the spec)
WORKER_ENV_NEEDED = "env_needed"


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def launched() -> bool:
    """True inside a process started by `launch` (the task body then trains instead of launching)."""
    return os.environ.get(WORKER_ENV) == "1"


def stage_logger():
    """The Prefect run logger inside a task, a plain logger inside a launched process."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        logger = logging.getLogger(f"rlhf.rank{rank()}")
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter(f"[rank {rank()}] %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False  # once: a root handler (Prefect's console one, Ray's) would print it again
        return logger


def worker_spec(stage: str, body, cfg, inputs: dict[str, Any]) -> tuple[dict, dict[str, str]]:
    """(the spec the workers read, the environment variables they need) for the `stage` task's body, a
    function (cfg, inputs) -> Checkpoint that every worker imports by its name.

    The spec holds the config and the task's inputs but never a credential: the tracking URI goes in
    without its `user:password@` (MLFLOW_TRACKING_USERNAME / PASSWORD carry them), and a URI whose secret
    cannot be taken out (a token as the user name, a ?token= parameter) not at all: the workers read
    MLFLOW_TRACKING_URI from their environment. That environment is passed to the processes this machine
    starts; on a Ray cluster each node must have it (docs/ray.md). `run.output_dir` goes in absolute,
    and the launching directory as `cwd`, so relative paths mean the same in every process.
    """
    config = cfg.model_dump(mode="json")
    uri = cfg.tracking_uri()
    clean, user, password = split_credentials(uri)
    env: dict[str, str] = {}
    if user is not None:
        env = {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}
    if has_secret(clean):
        config["tracking"]["uri"] = None
        env = {"MLFLOW_TRACKING_URI": uri}
    else:
        config["tracking"]["uri"] = clean
    config["run"]["output_dir"] = str(Path(cfg.run.output_dir).resolve())
    spec = {
        "stage": stage,
        "body": f"{body.__module__}:{body.__qualname__}",
        "config": config,
        "cwd": str(Path.cwd()),
        WORKER_ENV_NEEDED: sorted(env),
        "inputs": {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in inputs.items()},
    }
    leak = _secret_field(spec)
    if leak is not None:
        raise ConfigError(
            f"{leak} carries a credential, which would be written into the stage's worker spec; "
            "pass it through the environment (MLFLOW_TRACKING_URI, HF_TOKEN) instead"
        )
    return spec, env


def _secret_field(value: Any, where: str = "") -> str | None:
    """The dotted name of the first value in `value` that holds a credential, or None."""
    if isinstance(value, dict):
        for key, item in value.items():
            found = _secret_field(item, f"{where}.{key}" if where else str(key))
            if found is not None:
                return found
        return None
    if isinstance(value, list):
        return next((f for i, item in enumerate(value) if (f := _secret_field(item, f"{where}[{i}]"))), None)
    return where.removeprefix("config.").removeprefix("inputs.") if has_secret(json.dumps(value)) else None


def launch_command(cfg, spec: Path, result: Path) -> list[str]:
    """The command that runs the stage of `spec` on cfg.run.num_processes processes and writes `result`."""
    bin_dir = Path(sys.executable).parent
    n, restarts = str(cfg.run.num_processes), str(cfg.run.max_failures)
    if cfg.run.launcher == "ray":
        return [sys.executable, "-m", RAY_DRIVER_MODULE, str(spec), str(result)]
    worker = ["-m", WORKER_MODULE, str(spec), str(result)]
    if cfg.run.device == "cpu" or (cfg.run.device == "auto" and not _cuda()):
        command = [str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node", n]
        return command + (["--max-restarts", restarts] if cfg.run.max_failures else []) + worker
    command = [str(bin_dir / "accelerate"), "launch", "--num_processes", n]
    if cfg.run.max_failures:
        command += ["--max_restarts", restarts]
    if cfg.run.accelerate_config is not None:
        command += ["--config_file", str(cfg.run.accelerate_config)]
    else:
        command += [
            "--multi_gpu",
            "--num_machines",
            "1",
            "--mixed_precision",
            cfg.run.mixed_precision,
            "--dynamo_backend",
            "no",
        ]
    return command + worker


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
FAILURE_PREFIX = "rlhf-stage-failed: "  # a failed stage's last word (Ray driver, torchrun's rank 0): one sentence


def launch(stage: str, body, cfg, **inputs):
    """Run the `stage` task's `body` (its `worker_body`: cfg and the inputs as JSON -> Checkpoint) in
    cfg.run.num_processes processes; return its Checkpoint.

    Whatever way the processes end, the stage's MLflow runs they left RUNNING under `parent_run_id` are
    ended (a worker killed mid-stage cannot end its own)."""
    logger = stage_logger()
    spec_data, worker_env = worker_spec(stage, body, cfg, inputs)
    try:
        with tempfile.TemporaryDirectory(prefix=f"rlhf-{stage}-") as tmp:
            spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
            spec.write_text(json.dumps(spec_data))
            command = launch_command(cfg, spec, result)
            logger.info("%s stage on %d processes: %s", stage, cfg.run.num_processes, " ".join(command))
            env = {
                **os.environ,
                **worker_env,
                WORKER_ENV: "1",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                "RAY_COLOR_PREFIX": "0",
            }
            tail, failure = _stream(command, env, logger)
            if not result.is_file():  # (a failure said by an attempt that a restart then mended does not count)
                raise RuntimeError(
                    redact(failure)
                    if failure is not None
                    else f"the {stage} stage failed on {cfg.run.num_processes} processes ({cfg.run.launcher} "
                    "launcher): " + redact(" | ".join(list(tail)[-5:]))
                )
            return Checkpoint(**json.loads(result.read_text()))
    finally:
        if inputs.get("parent_run_id"):
            from tasks import tracking

            tracking.runs.end_orphan_stage_runs(inputs["parent_run_id"])


def _stream(command: list[str], env: dict[str, str], logger) -> tuple[deque[str], str | None]:
    """Run `command`, its output streamed into the task's log; (the last lines, the last failure sentence said)."""
    tail: deque[str] = deque(maxlen=30)
    failure = None
    with subprocess.Popen(
        command, cwd=Path.cwd(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        for raw in proc.stdout:
            line = _ANSI.sub("", raw).rstrip()
            if line:
                tail.append(line)
                logger.info(line)
                if line.startswith(FAILURE_PREFIX):
                    failure = line[len(FAILURE_PREFIX) :]
    return tail, failure
