"""A credential in the tracking URI never surfaces: not on the console, in logs, MLflow, Prefect or files.

The pipeline runs through the `rlhf` CLI against a real `mlflow server` on a loopback port, with a
sentinel password in `--set tracking.uri=http://user:SENTINEL@127.0.0.1:PORT` (the server has no
auth enabled, so it ignores the credentials; the client still sends them as basic auth). Then every
place a value can surface is searched for the sentinel: stdout and stderr, the server's SQLite
database and artifact store, every file of the run directory and of PREFECT_HOME, and the Prefect
API's flow runs (parameters, state messages), task runs, logs and artifacts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.servers import MLFLOW_ENV, running_mlflow_server

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.yaml")
BIN = Path(sys.executable).parent
SENTINEL = "Sentinel-9f3b2c7e"
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on a free loopback port, storing into tmp_path/server; yields (host:port, store dir)."""
    with running_mlflow_server(tmp_path / "server") as server:
        yield server


@pytest.fixture
def clean_mlflow_env():
    """The CLI moves credentials into MLflow's environment variables: undo that after the test."""
    saved = {k: os.environ.get(k) for k in MLFLOW_ENV}
    for key in MLFLOW_ENV:
        os.environ.pop(key, None)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def files_with(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def read_all(method, **filters) -> list:
    """Every record a Prefect client read method returns, page by page."""
    records, offset = [], 0
    while True:
        page = method(limit=200, offset=offset, **filters)
        records += page
        if len(page) < 200:
            return records
        offset += 200


def prefect_records() -> str:
    """Every flow run (parameters, state), task run, log line and artifact the Prefect API holds, as JSON."""
    from prefect.client.orchestration import get_client
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)  # logs travel to the API in batches: send what is queued
    with get_client(sync_client=True) as client:
        records = [
            *read_all(client.read_flow_runs),
            *read_all(client.read_task_runs),
            *read_all(client.read_logs),
            *read_all(client.read_artifacts),
        ]
    return "\n".join(r.model_dump_json() for r in records)


def test_a_credential_in_the_tracking_uri_surfaces_nowhere(prefect_harness, mlflow_server, tmp_path):
    # given: the sentinel as the password of a tracking URI given on the command line
    from prefect.settings import PREFECT_API_URL

    host, store = mlflow_server
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in MLFLOW_ENV}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), PYTHONPATH=str(REPO), COLUMNS="200")
    # when: `rlhf run` in a process of its own, so that stdout and stderr are exactly what a user sees
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            "--config",
            SMOKE,
            "--set",
            f"run.output_dir={out}",
            "--set",
            f"tracking.uri=http://alice:{SENTINEL}@{host}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # then: it ran against the server, and MLflow printed its own links without the credentials
    assert done.returncode == 0, done.stderr[-3000:]
    assert "View run smoke-ppo-seed7-" in done.stdout and f" at: http://{host}/#/experiments/" in done.stdout
    assert list((store / "artifacts").rglob("model.safetensors"))
    # and the sentinel is nowhere
    needle = SENTINEL.encode()
    assert SENTINEL not in done.stdout and SENTINEL not in done.stderr
    assert files_with(store, needle) == []  # the server's database, artifacts and log
    assert files_with(out, needle) == []  # checkpoints, exports, model cards, eval Parquet files
    assert files_with(tmp_path, needle) == []  # anything else the run wrote in its working directory
    assert files_with(Path(os.environ["PREFECT_HOME"]), needle) == []  # results and local storage
    records = prefect_records()
    assert f"tracking.uri=http://{host}" in records  # the flow run's parameters hold the URI without them
    assert SENTINEL not in records


def test_the_flow_refuses_a_credential_in_its_parameters(prefect_harness, clean_mlflow_env, tmp_path):
    # given: a deployment run whose overrides carry a credentialed tracking URI
    from flows.rlhf_pipeline import rlhf_pipeline

    overrides = [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri=http://{SENTINEL}@127.0.0.1:9?token={SENTINEL}"]
    # when
    state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    # then: it fails before anything runs, in one sentence that says where credentials go, without them
    assert state.is_failed()
    assert "MLFLOW_TRACKING_PASSWORD" in state.message and SENTINEL not in state.message
    assert "tracking.uri=http://***@127.0.0.1:9?token=***" in state.message
    assert not (tmp_path / "out").exists()
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ
    # the run's logs (console and API) hide it too; only the refused parameter itself holds it
    records = prefect_records()
    assert "MLFLOW_TRACKING_PASSWORD" in records
    assert records.count(SENTINEL) == 2  # the two in the flow run's `overrides` parameter, nowhere else
