"""MLflow runs: the pipeline's run, a nested run per stage, and the ending of runs their process left RUNNING.

A pipeline run is one MLflow run with the config fields it reads as params (tasks/tracking/params.py); each
stage is a nested run under it, so every stage has its own step axis. An RL stage that the guard rolls back
trains again in a run nested in its stage run, one per attempt (`attempt_run`): no series of a run ever goes
back to an earlier step. Whatever raises inside a run ends it FAILED, or
KILLED when it is an interruption (Ctrl-C, SIGTERM), never RUNNING; a run left RUNNING by a process
killed outright is marked KILLED by the next start on the same run directory, and a stage run left
RUNNING by a killed worker by its stage's launcher.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import get_args

import mlflow
from mlflow.entities import Param, RunStatus
from mlflow.tracking import MlflowClient

from rlhf_core.config import PipelineConfig, section_of
from rlhf_core.config.redaction import redact
from rlhf_core.config.training import Algorithm
from rlhf_core.storage.ownership import pid_alive
from tasks.tracking.logs import DESCRIPTION
from tasks.tracking.params import run_params
from tasks.tracking.store import configure, ensure_experiment, writes

RUN_KIND = "rlhf.run_kind"  # pipeline, stage, attempt (an RL stage's attempt after a guard rollback) or promotion
FLOW_RUN_ID, FLOW_RUN_URL = "prefect.flow_run_id", "prefect.flow_run_url"


@lru_cache(maxsize=1)
def code_version() -> str:
    """Package version plus the git commit of the checkout, when there is one."""
    version = metadata.version("rlhf-pipeline")
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        return f"{version}+g{sha}" if sha else version
    except (OSError, subprocess.SubprocessError):
        return version


def _log_params(run_id: str, params: dict[str, str]) -> None:
    client = MlflowClient()
    items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):  # the REST API takes at most 100 params per batch
        client.log_batch(run_id, params=items[i : i + 100])


def interrupted(err: BaseException) -> bool:
    """True for an interruption from outside (Ctrl-C, SIGTERM, Prefect's termination signal), not a failure."""
    if isinstance(err, (KeyboardInterrupt, SystemExit)):
        return True
    return any(cls.__name__ == "ExternalSignal" and cls.__module__ == "prefect.exceptions" for cls in type(err).__mro__)


def _end_status(err: BaseException) -> str:
    return RunStatus.to_string(RunStatus.KILLED if interrupted(err) else RunStatus.FAILED)


def fail_pending_models(experiment_id: str, run_ids: list[str]) -> list[str]:
    """Mark FAILED the logged models of `run_ids` still PENDING (a process killed inside `log_model`);
    return their ids. A FAILED logged model is never registered, and MLflow shows why it is incomplete."""
    client, failed = MlflowClient(), []
    wanted = set(run_ids)
    for model in client.search_logged_models([experiment_id], max_results=1000):
        if model.source_run_id in wanted and str(getattr(model.status, "value", model.status)) == "PENDING":
            client.finalize_logged_model(model.model_id, "FAILED")
            failed.append(model.model_id)
    return failed


def end_abandoned_runs(experiment_id: str, output_dir: str) -> list[str]:
    """Mark KILLED the RUNNING pipeline runs of `output_dir` whose process (on this host) no longer exists,
    and their RUNNING stage runs; return the ids of the pipeline runs ended.

    A process killed with SIGKILL (or a machine that lost power) cannot end its own runs; the next
    start on the same run directory does. Runs of another host are left alone: their pid says nothing here.
    """
    client = MlflowClient()
    running = client.search_runs([experiment_id], "attributes.status = 'RUNNING'", max_results=1000)
    host, ended = socket.gethostname(), []
    for run in running:
        tags = run.data.tags
        pid = tags.get("rlhf.pid", "")
        if (
            tags.get("rlhf.output_dir") != output_dir
            or tags.get("rlhf.host") != host
            or not pid.isdigit()
            or int(pid) == os.getpid()
            or pid_alive(int(pid))
        ):
            continue
        children = _descendants(running, run.info.run_id)
        fail_pending_models(experiment_id, [run.info.run_id, *(c.info.run_id for c in children)])
        for child in children:
            client.set_terminated(child.info.run_id, RunStatus.to_string(RunStatus.KILLED))
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.KILLED))
        client.set_tag(run.info.run_id, "rlhf.ended_by", f"a later start (pid {os.getpid()}): pid {pid} was gone")
        logging.getLogger(__name__).warning(
            "marked run %s KILLED: its process %s on this host no longer exists", run.info.run_id, pid
        )
        ended.append(run.info.run_id)
    return ended


