"""Shared fixtures: offline hub, a private Prefect home, SQLite MLflow stores in tmp_path."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# set before prefect, transformers or datasets are imported by any test module
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the simulated Ray clusters (tests/distributed/ray_nodes.py) stay on 127.0.0.1: without this, Ray rewrote a
# loopback address to the machine's external one and the driver waited forever (read when ray is imported)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray Train polls its workers every 2 s (a finished or dead worker is noticed up to that late): 0.5 s in tests
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
os.environ.pop("MLFLOW_TRACKING_URI", None)
# every `mlflow server` a test starts (tests/fixtures/servers.py, `rlhf ui`, the e2e team servers) without its
# job runner: MLflow 3 starts one more process and five huey consumers beside each server by default (about 15
# CPU-seconds of imports per server here), for server-side jobs that nothing in the pipeline submits
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")

from tests.distributed.ray_nodes import ray_temp_root  # noqa: E402

# Made here, per test process (an xdist worker's own), and removed at the end: Prefect's home, and Ray's
# temp dir (a private instance's sessions and sockets; a test cluster makes its own): nothing an earlier run
# left (a /tmp/ray, a Prefect database) stands in for set-up, and nothing is written into the machine's /tmp/ray
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="rlhf-tests-prefect-")
os.environ["RAY_TMPDIR"] = str(ray_temp_root())
OWN_DIRS = [os.environ["PREFECT_HOME"], os.environ["RAY_TMPDIR"]]
# the empty MLflow store template (tasks/tracking/store.py) is made once per test run (xdist's workers inherit
# it and share it under a file lock), not in the user's cache
if "RLHF_CACHE_DIR" not in os.environ:
    os.environ["RLHF_CACHE_DIR"] = tempfile.mkdtemp(prefix="rlhf-tests-cache-")
    OWN_DIRS.append(os.environ["RLHF_CACHE_DIR"])

import pytest  # noqa: E402

from rlhf_core.config import PipelineConfig, load_config  # noqa: E402
from rlhf_core.demo.world import DemoWorld, build_demo_world  # noqa: E402
from tests.fixtures.workers import longest_first  # noqa: E402

pytest_plugins = ["tests.fixtures.file_durations"]

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"


# fixtures that start a server: a test that uses one is in the slow tier (docs/development.md#test-tiers)
SERVER_FIXTURES = {"prefect_harness"}


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects by the marks
def pytest_collection_modifyitems(config, items):
    """A test that uses a server fixture is marked `slow`; in a pytest-xdist worker (`make test`) the longest files
    go first (tests/fixtures/workers.py)."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):
        longest_first(items)


def pytest_unconfigure(config):
    """The directories this process made for the run, removed (its Prefect server and Ray instances stopped)."""
    for path in OWN_DIRS:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def mlflow_uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def smoke_cfg(tmp_path: Path, mlflow_uri: str) -> PipelineConfig:
    """configs/smoke.yaml writing into tmp_path and tracking into a SQLite file there."""
    return load_config(SMOKE, [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri={mlflow_uri}"])


@pytest.fixture(scope="session")
def smoke_world(tmp_path_factory) -> DemoWorld:
    """The smoke config's demo world, built once per session."""
    cfg = load_config(SMOKE)
    return build_demo_world(
        tmp_path_factory.mktemp("world") / "demo_world", cfg.run.seed, cfg.data.demo, cfg.model.demo
    )


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect server for flow tests, started once per session (per pytest worker) on a copy of the
    run's migrated database (tests/fixtures/prefect_db.py)."""
    from tests.fixtures.prefect_db import premigrated_harness

    with premigrated_harness(server_startup_timeout=180):
        yield
