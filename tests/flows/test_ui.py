"""`rlhf ui` (`make ui`): both servers on 127.0.0.1, their URLs printed, both stopped on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.fixtures.prefect_db import premigrated_home
from tests.fixtures.servers import MLFLOW_ENV, free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def ui_process(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in MLFLOW_ENV and not k.startswith("PREFECT_API_")}
    # PREFECT_HOME's default database already migrated
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **premigrated_home(tmp_path / "prefect"))
    command = [sys.executable, "-m", "flows.cli", "ui", "--config", str(REPO / "configs" / "smoke.yaml"), *args]
    command += ["--set", f"run.output_dir={tmp_path / 'out'}"]
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_ui_serves_both_runs_against_them_and_ctrl_c_stops_both(tmp_path):
    mlflow_port, prefect_port = free_port(), free_port()
    proc = ui_process(tmp_path, "--mlflow-port", str(mlflow_port), "--prefect-port", str(prefect_port))
    lines = []
    try:
        deadline = time.monotonic() + 420
        while not any(line.startswith("Ctrl-C stops both") for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        text = "".join(lines)
        assert f"MLflow UI:  http://127.0.0.1:{mlflow_port}" in text and "'Model training'" in text
        assert f"Prefect UI: http://127.0.0.1:{prefect_port}" in text
        assert "the run ended (exit 0); both UIs stay up" in text  # the smoke run, logged to both servers
        with urllib.request.urlopen(f"http://127.0.0.1:{prefect_port}/ui-settings", timeout=10) as response:
            assert json.loads(response.read())["api_url"] == f"http://127.0.0.1:{prefect_port}/api"  # its pages work
        with urllib.request.urlopen(
            f"http://127.0.0.1:{prefect_port}/api/flow_runs/filter", data=b"{}", timeout=10
        ) as response:
            assert '"state_type":"COMPLETED"' in response.read().decode().replace(" ", "")
        for url in (f"http://127.0.0.1:{mlflow_port}/health", f"http://127.0.0.1:{prefect_port}/api/health"):
            with urllib.request.urlopen(url, timeout=10) as response:
                assert response.status == 200
        assert (tmp_path / "mlflow.db").is_file()  # the store `make demo` writes, in the working directory
    finally:
        proc.send_signal(signal.SIGTERM)  # as `kill` does; Ctrl-C's SIGINT takes the same path
        code = proc.wait(timeout=60)
    assert code == 0, "".join(lines) + proc.stdout.read()
    for port in (mlflow_port, prefect_port):  # nothing answers any more (a bind may still meet TIME_WAIT)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_port_in_use_is_one_sentence(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = ui_process(tmp_path, "--no-run", "--mlflow-port", str(port))
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert out.strip() == f"error: port {port} on 127.0.0.1 is in use; stop what holds it or pass --mlflow-port"
