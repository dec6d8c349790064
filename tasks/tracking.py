"""MLflow runs, metrics and artifacts (the model registry is tasks/registry.py: together, all MLflow code).

A pipeline run is one MLflow run with the flattened config as params; each stage is a nested run
under it, so every stage has its own step axis. Whatever raises inside a run ends it FAILED, or
KILLED when it is an interruption (Ctrl-C, SIGTERM), never RUNNING; a run left RUNNING by a process
killed outright is marked KILLED by the next start on the same run directory.
Registrations and the creation of a fresh SQLite store hold file locks (`store_lock`), so concurrent
processes neither register one checkpoint twice nor collide creating the store's tables.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import mlflow
from filelock import FileLock
from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

from rlhf_core.config import PipelineConfig
from rlhf_core.ownership import pid_alive
from rlhf_core.redaction import flatten_config, has_secret, install_log_redaction, redact, split_credentials

RUN_KIND = "rlhf.run_kind"  # pipeline, stage or promotion
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


def writes() -> bool:
    """Only rank 0 of a data-parallel stage talks to MLflow (see tasks/launcher.py); the others skip writes."""
    return int(os.environ.get("RANK", "0")) == 0


USERNAME_ENV, PASSWORD_ENV, SUPPRESS_URL_ENV = (
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT",
)
_suppressed_by_us = False


def credentials_to_env(tracking_uri: str) -> str:
    """`tracking_uri` without its `user:password@`, which moves into MLflow's own environment variables.

    A URI's userinfo is sent as basic auth (requests puts it over MLflow's own Authorization header),
    and MLflow sends MLFLOW_TRACKING_USERNAME/PASSWORD as the same basic auth, so the move changes
    nothing for the server; what changes is that MLflow never holds the secret in its URI, so its
    "View run ... at" links and its error messages cannot show it. A secret that has no such
    variable (a token given as the user name, a ?token= query parameter) stays in the URI.
    """
    clean, user, password = split_credentials(tracking_uri)
    if user is None:
        return tracking_uri
    os.environ[USERNAME_ENV], os.environ[PASSWORD_ENV] = user, password
    return clean


def is_local_store(uri: str) -> bool:
    """True for a store this process writes itself (sqlite:, file:, a plain path), False for a tracking server
    (http(s)://, databricks, ...)."""
    if uri.startswith("databricks"):
        return False
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    return scheme in ("", "sqlite", "file")


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def store_lock(uri: str, purpose: str, timeout_s: float = 900.0) -> FileLock:
    """A lock between the processes of this machine that write to the tracking store at `uri`.

    For a SQLite store the lock file lies beside the database (`<db>.rlhf-<purpose>.lock`), so it
    covers every process that can open the database. For a server it lies in the temporary directory,
    named after a hash of the URI and the user id: it serializes the runs of one user on one machine;
    concurrency across machines against one server is not covered (the server has no lock of ours).
    Reentrant within a process.
    """
    db = _sqlite_path(uri)
    if db is not None:
        path = db.parent / f"{db.name}.rlhf-{purpose}.lock"
    else:
        digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
        path = Path(tempfile.gettempdir()) / f"rlhf-mlflow-{os.getuid()}-{digest}-{purpose}.lock"
    return FileLock(str(path), timeout=timeout_s, is_singleton=True)


_prepared_stores: set[str] = set()
CACHE_ENV = "RLHF_CACHE_DIR"


def cache_dir() -> Path:
    """Where the pipeline keeps what it can make again (RLHF_CACHE_DIR, else $XDG_CACHE_HOME/rlhf-pipeline)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlhf-pipeline"


def empty_store_template() -> Path | None:
    """An empty SQLite MLflow store at this MLflow version's schema head, made once per machine and version.

    MLflow makes a new SQLite store by running every schema migration since its first release (one to two
    seconds, paid by every new run directory, test and demo); a copy of an empty store made that way is the
    same database in milliseconds. The template has no default experiment: MLflow creates experiment 0 when
    it opens a store without one, with the artifact location of that store's own context. None when it
    cannot be made (an unwritable cache directory, a full disk): the caller lets MLflow migrate instead."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    template = cache_dir() / f"mlflow-{metadata.version('mlflow')}-empty-store.db"
    if template.is_file():
        return template
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{template}.lock", timeout=900):
            if template.is_file():
                return template
            tmp = template.with_name(f".{template.name}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            store = SqlAlchemyStore(f"sqlite:///{tmp}", str(tmp.parent / "unused-artifacts"))
            store.engine.dispose()
            with closing(sqlite3.connect(tmp)) as con, con:
                con.execute("DELETE FROM experiments WHERE experiment_id = 0")
            os.replace(tmp, template)
    except Exception as err:  # noqa: BLE001 (an unwritable cache, a full disk: MLflow's migrations instead)
        logging.getLogger(__name__).debug("no empty-store template in %s: %s", template.parent, err)
        return None
    return template


def _copy_template(template: Path, db: Path) -> None:
    """`db` as a copy of `template`, made under a temporary name and linked into place: never a half-written
    store, and never over a file that appeared meanwhile (then that file stays as it is)."""
    tmp = db.with_name(f".{db.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(template, tmp)
        os.link(tmp, db)  # FileExistsError when db exists: it is not ours to replace
    except OSError:
        pass  # MLflow creates the tables itself
    finally:
        tmp.unlink(missing_ok=True)


def _prepare_sqlite_store(uri: str) -> None:
    """Create a fresh SQLite store under a lock (two processes creating its tables at once fail, "table ...
    already exists"): a copy of `empty_store_template` when there is one, else MLflow's migrations."""
    db = _sqlite_path(uri)
    if db is None or uri in _prepared_stores:
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with store_lock(uri, "create"):
        if not db.exists():
            template = empty_store_template()
            if template is not None:
                _copy_template(template, db)
        client = MlflowClient(uri, registry_uri=uri)
        client.search_experiments(max_results=1)  # the tracking store's tables
        client.search_registered_models(max_results=1)  # the registry's
    _prepared_stores.add(uri)


def configure(tracking_uri: str) -> None:
    """Point tracking and the registry at `tracking_uri` (its credentials moved into MLflow's env variables)."""
    global _suppressed_by_us
    uri = credentials_to_env(tracking_uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    _prepare_sqlite_store(uri)
    # a secret that could not move out of the URI (a token as the user name, a ?token= parameter)
    # would be in the "View run ... at" links MLflow writes to stdout: MLflow then prints none
    if has_secret(uri) and SUPPRESS_URL_ENV not in os.environ:
        os.environ[SUPPRESS_URL_ENV], _suppressed_by_us = "true", True
    elif not has_secret(uri) and _suppressed_by_us:
        os.environ.pop(SUPPRESS_URL_ENV, None)
        _suppressed_by_us = False


install_log_redaction()  # every log record of the process: ours, Prefect's and MLflow's


def artifact_root_for(tracking_uri: str) -> str | None:
    """For a SQLite store, keep artifacts beside the database file; servers choose their own."""
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri.removeprefix("sqlite:///"))
        return (db.parent / "mlruns").resolve().as_uri()
    return None


def ensure_experiment(name: str, tracking_uri: str) -> str:
    """The id of experiment `name`, created if missing (two processes creating it at once get the same one)."""
    client = MlflowClient()
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    with store_lock(mlflow.get_tracking_uri(), "create"):
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return client.create_experiment(name, artifact_location=artifact_root_for(tracking_uri))
        except mlflow.exceptions.MlflowException:
            experiment = client.get_experiment_by_name(name)  # another machine created it meanwhile
            if experiment is None:
                raise
            return experiment.experiment_id


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
        children = [r for r in running if r.data.tags.get("mlflow.parentRunId") == run.info.run_id]
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
    fail_pending_models(experiment_id, ended)
    for run_id in ended:
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.KILLED))
        client.set_tag(run_id, "rlhf.ended_by", "the stage's launcher: the process that ran it had ended")
    return ended


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


@contextmanager
def pipeline_run(cfg: PipelineConfig, tags: dict[str, str] | None = None, run_name: str | None = None) -> Iterator[str]:
    """Start the pipeline's MLflow run (config as params), yield its id, end it FINISHED, FAILED or KILLED.

    KILLED: interrupted (Ctrl-C, SIGTERM). The run is tagged with its run directory, host and pid, the
    Prefect flow run (`prefect_tags`) and `rlhf.run_kind=pipeline` (`tags` may override it), and RUNNING
    runs of the same directory whose process is gone are marked KILLED first (see end_abandoned_runs).
    `run_name` defaults to run.name.
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
    run = mlflow.start_run(experiment_id=experiment_id, run_name=run_name or cfg.run.name, tags=run_tags)
    run_id = run.info.run_id
    try:
        _log_params(run_id, flatten_config(cfg))
        yield run_id
    except BaseException as err:
        mlflow.end_run(_end_status(err))
        raise
    else:
        mlflow.end_run(RunStatus.to_string(RunStatus.FINISHED))


def run_is_empty(run_id: str) -> bool:
    """True when the run recorded nothing a reviewer could read: no metrics, params, artifacts, datasets or models."""
    client = MlflowClient()
    run = client.get_run(run_id)
    if run.data.metrics or run.data.params:
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


@contextmanager
def stage_run(parent_run_id: str, stage: str) -> Iterator[str]:
    """A nested run for one stage under the pipeline run; FAILED if the stage raises.

    Tagged `rlhf.stage`, `rlhf.run_kind=stage` and with the Prefect flow run (this process's, else the
    parent's: a launched worker process has no Prefect context). A run that ends FINISHED with nothing
    recorded is deleted again (see _drop_empty_stage_run).
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
        yield run.info.run_id
    except BaseException as err:
        mlflow.end_run(_end_status(err))
        raise
    else:
        mlflow.end_run(RunStatus.to_string(RunStatus.FINISHED))
        if run_is_empty(run.info.run_id):
            _drop_empty_stage_run(run.info.run_id, parent_run_id, stage)


def log_metrics(run_id: str, metrics: dict[str, float], step: int) -> None:
    """Log a metric dict at `step` to the given run."""
    if not writes():
        return
    now = int(time.time() * 1000)
    MlflowClient().log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


def log_figure(run_id: str, figure, artifact_file: str) -> None:
    """Log a matplotlib figure as a PNG artifact of the run."""
    if not writes():
        return
    MlflowClient().log_figure(run_id, figure, artifact_file)


def log_artifact(run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
    if not writes():
        return
    MlflowClient().log_artifact(run_id, str(path), artifact_path)


def log_table(run_id: str, rows: list[dict], artifact_file: str) -> None:
    """Log rows as an MLflow table artifact (a new file per call; nothing is overwritten)."""
    if not writes():
        return
    if rows:
        columns = {key: [row.get(key) for row in rows] for key in rows[0]}
        MlflowClient().log_table(run_id, data=columns, artifact_file=artifact_file)


def _dataset_source(source: str, split: str | None, revision: str | None):
    """An MLflow DatasetSource for a data.* path: 'demo' (made by code), a URL, a local path or glob, or a hub name."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    if source == "demo":
        return CodeDatasetSource(tags={"rlhf.source": "demo"})
    if source.startswith(("http://", "https://")):
        return HTTPDatasetSource(url=source)
    local = Path(source).expanduser()
    if "://" in source or local.exists() or local.parent.is_dir() and any(c in source for c in "*?["):
        try:
            return resolve_dataset_source(source if "://" in source else str(local.resolve()))
        except mlflow.exceptions.MlflowException:
            return CodeDatasetSource(tags={"rlhf.source": source})
    return HuggingFaceDatasetSource(path=source, split=split, revision=revision)


def log_datasets(run_id: str, datasets: list[dict]) -> None:
    """Log each prepared table as an MLflow dataset input of the run.

    Each entry: name (the config field, e.g. data.preference), source (the user's path, hub name or
    'demo'; credentials are masked here), digest (the table's fingerprint), context (training or
    evaluation), and optionally split, revision and rows (recorded as input tags).
    """
    if not writes() or not datasets:
        return
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    inputs = []
    for entry in datasets:
        source = _dataset_source(redact(str(entry["source"])), entry.get("split"), entry.get("revision"))
        dataset = MetaDataset(source, name=entry["name"], digest=entry["digest"])
        tags = [InputTag(MLFLOW_DATASET_CONTEXT, entry["context"])]
        tags += [InputTag(f"rlhf.{k}", str(entry[k])) for k in ("rows", "split") if entry.get(k) is not None]
        inputs.append(DatasetInput(dataset=dataset._to_mlflow_entity(), tags=tags))
    MlflowClient().log_inputs(run_id, datasets=inputs)


def set_run_tags(run_id: str, tags: dict[str, str]) -> None:
    if not writes():
        return
    client = MlflowClient()
    for key, value in tags.items():
        client.set_tag(run_id, key, str(value))


def artifact_link(run_id: str, artifact_path: str) -> str:
    """Where a person opens a run's artifact: the MLflow UI page on a server, else the artifact's URI."""
    run = MlflowClient().get_run(run_id)
    uri = mlflow.get_tracking_uri()
    if uri.startswith(("http://", "https://")):
        return (
            f"{redact(uri).rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}/artifacts/{artifact_path}"
        )
    return f"{run.info.artifact_uri.rstrip('/')}/{artifact_path}"