def end_orphan_stage_runs(parent_run_id: str) -> list[str]:
    """Mark KILLED the stage runs under `parent_run_id` still RUNNING, and FAILED their PENDING logged models;
    return their ids. Called by the launcher once a stage's processes have ended: a worker that was killed
    (and restarted by torchrun or Ray, or not) could not end the run it had started."""
    if not writes():
        return []
    client = MlflowClient()
    parent = client.get_run(parent_run_id)
    experiment_id = parent.info.experiment_id
    running = client.search_runs(
        [experiment_id],
        f"attributes.status = 'RUNNING' and tags.mlflow.parentRunId = '{parent_run_id}'",
        max_results=1000,
    )
    ended = [run.info.run_id for run in running if run.data.tags.get(RUN_KIND) == "stage"]
    if ended:  # and the attempts' runs nested in them (an RL stage the guard rolled back)
        nested = client.search_runs([experiment_id], "attributes.status = 'RUNNING'", max_results=1000)
        ended += [r.info.run_id for r in nested if r.data.tags.get("mlflow.parentRunId") in ended]
    fail_pending_models(experiment_id, ended)
    for run_id in ended:
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.KILLED))
        client.set_tag(run_id, "rlhf.ended_by", "the stage's launcher: the process that ran it had ended")
    return ended


def _descendants(runs: list, run_id: str) -> list:
    """The runs of `runs` nested under `run_id`, at any depth (a stage run, and an RL attempt's run in it)."""
    found, parents = [], {run_id}
    while True:
        more = [r for r in runs if r.data.tags.get("mlflow.parentRunId") in parents and r not in found]
        if not more:
            return found
        found += more
        parents = {r.info.run_id for r in more}


def prefect_tags() -> dict[str, str]:
    """The Prefect flow run this process works for: `prefect.flow_run_id` and, when a UI URL is known
    (PREFECT_UI_URL, or one derived from PREFECT_API_URL), `prefect.flow_run_url` (credentials masked).
    Empty outside a flow run."""
    try:
        from prefect.runtime import flow_run
        from prefect.utilities.urls import url_for

        run_id = flow_run.get_id()
        if not run_id:
            return {}
        url = url_for("flow-run", obj_id=run_id)
    except Exception:  # no Prefect context or settings to read: nothing to link to
        return {}
    return {FLOW_RUN_ID: str(run_id), **({FLOW_RUN_URL: redact(url)} if url else {})}


def pipeline_run_name(cfg: PipelineConfig) -> str:
    """What tells two pipeline runs apart in MLflow's run list: the config's run_label and the start time
    (demo-ppo-seed42-20261126-095012)."""
    return f"{cfg.run_label()}-{datetime.now():%Y%m%d-%H%M%S}"


@contextmanager
def pipeline_run(cfg: PipelineConfig, tags: dict[str, str] | None = None, run_name: str | None = None) -> Iterator[str]:
    """Start the pipeline's MLflow run (the config fields it reads as params: `run_params`), yield its id, end it FINISHED, FAILED or KILLED.

    KILLED: interrupted (Ctrl-C, SIGTERM). The run is tagged with its run directory, host and pid, the
    Prefect flow run (`prefect_tags`) and `rlhf.run_kind=pipeline` (`tags` may override it), and RUNNING
    runs of the same directory whose process is gone are marked KILLED first (see end_abandoned_runs).
    `run_name` defaults to `pipeline_run_name(cfg)`.
    """
    uri = cfg.tracking_uri()
    configure(uri)
    experiment_id = ensure_experiment(cfg.tracking.experiment, uri)
    output_dir = str(Path(os.path.abspath(cfg.run.output_dir)).resolve())
    end_abandoned_runs(experiment_id, output_dir)
    run_tags = {
        "rlhf.config_hash": cfg.config_hash(),
        "rlhf.code_version": code_version(),
        "rlhf.output_dir": output_dir,
        "rlhf.host": socket.gethostname(),
        "rlhf.pid": str(os.getpid()),
        RUN_KIND: "pipeline",
        **prefect_tags(),
        **(tags or {}),
    }
    run = mlflow.start_run(experiment_id=experiment_id, run_name=run_name or pipeline_run_name(cfg), tags=run_tags)
    run_id = run.info.run_id
    try:
        _log_params(run_id, run_params(cfg))
        yield run_id
    except BaseException as err:
        mlflow.end_run(_end_status(err))
        raise
    else:
        mlflow.end_run(RunStatus.to_string(RunStatus.FINISHED))


def run_is_empty(run_id: str) -> bool:
    """True when the run recorded nothing a reviewer could read: no metrics, artifacts, datasets or models
    (a stage run's parameters are its config section, logged at its start: they alone say nothing happened)."""
    client = MlflowClient()
    run = client.get_run(run_id)
    if run.data.metrics:
        return False
    if run.inputs is not None and (run.inputs.dataset_inputs or run.inputs.model_inputs):
        return False
    if run.outputs is not None and run.outputs.model_outputs:
        return False
    return not client.list_artifacts(run_id)


_SYSTEM_TAGS = ("mlflow.", "prefect.", "rlhf.stage", RUN_KIND)


