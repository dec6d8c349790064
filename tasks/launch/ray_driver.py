"""Data-parallel stages on Ray: `python -m tasks.launch.ray_driver <spec> <result>`, started by tasks/launch/launcher.py.

The driver joins the cluster at `run.ray_address` ('auto', 'host:port') or, when it is null, starts a
private local Ray instance sized for the workers and stops it after. It refuses what a cluster cannot do
for the run (too few CPUs or GPUs for the workers; a tracking store that lives on this machine when the
nodes are on several hosts) in one sentence, then runs a Ray Train `TorchTrainer` with
`run.num_processes` workers that each run `tasks.launch.worker.ray_worker` (the same stage body as under
torchrun), placed by `run.ray_placement_strategy`. When a worker dies, Ray Train restarts the worker
group up to `run.max_failures` times and the stage resumes from its newest complete checkpoint in
`run.output_dir`. Rank 0's Checkpoint comes back through Ray as the training function's return value;
the driver hands it to the launcher in `<result>` beside the spec, on this machine.

A failure ends with one line that the launcher raises: `REFUSAL_PREFIX` + a sentence for what the user can
change (a cluster that cannot hold the workers, no cluster at run.ray_address, storage not shared, a user
error in a worker: never restarted), `FAILURE_PREFIX` + a sentence for a stage that failed after its
restarts (tasks/launch/story.py; the stage's story is told by tasks/launch/ray_callback.py). The driver runs in
its own process so that the Ray job's entry point (its command line, which Ray records) holds nothing but
two temporary file names, and so that `ray.init` never meets Prefect's process.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import uuid
from pathlib import Path

from rlhf_core.config import RunConfig as RunSettings
from tasks.launch.story import FAILURE_PREFIX, REFUSAL_PREFIX, STORY_PREFIX, failure_line, plural

# Ray Train's cluster-wide, detached actor (ray.data's autoscaling coordinator), created by the first trainer
# of a cluster; a stage that created it removes it (`fit`)
COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")


class StageFailure(RuntimeError):
    """The stage cannot run, or did not finish, on Ray; the message is the sentence the user sees."""


class StageRefusal(StageFailure):
    """A worker refused the stage with a user error (a config, data or guard stop); its sentence."""


def train_loop(spec: dict) -> dict:
    """The training function of every Ray Train worker (pickled by reference: `tasks.launch.ray_driver.train_loop`)."""
    from tasks.launch.worker import ray_worker

    return ray_worker(spec)


def hosts_of(nodes: list[dict]) -> list[str]:
    """The distinct addresses of the alive nodes in `ray.nodes()`, sorted."""
    return sorted({node["NodeManagerAddress"] for node in nodes if node.get("Alive")})


def local_store_verdict(uri: str, nodes: list[dict], is_local_store) -> str | None:
    """The sentence refusing a tracking store on this machine for a cluster whose nodes span several hosts."""
    hosts = hosts_of(nodes)
    if len(hosts) < 2 or not is_local_store(uri):
        return None
    return (
        f"tracking.uri {uri} is a store on this machine only, and the Ray cluster's nodes are on {len(hosts)} "
        f"hosts ({', '.join(hosts)}): the worker that logs to MLflow (rank 0) may run on another host, and "
        "SQLite over a network file system is not safe for two writers; use a tracking server (http://...)"
    )


def capacity_verdict(total: dict, workers: int, cpus: float, gpus: float) -> str | None:
    """The sentence when the cluster's resources (`ray.cluster_resources()`) cannot hold the workers."""
    short = [
        f"{need:g} {name} ({workers} workers x {per:g}, {field}) but the cluster has {total.get(name, 0):g}"
        for name, per, field in (("CPU", cpus, "run.ray_cpus_per_worker"), ("GPU", gpus, "run.device cuda"))
        if per and (need := workers * per) > total.get(name, 0)
    ]
    if not short:
        return None
    return f"run.num_processes {workers} needs {'; '.join(short)}; lower run.num_processes or add nodes"


def failure_sentence(stage: str, error: BaseException, max_failures: int) -> str:
    """One sentence for a TorchTrainer that ended in `error` without `StageStory` naming it (a failure of Ray's
    own, such as workers that could not be placed; or worker failures without the controller's word)."""
    failures = getattr(error, "worker_failures", None) or {}
    if failures:
        from tasks.launch.ray_callback import first_failure

        rank, gone, cause = first_failure(failures)
        what = f"rank {rank} {'lost' if gone else 'failed'}: {cause}"
    else:
        lines = str(error).strip().splitlines()
        what = lines[-1] if lines else type(error).__name__
    return failure_line(stage, what, max_failures, max_failures)


