"""`rlhf ui` (`make ui`): a Prefect server and the MLflow UI on 127.0.0.1, a run of the pipeline against
them (the demo unless --config says otherwise), both URLs printed, and both stopped on Ctrl-C.

`make demo` uses Prefect's temporary server, which stops when the run ends; this keeps one to browse. The
Prefect server stores its runs in PREFECT_HOME (~/.prefect by default), so they stay for the next `rlhf ui`;
the MLflow UI serves ./mlflow.db, the store `make demo` writes, and the run logs to it through the server
so that the Prefect artifacts link to MLflow's pages.

Stopping: Ctrl-C (SIGINT), SIGTERM and a closed terminal's SIGHUP stop the run if it is still going, then
both servers. Each of the three runs in a process group of its own, so only this process signals them, once:
SIGTERM to the run (the pipeline ends its MLflow runs KILLED while the servers are still up), SIGTERM to
each server, SIGKILL to a group still there after its grace. The first signal starts that; any later one
is ignored (`make` forwards SIGTERM to `rlhf ui`, so a SIGTERM to `make ui`'s process group arrives twice).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from rlhf_core.config.errors import UserError
from tasks.runtime.server_processes import stop_group, wait_healthy

BIN = Path(sys.executable).parent
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
RUN_GRACE_S = 30.0  # the run's own cleanup: its MLflow runs ended, the servers it started stopped
SERVER_GRACE_S = 20.0


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Stopper:
    """The processes `rlhf ui` started, and the signals that stop them (SIGINT, SIGTERM, SIGHUP).

    The first signal raises KeyboardInterrupt, so that `serve` leaves what it was waiting on and stops
    everything in its `finally`; from then on (`stopping`) a signal is ignored, so a second one never cuts
    that cleanup short. A signal that arrives while a process is being started is held until the process is
    in `procs`, so that no process is started and then forgotten."""

    def __init__(self) -> None:
        self.procs: list[tuple[subprocess.Popen, float]] = []  # each with its grace before SIGKILL
        self.stopping = False
        self.starting = False
        self.held = False

    def install(self) -> None:
        """Handle the stopping signals, but for one ignored from the start (`nohup` ignores SIGHUP, a shell's
        background job SIGINT): that one stays ignored."""
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) != signal.SIG_IGN:
                signal.signal(signum, self.on_signal)

    def on_signal(self, signum: int, frame: object) -> None:
        if self.stopping:
            return
        if self.starting:
            self.held = True
            return
        self.stopping = True
        raise KeyboardInterrupt

    def start(
        self, command: list[str], env: dict[str, str], out: IO[str] | None = None, grace_s: float = SERVER_GRACE_S
    ) -> subprocess.Popen:
        """Start `command` in a process group of its own, its output to `out` (else this console)."""
        self.starting = True
        try:
            err = None if out is None else subprocess.STDOUT
            proc = subprocess.Popen(command, stdout=out, stderr=err, env=env, start_new_session=True)
            self.procs.append((proc, grace_s))
        finally:
            self.starting = False
        if self.held and not self.stopping:
            self.stopping = True
            raise KeyboardInterrupt
        return proc

    def stop_all(self) -> None:
        """Stop every process started, the last first (the run reports to the servers while it stops): SIGTERM
        to its group, SIGKILL after its grace. Signals arriving meanwhile are ignored."""
        self.stopping = True
        for proc, grace_s in reversed(self.procs):
            stop_group(proc, grace_s)


def _start_server(stopper: Stopper, command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with log.open("w") as out:  # the child keeps its own descriptor
        return stopper.start(command, env, out)


def serve(config: str | None, overrides: list[str], mlflow_port: int, prefect_port: int, logs: Path) -> int:
    """Start both UIs, run the pipeline against them (unless `config` is None), then wait for Ctrl-C."""
    for port, flag in ((mlflow_port, "--mlflow-port"), (prefect_port, "--prefect-port")):
        if not port_free(port):
            raise UserError(f"port {port} on 127.0.0.1 is in use; stop what holds it or pass {flag}")
    logs.mkdir(parents=True, exist_ok=True)
    mlflow_url, prefect_url = f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{prefect_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    stopper = Stopper()
    try:
        stopper.install()
        mlflow = _start_server(
            stopper,
            [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{Path.cwd() / 'mlflow.db'}"]
            + ["--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"],
            logs / "mlflow.log",
            env,
        )
        prefect = _start_server(
            stopper,
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
            logs / "prefect.log",
            # the UI's pages call the API at PREFECT_UI_API_URL, which --port alone leaves at port 4200
            {**env, "PREFECT_UI_API_URL": f"{prefect_url}/api", "PREFECT_SERVER_API_PORT": str(prefect_port)},
        )
        wait_healthy(mlflow, f"{mlflow_url}/health", "MLflow server", logs / "mlflow.log")
        wait_healthy(prefect, f"{prefect_url}/api/health", "Prefect server", logs / "prefect.log")
        print(f"MLflow UI:  {mlflow_url}  (pick 'Model training' at the top left to see runs and models)")
        print(f"Prefect UI: {prefect_url}", flush=True)
        if config is not None:
            command = [str(BIN / "rlhf"), "run", "--config", config, "--set", f"tracking.uri={mlflow_url}"]
            for text in overrides:
                command += ["--set", text]
            run = stopper.start(command, {**env, "PREFECT_API_URL": f"{prefect_url}/api"}, grace_s=RUN_GRACE_S)
            code = run.wait()
            print(f"the run ended (exit {code}); both UIs stay up", flush=True)
        print("Ctrl-C stops both", flush=True)
        while mlflow.poll() is None and prefect.poll() is None:
            time.sleep(1)
        return 1  # a server stopped by itself
    except KeyboardInterrupt:
        return 0
    finally:
        stopper.stop_all()