def _drop_empty_stage_run(run_id: str, parent_run_id: str, stage: str) -> None:
    """Delete a finished stage run that recorded nothing (a stage reused whole on a re-run), so a resumed
    pipeline adds no empty nested runs; the parent says so (`rlhf.stage.<stage>`) and keeps the stage's
    own tags (a reused model's URI) as `rlhf.<stage>.<tag>`."""
    client = MlflowClient()
    run = client.get_run(run_id)
    kept = {k: v for k, v in run.data.tags.items() if not k.startswith(_SYSTEM_TAGS)}
    tags = {f"rlhf.stage.{stage}": "reused: nothing new to record, see the previous attempt's stage run"}
    tags.update({f"rlhf.{stage}.{k.removeprefix('rlhf.')}": v for k, v in kept.items()})
    for key, value in tags.items():
        client.set_tag(parent_run_id, key, value)
    client.delete_run(run_id)


STAGE_SECTIONS = {  # the config sections whose fields a stage run logs as its parameters
    "data": ("data",),
    "sft": ("sft", "model"),
    "reward": ("reward",),
    "export": ("export", "registry"),
}


def stage_params(cfg: PipelineConfig, stage: str) -> dict[str, str]:
    """The stage's config sections of the pipeline run's params (`run_params`: the fields the run reads, secrets
    left out): an RL stage logs rl, its algorithm's section, rollout (its engine), init, guard and eval, so that
    two PPO runs compare on them."""
    section = section_of(stage) if stage in get_args(Algorithm) else "grpo"
    sections = STAGE_SECTIONS.get(stage, ("rl", section, "rollout", "init", "guard", "eval"))
    return {k: v for k, v in run_params(cfg).items() if k.split(".", 1)[0] in sections}


@contextmanager
def stage_run(parent_run_id: str, stage: str, params: dict[str, str] | None = None) -> Iterator[str]:
    """A nested run for one stage under the pipeline run, with `params` (`stage_params`); FAILED if the stage raises.

    Tagged `rlhf.stage`, `rlhf.run_kind=stage` and with the Prefect flow run (this process's, else the
    parent's: a launched worker process has no Prefect context). A run that ends FINISHED with nothing
    recorded but its params is deleted again (see _drop_empty_stage_run).
    """
    if not writes():
        yield ""
        return
    parent = MlflowClient().get_run(parent_run_id)
    inherited = {k: v for k, v in parent.data.tags.items() if k in (FLOW_RUN_ID, FLOW_RUN_URL)}
    run = mlflow.start_run(
        experiment_id=parent.info.experiment_id,
        run_name=stage,
        nested=True,
        parent_run_id=parent_run_id,
        tags={"rlhf.stage": stage, RUN_KIND: "stage", **inherited, **prefect_tags()},
    )
    try:
        _log_params(run.info.run_id, params or {})
        yield run.info.run_id
    except BaseException as err:
        mlflow.end_run(_end_status(err))
        raise
    else:
        mlflow.end_run(RunStatus.to_string(RunStatus.FINISHED))
        if run_is_empty(run.info.run_id):
            _drop_empty_stage_run(run.info.run_id, parent_run_id, stage)


def attempt_run_name(stage: str, attempt: int) -> str:
    """The run of an RL stage's training attempt after a guard rollback: `ppo-attempt-2`."""
    return f"{stage}-attempt-{attempt}"


@contextmanager
def attempt_run(stage_run_id: str, stage: str, attempt: int, description: str) -> Iterator[str]:
    """A run nested in the stage run `stage_run_id` for the RL stage's training `attempt` (2 and on: the guard
    rolled the one before back), named `attempt_run_name`; yields its id ("" where this process does not write).

    It carries the stage run's params, source and Prefect tags, `rlhf.run_kind=attempt`, `rlhf.stage`, `rlhf.attempt`
    and `description` as its description; it ends FINISHED, or FAILED (KILLED: interrupted) if the block raises.
    """
    if not writes() or not stage_run_id:
        yield ""
        return
    client = MlflowClient()
    stage_run = client.get_run(stage_run_id)
    kept = (FLOW_RUN_ID, FLOW_RUN_URL, "mlflow.user", "mlflow.source.name", "mlflow.source.type")
    inherited = {k: v for k, v in stage_run.data.tags.items() if k in kept}
    tags = {"mlflow.parentRunId": stage_run_id, "rlhf.stage": stage, RUN_KIND: "attempt", "rlhf.attempt": str(attempt)}
    run = client.create_run(
        stage_run.info.experiment_id,
        run_name=attempt_run_name(stage, attempt),
        tags={**tags, **inherited, DESCRIPTION: description},
    )
    run_id = run.info.run_id
    try:
        _log_params(run_id, stage_run.data.params)
        yield run_id
    except BaseException as err:
        client.set_terminated(run_id, _end_status(err))
        raise
    else:
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
