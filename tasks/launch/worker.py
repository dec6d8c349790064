"""Data-parallel stages, the worker side: the stage task's body in each launched process.

tasks/launch/launcher.py writes the spec (the stage, the config without credentials, the task's inputs) and
starts N processes, either `python -m tasks.launch.worker <spec> <result>` under torchrun (CPU) or
accelerate launch (CUDA), or a Ray Train TorchTrainer whose workers call `ray_worker(spec)`
(tasks/launch/ray_driver.py). Both run `run_stage`: the stage task's body with `launched()` true, so it
trains instead of launching again; rank 0's Checkpoint is the result (a file beside the spec under
torchrun, the training function's return value under Ray). This module imports the stage tasks;
they import only the launcher.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import socket
import sys
from pathlib import Path

from rlhf_core.config import PipelineConfig
from rlhf_core.config.errors import UserError
from rlhf_core.storage.shared import SharedStorageError, check_shared_storage
from rlhf_core.training.parallel import all_gather_objects, from_main
from tasks.launch.launcher import WORKER_ENV, WORKER_ENV_NEEDED, is_main, rank, stage_logger
from tasks.launch.story import FAILURE_PREFIX, REFUSAL_PREFIX, node_label, resume_step


def missing_env(spec: dict) -> list[str]:
    """The environment variables the spec's workers need (the credentials that never travel in it) and this
    process lacks."""
    return [name for name in spec.get(WORKER_ENV_NEEDED, []) if not os.environ.get(name)]


def env_verdict(views: list[tuple[str, list[str]]]) -> str | None:
    """The sentence for every process's (node, variables it lacks), or None when none lacks any."""
    lacking = [(node, names) for node, names in views if names]
    if not lacking:
        return None
    node, names = lacking[0]
    return (
        f"the worker on {node} has no {' / '.join(names)} in its environment, and the tracking credentials are "
        "never sent to the workers: set them in the environment of every node of the cluster (docs/ray.md)"
    )


def run_stage(spec: dict) -> dict | None:
    """The stage's task body on this process: rank 0's Checkpoint as a dict, None on the other ranks.

    The spec names the body ("module:function", `launcher.launch`'s `body`): the worker imports it here,
    not above, so a Ray worker checks its storage and credentials before it pays for the stage's imports
    (transformers, MLflow, Prefect) and a cluster that cannot run the stage says so in seconds."""
    from tasks import tracking

    cfg = PipelineConfig.model_validate(spec["config"])
    tracking.store.configure(cfg.tracking_uri())
    step = resume_step(spec.get("checkpoints"))
    if step is not None and is_main():
        stage_logger().info("the %s stage resumes from checkpoint %d", spec["stage"], step)
    module, _, name = spec["body"].partition(":")
    out = getattr(importlib.import_module(module), name)(cfg, spec["inputs"])
    return json.loads(json.dumps(dataclasses.asdict(out), default=str)) if is_main() else None


def ray_worker(spec: dict) -> dict:
    """One Ray Train worker: Ray has set RANK, WORLD_SIZE and the process group (gloo on CPU, NCCL on GPU).

    Accelerate is told to stay on the CPU where there is no GPU (a plain Accelerator there would see no
    distributed setup and never all-reduce); the driver's working directory is used where this node has
    it (relative paths in the config mean the same as on the driver); `run.output_dir` is proven shared
    before any training, and so is the presence of the credentials the spec leaves out. Returns
    {"checkpoint": rank 0's Checkpoint} or, when either is missing, {"error": the sentence} on every rank:
    an error that a restart cannot mend is not raised, so Ray does not spend run.max_failures on it.
    """
    import ray
    import torch

    os.environ[WORKER_ENV] = "1"
    cfg = PipelineConfig.model_validate(spec["config"])
    if cfg.run.device == "cpu" or not torch.cuda.is_available():
        os.environ["ACCELERATE_USE_CPU"] = "true"
    if Path(spec["cwd"]).is_dir():
        os.chdir(spec["cwd"])
    node = node_label(ray.get_runtime_context().get_node_id(), socket.gethostname(), ray.util.get_node_ip_address())
    verdict = env_verdict(all_gather_objects((node, missing_env(spec))))
    if verdict is not None:
        return {"error": verdict}
    try:
        check_shared_storage(
            cfg.run.output_dir,
            rank(),
            int(os.environ["WORLD_SIZE"]),
            node,
            from_main=from_main,
            all_gather=all_gather_objects,
        )
    except SharedStorageError as err:
        return {"error": str(err)}
    return {"checkpoint": run_stage(spec)}


def main(spec_path: str, result_path: str) -> None:
    """torchrun's and accelerate launch's entry point: rank 0 writes the result beside the spec, or says in
    one line why the stage failed (the launcher raises it). A user error (a config, data or guard stop) is
    said with `REFUSAL_PREFIX` and marked beside the spec: the processes torchrun restarts then end at once."""
    spec = json.loads(Path(spec_path).read_text())
    refused = Path(spec_path).with_name("refused")
    try:
        if refused.is_file():
            raise StageRefused(refused.read_text())
        out = run_stage(spec)
    except (UserError, StageRefused) as err:
        sentence = " ".join(str(err).split())
        refused.write_text(sentence)
        print(REFUSAL_PREFIX + sentence, flush=True)
        sys.exit(1)
    except Exception as err:
        if is_main():
            world = os.environ.get("WORLD_SIZE", "?")
            print(
                f"{FAILURE_PREFIX}the {spec['stage']} stage failed on rank 0 of {world} processes: "
                f"{type(err).__name__}: {err}",
                flush=True,
            )
        raise
    if out is not None:
        Path(result_path).write_text(json.dumps(out))


class StageRefused(Exception):
    """An earlier attempt of the stage was refused by a user error (its sentence): a restart ends at once."""


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