def stage_failure(stage: str, error: BaseException, max_failures: int) -> StageFailure:
    """What the driver says for a TorchTrainer that failed: the refusal or the sentence the controller's
    `StageStory` raised (Ray Train wraps it in a ControllerError), else `failure_sentence`."""
    from tasks.launch.ray_callback import StageLost, StageRefused

    cause = getattr(error, "controller_failure", None)
    if isinstance(cause, StageRefused):
        return StageRefusal(str(cause))
    return StageFailure(str(cause) if isinstance(cause, StageLost) else failure_sentence(stage, error, max_failures))


def connect(run: RunSettings, stage: str) -> None:
    """Connect to run.ray_address, or start a private local instance with CPUs enough for the workers
    (`ray.shutdown()` stops it)."""
    import ray

    if run.ray_address is not None:
        ray.init(address=run.ray_address, log_to_driver=True)
    else:
        cpus = max(os.cpu_count() or 1, math.ceil(run.num_processes * run.ray_cpus_per_worker))
        # the dashboard serves the state API, which Ray Train's placement-group cleaner polls every second
        ray.init(address="local", num_cpus=cpus, include_dashboard=True, log_to_driver=True)
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    where = (
        "a private Ray instance"
        if run.ray_address is None
        else f"the Ray cluster at {ray.get_runtime_context().gcs_address}"
    )
    cpus = ray.cluster_resources().get("CPU", 0)
    print(f"{STORY_PREFIX}{stage} stage: joined {where}: {plural(len(nodes), 'node')}, {cpus:g} CPUs", flush=True)


def coordinator_exists() -> bool:
    import ray

    try:
        ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
    except ValueError:
        return False
    return True


def remove_coordinator() -> None:
    """Kill Ray Train's autoscaling coordinator (a detached actor that outlives the job that created it)."""
    import ray

    try:
        ray.kill(ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1]), no_restart=True)
    except ValueError:
        pass


def fit(spec: dict) -> dict:
    """Run the spec's stage on the cluster; rank 0's Checkpoint as a dict. Raises StageFailure."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from tasks.launch.ray_callback import StageStory
    from tasks.tracking.store import is_local_store

    run, stage = RunSettings.model_validate(spec["config"]["run"]), spec["stage"]
    gpu = 1.0 if run.device == "cuda" else 0.0
    verdict = capacity_verdict(ray.cluster_resources(), run.num_processes, run.ray_cpus_per_worker, gpu)
    uri = spec["config"]["tracking"]["uri"] or os.environ.get("MLFLOW_TRACKING_URI", "")
    verdict = verdict or local_store_verdict(uri, ray.nodes(), is_local_store)
    if verdict is not None:
        raise StageRefusal(verdict)
    resources = {"CPU": run.ray_cpus_per_worker, **({"GPU": gpu} if gpu else {})}
    storage = Path(run.output_dir) / ".ray-train"
    name = f"rlhf-{stage}-{uuid.uuid4().hex[:8]}"
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=spec,
        scaling_config=ScalingConfig(
            num_workers=run.num_processes,
            use_gpu=bool(gpu),
            resources_per_worker=resources,
            placement_strategy=run.ray_placement_strategy,
        ),
        run_config=RunConfig(
            name=name,
            storage_path=str(storage),
            failure_config=FailureConfig(max_failures=run.max_failures),
            callbacks=[StageStory(stage, run.max_failures, spec.get("checkpoints"))],
        ),
    )
    ours = not coordinator_exists()
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as err:
        raise stage_failure(stage, err, run.max_failures) from err
    finally:
        if ours:
            remove_coordinator()
        shutil.rmtree(storage / name, ignore_errors=True)  # Ray Train's own run state; ours is in the checkpoints
        try:
            storage.rmdir()
        except OSError:
            pass
    value = result.return_value or {}
    if "error" in value:  # the workers' own refusal before any training (storage not shared, credentials missing)
        raise StageRefusal(value["error"])
    return value["checkpoint"]


def main(spec_path: str, result_path: str) -> int:
    import ray

    spec = json.loads(Path(spec_path).read_text())
    try:
        connect(RunSettings.model_validate(spec["config"]["run"]), spec["stage"])
        checkpoint = fit(spec)
    except StageFailure as err:
        prefix = REFUSAL_PREFIX if isinstance(err, StageRefusal) else FAILURE_PREFIX
        print(prefix + " ".join(str(err).split()), flush=True)
        return 1
    except ConnectionError as err:
        address = spec["config"]["run"]["ray_address"]
        print(f"{REFUSAL_PREFIX}run.ray_address {address} reaches no Ray cluster: {err}", flush=True)
        return 1
    finally:
        ray.shutdown()  # stops a private instance; leaves a joined cluster running
    Path(result_path).write_text(json.dumps(checkpoint))
    return 0


if __name__ == "__main__":
    from tasks.launch.ray_driver import (
        main as driver_main,  # train_loop pickles as tasks.launch.ray_driver's, not __main__'s
    )

    sys.exit(driver_main(sys.argv[1], sys.argv[2]))
