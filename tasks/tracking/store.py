"""The MLflow store: where tracking and the registry point, the SQLite store's creation, locks, experiments.

`configure` points tracking and the registry at a URI, its credentials moved into MLflow's environment
variables; a fresh SQLite store is a copy of an empty one kept in the cache (`empty_store_template`).
Registrations and the creation of a fresh SQLite store hold file locks (`store_lock`), so concurrent
processes neither register one checkpoint twice nor collide creating the store's tables. Only rank 0 of
a data-parallel stage writes (`writes`). Runs are in tasks/tracking/runs.py, what is logged to them in
tasks/tracking/logs.py, model versions in tasks/registry/.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sqlite3
import tempfile
from contextlib import closing
from importlib import metadata
from pathlib import Path

import mlflow
from filelock import FileLock
from mlflow.tracking import MlflowClient

from rlhf_core.config.redaction import has_secret, install_log_redaction, split_credentials


def writes() -> bool:
    """Only rank 0 of a data-parallel stage talks to MLflow (see tasks/launch/launcher.py); the others skip writes."""
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
