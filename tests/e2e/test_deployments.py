"""End to end, the way a team runs it: `prefect server start` and `mlflow server` on free loopback
ports, a process work pool and a worker, `rlhf deploy` (prefect deploy --all), then
`prefect deployment run ... --watch` for the pipeline on the smoke config and for promotion.

Everything is started and stopped by the test; the servers' and the worker's logs are printed when
it fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tasks.runtime.server_processes import wait_healthy
from tests.fixtures.prefect_db import NO_MIGRATION, database_copy
from tests.fixtures.servers import free_port

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = [pytest.mark.slow, pytest.mark.e2e]


class Services:
    """Background processes with their logs in files; stopped (process groups) at the end."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log = open(self.root / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(
            args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_http(self, name: str, url: str, timeout_s: float) -> None:
        wait_healthy(self.procs[name], url, name, self.root / f"{name}.log", timeout_s=timeout_s)

    def logs(self) -> str:
        return "\n".join(
            f"===== {p.name} =====\n{p.read_text(errors='replace')[-6000:]}" for p in sorted(self.root.glob("*.log"))
        )

    def stop(self) -> None:
        """SIGTERM to every service, SIGKILL to what is still up 5 s later (their state is the test's own
        temporary directory; a graceful shutdown is not what this test checks)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    root = tmp_path_factory.mktemp("team")
    prefect_port, mlflow_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(
        {
            "PREFECT_HOME": str(root / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{database_copy(root)}",  # migrated
            **NO_MIGRATION,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # no job runner beside the server (tests/conftest.py)
        }
    )
    services = Services(root)
    services.start(
        "prefect-server",
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
        env,
    )
    services.start(
        "mlflow-server",
        [
            str(BIN / "mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "mlflow-artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(mlflow_port),
            "--workers",
            "1",
        ],
        env,
    )
    client_env = {
        **env,
        "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
    }
    try:
        services.wait_http("prefect-server", f"http://127.0.0.1:{prefect_port}/api/health", 180)
        services.wait_http("mlflow-server", f"http://127.0.0.1:{mlflow_port}/health", 120)
        deployed = subprocess.run(
            [str(BIN / "rlhf"), "deploy"], cwd=REPO, env=client_env, capture_output=True, text=True, timeout=300
        )
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        services.start("worker", [str(BIN / "prefect"), "worker", "start", "--pool", "rlhf-process"], client_env)
        yield {"env": client_env, "root": root, "services": services, "mlflow": client_env["MLFLOW_TRACKING_URI"]}
    except BaseException:
        print(services.logs())
        raise
    finally:
        services.stop()


def run_deployment(team, name: str, params: dict) -> tuple[str, str]:
    """`prefect deployment run NAME --param ... --watch`; (flow run id, final state name)."""
    args = [str(BIN / "prefect"), "deployment", "run", name, "--watch", "--watch-timeout", "900"]
    for key, value in params.items():
        args += ["--param", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    done = subprocess.run(args, cwd=REPO, env=team["env"], capture_output=True, text=True, timeout=960)
    output = done.stdout + done.stderr
    found = re.search(r"UUID:\s*([0-9a-f-]{36})", output)
    state = "no flow run"
    if found:
        url = f"{team['env']['PREFECT_API_URL']}/flow_runs/{found.group(1)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            state = json.loads(response.read())["state"]["name"]
    if done.returncode != 0 or state != "Completed":
        print(output)
        print(team["services"].logs())
    return (found.group(1) if found else ""), state


def test_pipeline_and_promotion_run_as_deployments_on_team_servers(team):
    from mlflow.tracking import MlflowClient

    out = team["root"] / "out"
    smoke = {"config_path": "configs/smoke.yaml", "overrides": [f"run.output_dir={out}"]}
    _, state = run_deployment(team, "rlhf-pipeline/default", smoke)
    assert state == "Completed"

    client = MlflowClient(team["mlflow"], registry_uri=team["mlflow"])
    rewards = client.search_model_versions("name = 'smoke-reward-model'")
    policies = sorted(client.search_model_versions("name = 'smoke-policy'"), key=lambda v: int(v.version))
    assert rewards and [v.tags["stage"] for v in policies] == ["sft", "ppo", "ppo", "export"]
    for version in policies + rewards:
        assert {"stage", "step", "run_label", "data_fingerprint"} <= set(version.tags)
        assert "config hash" in version.description.lower() and "code version" in version.description.lower()
    candidate = client.get_model_version_by_alias("smoke-policy", "candidate")
    assert str(candidate.version) == str(policies[-1].version)
    assert candidate.tags["reward_model_version"].startswith("models:/smoke-reward-model/")
    # artifacts went through the tracking server into its artifact store, not into the repository
    stored = list((team["root"] / "mlflow-artifacts").rglob("model.safetensors"))
    assert len(stored) >= len(policies) + len(rewards)

    _, state = run_deployment(team, "rlhf-promote/manual", smoke)
    assert state == "Completed"
    champion = client.get_model_version_by_alias("smoke-policy", "champion")
    assert str(champion.version) == str(candidate.version)
    assert client.get_model_version("smoke-policy", champion.version).tags["promotion.decision"] == "promoted"


def flow_runs_of(team, deployment: str) -> list[dict]:
    """The flow runs of `deployment` (flow/name) on the team's Prefect server."""
    api = team["env"]["PREFECT_API_URL"]
    flow_name, name = deployment.split("/")
    with urllib.request.urlopen(f"{api}/deployments/name/{flow_name}/{name}", timeout=10) as response:
        deployment_id = json.loads(response.read())["id"]
    body = json.dumps({"deployments": {"id": {"any_": [deployment_id]}}}).encode()
    request = urllib.request.Request(
        f"{api}/flow_runs/filter", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_new_feedback_emits_the_event_whose_trigger_starts_a_retraining(team, monkeypatch):
    import mlflow

    from tests.fixtures.traffic import choose, traced_answer

    monkeypatch.setenv("MLFLOW_TRACKING_URI", team["mlflow"])
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "")  # set_experiment writes it; monkeypatch takes it out after
    mlflow.set_tracking_uri(team["mlflow"])
    mlflow.set_experiment("traffic-e2e")
    try:
        for i in range(3):  # three people each chose one of two answers: three new pairs
            choose(traced_answer(f"the food was {i}", ["bland .", "great ."]), 1, user=f"user-{i}")
    finally:
        mlflow.set_tracking_uri(None)
    assert flow_runs_of(team, "rlhf-retrain/on-feedback") == []
    overrides = [f"run.output_dir={team['root'] / 'loop'}", "data.preference.path=traces:traffic-e2e"]
    watch = {"config_path": "configs/smoke.yaml", "overrides": [*overrides, "retrain.min_new_pairs=3"]}
    _, state = run_deployment(team, "rlhf-feedback-watch/every-5-minutes", watch)
    assert state == "Completed"
    # the trigger answers the event with a retraining flow run on the watch's config, which the worker takes up
    # (PENDING: it is starting the run's process; waiting for RUNNING would cost that process's imports too)
    deadline, started, taken = time.monotonic() + 90, None, ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CRASHED")
    while started is None and time.monotonic() < deadline:
        runs = flow_runs_of(team, "rlhf-retrain/on-feedback")
        started = next((r for r in runs if r["state"]["type"] in taken), None)
        time.sleep(0.5)
    assert started is not None, team["services"].logs()
    assert started["parameters"]["config_path"] == "configs/smoke.yaml"
    assert started["parameters"]["overrides"] == watch["overrides"]
    subprocess.run(  # the retraining itself is the flywheel's to show (make flywheel); stop it here
        [str(BIN / "prefect"), "flow-run", "cancel", started["id"]], env=team["env"], capture_output=True, timeout=60
    )
