"""One writer per run directory, idempotent registration under concurrency, and run states after a kill:
tested with real second processes (tests/tasks/runtime/lock_worker.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rlhf_core.config import load_config
from tasks import tracking
from tasks.runtime.run_lock import HOLDER_FILE, RunLockedError, read_holder, run_lock, terminate_on_sigterm

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]  # processes of their own, killed

WORKER = Path(__file__).with_name("lock_worker.py")
REPO = Path(__file__).resolve().parents[3]


def start_worker(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )


def read_line(proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"worker ended early (rc {proc.wait()}): {proc.stderr.read()[-3000:]}")
    assert time.monotonic() < deadline
    return line.strip()


def cfg_for(uri: str, out: Path):
    return load_config(None, [f"tracking.uri={uri}", "tracking.experiment=t", f"run.output_dir={out}", "run.name=unit"])


def test_two_processes_register_the_same_checkpoint_into_a_fresh_store_once(tmp_path, smoke_world):
    uri, go = f"sqlite:///{tmp_path / 'fresh.db'}", tmp_path / "go"
    workers = [
        start_worker("register", uri, str(tmp_path / f"out{i}"), str(smoke_world.base_model), str(go)) for i in range(2)
    ]
    assert [read_line(w) for w in workers] == ["waiting", "waiting"]
    go.touch()  # both open the fresh store and register at once
    outs = [w.communicate(timeout=90) for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [err[-3000:] for _, err in outs]
    assert [out.strip().splitlines()[-1] for out, _ in outs] == ["models:/race-policy/1"] * 2
    client = MlflowClient(uri, registry_uri=uri)
    assert len(client.search_model_versions("name = 'race-policy'")) == 1


def test_a_held_run_directory_stops_a_second_run_and_a_killed_holder_is_taken_over(tmp_path, mlflow_uri):
    out = tmp_path / "out"
    worker = start_worker("run", mlflow_uri, str(out))
    _, parent_id, stage_id = read_line(worker).split()
    holder = read_holder(out)
    assert holder["pid"] == worker.pid

    started = time.monotonic()
    with pytest.raises(
        RunLockedError, match=rf"is in use by another pipeline run \(host .+, pid {worker.pid}, started .+\)"
    ):
        with run_lock(out):
            pass
    assert time.monotonic() - started < 2  # at once, no waiting

    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=30)
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    assert client.get_run(parent_id).info.status == "RUNNING"  # nobody could end it
    # as if it had been killed inside log_model: a logged model left PENDING in its stage run
    half = client.create_logged_model(client.get_run(stage_id).info.experiment_id, name="half", source_run_id=stage_id)
    assert str(client.get_logged_model(half.model_id).status) in ("PENDING", "LoggedModelStatus.PENDING")

    with run_lock(out) as mine:  # the OS released the dead holder's lock; the holder file is rewritten
        assert mine["pid"] == os.getpid() and read_holder(out)["pid"] == os.getpid()
        with tracking.runs.pipeline_run(cfg_for(mlflow_uri, out)) as run_id:
            # the next start marked the abandoned runs of this run directory KILLED
            assert client.get_run(parent_id).info.status == "KILLED"
            assert client.get_run(stage_id).info.status == "KILLED"
            assert str(client.get_logged_model(half.model_id).status).endswith("FAILED")
            tags = client.get_run(run_id).data.tags
            assert tags["rlhf.pid"] == str(os.getpid()) and tags["rlhf.output_dir"] == str(out.resolve())
    assert not (out / HOLDER_FILE).exists()


def test_sigterm_ends_the_runs_killed_and_releases_the_lock(tmp_path, mlflow_uri):
    out = tmp_path / "out"
    worker = start_worker("run", mlflow_uri, str(out))
    _, parent_id, stage_id = read_line(worker).split()
    worker.send_signal(signal.SIGTERM)
    _, err = worker.communicate(timeout=30)
    assert worker.returncode == 143, err[-3000:]
    client = MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    assert client.get_run(parent_id).info.status == "KILLED"
    assert client.get_run(stage_id).info.status == "KILLED"
    assert not (out / HOLDER_FILE).exists()
    with run_lock(out):
        pass


def test_a_second_holder_in_the_same_process_is_refused_and_the_cli_prints_one_sentence(tmp_path):
    from flows.cli import is_user_error

    with run_lock(tmp_path) as holder:
        assert json.loads((tmp_path / HOLDER_FILE).read_text()) == holder
        with pytest.raises(RunLockedError) as err:
            with run_lock(tmp_path):
                pass
    assert is_user_error(err.value) and isinstance(err.value, ValueError)
    assert str(os.getpid()) in str(err.value)
    with run_lock(tmp_path):  # released
        pass


def test_an_interruption_ends_the_runs_killed_and_a_failure_failed(tmp_path, mlflow_uri):
    cfg, ids = cfg_for(mlflow_uri, tmp_path), {}
    with pytest.raises(KeyboardInterrupt):
        with tracking.runs.pipeline_run(cfg) as run_id, tracking.runs.stage_run(run_id, "sft") as stage_id:
            ids.update(parent=run_id, stage=stage_id)
            raise KeyboardInterrupt
    client = MlflowClient()
    assert [client.get_run(ids[k]).info.status for k in ("parent", "stage")] == ["KILLED", "KILLED"]


def test_terminate_on_sigterm_raises_in_the_main_thread_and_restores_the_handler():
    from tasks.runtime.run_lock import Terminated

    before = signal.getsignal(signal.SIGTERM)
    if before not in (signal.SIG_DFL, None):
        pytest.skip("another SIGTERM handler is installed in this process")
    with pytest.raises(Terminated):
        with terminate_on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) == before
