"""`rlhf ui` (`make ui`): a Prefect server and the MLflow UI on 127.0.0.1, a run of the pipeline against
them (the demo unless --config says otherwise), both URLs printed, and both stopped on Ctrl-C.

`make demo` uses Prefect's temporary server, which stops when the run ends; this keeps one to browse. The
Prefect server stores its runs in PREFECT_HOME (~/.prefect by default), so they stay for the next `rlhf ui`;
the MLflow UI serves ./mlflow.db, the store `make demo` writes, and the run logs to it through the server
so that the Prefect artifacts link to MLflow's pages.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rlhf_core.config.errors import UserError
from tasks.servers import stop_group, wait_healthy

BIN = Path(sys.executable).parent


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with log.open("w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def serve(config: str | None, overrides: list[str], mlflow_port: int, prefect_port: int, logs: Path) -> int:
    """Start both UIs, run the pipeline against them (unless `config` is None), then wait for Ctrl-C."""
    for port, flag in ((mlflow_port, "--mlflow-port"), (prefect_port, "--prefect-port")):
        if not port_free(port):
            raise UserError(f"port {port} on 127.0.0.1 is in use; stop what holds it or pass {flag}")
    logs.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops both servers as Ctrl-C does
    mlflow_url, prefect_url = f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{prefect_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    servers = []
    try:
        servers.append(
            _start(
                [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{Path.cwd() / 'mlflow.db'}"]
                + ["--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"],
                logs / "mlflow.log",
                env,
            )
        )
        servers.append(
            _start(
                [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
                logs / "prefect.log",
                # the UI's pages call the API at PREFECT_UI_API_URL, which --port alone leaves at port 4200
                {**env, "PREFECT_UI_API_URL": f"{prefect_url}/api", "PREFECT_SERVER_API_PORT": str(prefect_port)},
            )
        )
        wait_healthy(servers[0], f"{mlflow_url}/health", "MLflow server", logs / "mlflow.log")
        wait_healthy(servers[1], f"{prefect_url}/api/health", "Prefect server", logs / "prefect.log")
        print(f"MLflow UI:  {mlflow_url}  (pick 'Model training' at the top left to see runs and models)")
        print(f"Prefect UI: {prefect_url}", flush=True)
        if config is not None:
            run_env = {**env, "PREFECT_API_URL": f"{prefect_url}/api"}
            command = [str(BIN / "rlhf"), "run", "--config", config, "--set", f"tracking.uri={mlflow_url}"]
            for text in overrides:
                command += ["--set", text]
            done = subprocess.run(command, env=run_env, check=False)
            print(f"the run ended (exit {done.returncode}); both UIs stay up", flush=True)
        print("Ctrl-C stops both", flush=True)
        while all(s.poll() is None for s in servers):
            time.sleep(1)
        return 1  # a server stopped by itself
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in servers:
            stop_group(proc)
