"""A registered version's server for the length of a stage (`version_server`): `mlflow models serve` of a
models:/ URI in this environment (`--env-manager local`) on a free loopback port, started under the supervisor the
vLLM server uses (rlhf_core/rollout/vllm_process/rlhf_vllm_supervisor.py), so it stops when the stage's process is
gone, killed or not; stopped, its whole process group, when the block ends however it ends. A reward-model version
must have been registered with tasks/loaders/reward.py as its loader (`check_servable`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlflow

from rlhf_core.config.errors import UserError
from rlhf_core.rollout.vllm_server import SUPERVISOR, free_port, stop_process_group
from tasks.loaders import reward as reward_loader
from tasks.registry.logged_model import loader_module
from tasks.runtime.server_processes import wait_healthy

BIN = Path(sys.executable).parent
STARTUP_TIMEOUT_S = 300.0
GRACE_S = 15.0


def check_servable(uri: str, *, field: str) -> None:
    """Refuse, in one sentence naming `field`, a models:/ URI that names no version or one whose python_function
    loader is not the pipeline's reward scorer (a version registered before reward models were servable)."""
    try:
        flavors = mlflow.models.get_model_info(uri).flavors
    except Exception as err:  # noqa: BLE001 - MLflow raises several kinds for a missing version or alias
        raise UserError(f"{field}: {uri} cannot be read from the registry ({str(err).splitlines()[0][:160]})") from None
    loader, ours = flavors.get("python_function", {}).get("loader_module"), loader_module(reward_loader)
    if loader != ours:
        raise UserError(
            f"{field}: {uri} is served by {loader or 'no python_function loader'}, not the pipeline's reward scorer "
            f"({ours}); register the reward model again with this version of the pipeline"
        )


@contextmanager
def version_server(uri: str, log_path: Path, *, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[str]:
    """The http://127.0.0.1:PORT/invocations URL of `uri` served for the block; the server's output goes to
    `log_path`."""
    port = free_port()
    serve = [str(BIN / "mlflow"), "models", "serve", "-m", uri, "--env-manager", "local"]
    serve += ["--host", "127.0.0.1", "--port", str(port)]
    # the server starts `uvicorn` from PATH: this environment's, also when the venv is not activated
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(MLFLOW_TRACKING_URI=mlflow.get_tracking_uri(), MLFLOW_REGISTRY_URI=mlflow.get_registry_uri())
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, str(SUPERVISOR), str(os.getpid()), *serve],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_healthy(
            process, f"http://127.0.0.1:{port}/ping", f"`mlflow models serve` of {uri}", log_path, startup_timeout_s
        )
        yield f"http://127.0.0.1:{port}/invocations"
    finally:
        stop_process_group(process, GRACE_S)
