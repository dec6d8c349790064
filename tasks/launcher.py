"""Data-parallel stages, the launching side: the Prefect task starts N training processes and streams their log.

With `run.num_processes > 1`, the reward and RL tasks call `launch(...)` instead of training in
the task's own process: it writes the task's inputs to a JSON spec and runs
`torchrun --standalone --nproc_per_node N -m tasks.distributed <spec>` (CPU: gloo) or
`accelerate launch --num_processes N [--config_file run.accelerate_config] -m tasks.distributed <spec>`
(CUDA). tasks/distributed.py, the worker side, runs the same task body in every process; the core
loops shard the data and average the gradients, and only rank 0 talks to MLflow (runs, metrics,
registration: `tasks.tracking` and `tasks.registry` are no-ops elsewhere), writes checkpoints and
hands the result back. The stage tasks import this module, never the worker's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path

from tasks.stage_io import Checkpoint

WORKER_ENV = "RLHF_STAGE_WORKER"
WORKER_MODULE = "tasks.distributed"  # the worker entry point, run with -m


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
        return logger


def launch_command(cfg, spec: Path) -> list[str]:
    bin_dir = Path(sys.executable).parent
    n = str(cfg.run.num_processes)
    if cfg.run.device == "cpu" or (cfg.run.device == "auto" and not _cuda()):
        return [str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node", n, "-m", WORKER_MODULE, str(spec)]
    command = [str(bin_dir / "accelerate"), "launch", "--num_processes", n]
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
    return command + ["-m", WORKER_MODULE, str(spec)]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def launch(stage: str, cfg, **inputs):
    """Run the `stage` task body ("reward" or "rl") in cfg.run.num_processes processes; return its Checkpoint."""
    logger = stage_logger()
    with tempfile.TemporaryDirectory(prefix=f"rlhf-{stage}-") as tmp:
        spec = Path(tmp) / "spec.json"
        result = Path(tmp) / "result.json"
        spec.write_text(
            json.dumps(
                {
                    "stage": stage,
                    "config": cfg.model_dump(mode="json"),
                    "result": str(result),
                    "inputs": {
                        k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in inputs.items()
                    },
                }
            )
        )
        command = launch_command(cfg, spec)
        logger.info("%s stage on %d processes: %s", stage, cfg.run.num_processes, " ".join(command))
        tail: deque[str] = deque(maxlen=30)
        env = {**os.environ, WORKER_ENV: "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        # the task's working directory: relative paths in the config mean the same in every process
        with subprocess.Popen(
            command, cwd=Path.cwd(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as proc:
            for line in proc.stdout:  # stream the processes' log into the task's
                line = line.rstrip()
                if line:
                    tail.append(line)
                    logger.info(line)
        if proc.returncode != 0 or not result.is_file():
            raise RuntimeError(
                f"the {stage} stage failed on {cfg.run.num_processes} processes (exit {proc.returncode}): "
                + " | ".join(list(tail)[-5:])
            )
        return Checkpoint(**json.loads(result.read_text()))
