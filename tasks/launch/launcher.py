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
import time
from collections import deque
from pathlib import Path
from typing import Any

from rlhf_core.config.base import ConfigError
from rlhf_core.config.errors import UserError
from rlhf_core.config.redaction import has_secret, redact, split_credentials
from tasks.launch.story import ConsoleFilter
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


class StageFailedError(RuntimeError):
    """A launched stage did not finish (a worker lost after the restarts, an error in a worker); the message is
    one sentence that names what failed, where, and the stage's log file."""


class StageRefusedError(UserError):
    """A worker refused the stage with a user error (a config, data or guard stop): its sentence, no restart."""


def log_path(cfg, stage: str) -> Path:
    """The file that holds every line a launched stage's processes print: `<run.output_dir>/logs/<stage>.log`."""
    return Path(cfg.run.output_dir).resolve() / "logs" / f"{stage}.log"


def launch(stage: str, body, cfg, checkpoints: Path | None = None, **inputs):
    """Run the `stage` task's `body` (its `worker_body`: cfg and the inputs as JSON -> Checkpoint) in
    cfg.run.num_processes processes; return its Checkpoint. `checkpoints` is the directory the stage saves
    them in, for the story of a restart (which checkpoint the workers resume from).

    Every line the processes print goes to the stage's log file (`log_path`); on the console, the workers'
    lines under torchrun, and under Ray the story and the workers' own `[rank N]` lines (tasks/launch/story.py).
    Whatever way the processes end, the stage's MLflow runs they left RUNNING under `parent_run_id` are
    ended (a worker killed mid-stage cannot end its own)."""
    logger = stage_logger()
    spec_data, worker_env = worker_spec(stage, body, cfg, inputs)
    spec_data["checkpoints"] = str(Path(checkpoints).resolve()) if checkpoints is not None else None
    log = log_path(cfg, stage)
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix=f"rlhf-{stage}-") as tmp:
            spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
            spec.write_text(json.dumps(spec_data))
            command = launch_command(cfg, spec, result)
            logger.info(
                "%s stage on %d processes: %s (their output: %s)", stage, cfg.run.num_processes, " ".join(command), log
            )
            env = {
                **os.environ,
                **worker_env,
                WORKER_ENV: "1",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                "RAY_COLOR_PREFIX": "0",
                "RAY_DEDUP_LOGS": "0",  # Ray would fold the workers' lines that differ only in numbers (the ranks)
            }
            console = ConsoleFilter(story_only=cfg.run.launcher == "ray")
            tail = _stream(command, env, logger, console, log)
            if not result.is_file():  # (a failure said by an attempt that a restart then mended does not count)
                if console.refusal is not None:
                    raise StageRefusedError(redact(console.refusal))
                said = console.failure or (
                    f"the {stage} stage failed on {cfg.run.num_processes} processes ({cfg.run.launcher} launcher): "
                    + " | ".join(list(tail)[-5:])
                )
                raise StageFailedError(f"{redact(said)}; every line of its processes is in {log}")
            return Checkpoint(**json.loads(result.read_text()))
    finally:
        if inputs.get("parent_run_id"):
            from tasks import tracking

            tracking.runs.end_orphan_stage_runs(inputs["parent_run_id"])


def _stream(command: list[str], env: dict[str, str], logger, console: ConsoleFilter, log: Path) -> deque[str]:
    """Run `command`: every line into `log`, what `console` keeps into the task's log; the last lines."""
    tail: deque[str] = deque(maxlen=30)
    with (
        open(log, "a", encoding="utf-8") as sink,
        subprocess.Popen(
            command, cwd=Path.cwd(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as proc,
    ):
        sink.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n")
        for raw in proc.stdout:
            line = _ANSI.sub("", raw).rstrip()
            if not line:
                continue
            sink.write(redact(line) + "\n")
            sink.flush()
            tail.append(line)
            shown = console.keep(line)
            if shown is not None:
                logger.info(shown)
    return tail
