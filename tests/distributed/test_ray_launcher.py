"""run.launcher 'ray': the training stages as a Ray Train TorchTrainer on a cluster of two nodes simulated
on this machine (tests/distributed/ray_nodes.py: one CPU per node, so the two workers land on both).

One pipeline (a reward model, then GRPO scored by it) runs on 2 Ray workers. After one of GRPO's
checkpoints one worker (rank 0, the one that talks to MLflow) is killed with SIGKILL; Ray restarts the
worker group (run.max_failures 1) and GRPO resumes from its newest checkpoint. It is compared with the same
pipeline under torchrun, uninterrupted: the reward model and the exported policy must be the same
weights. (torchrun's 2 processes are 1 process with the joined batch: tests/distributed/test_equivalence.py.)
The Ray run also has a password and a hub token planted in the environment, where the nodes take
credentials from: they must be nowhere in a spec file, Ray's state API (jobs, actors), Ray's logs,
the MLflow server's store or the run directory.

Then, before any training: an output directory that one node does not share fails the stage in one
sentence (a credential that the nodes lack does the same: tests/tasks/launch/test_launcher.py). What was not run here: nodes on separate hosts, GPUs
and NCCL (docs/ray.md).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

import tasks.launch.launcher
from flows.rlhf_pipeline import rlhf_pipeline
from rlhf_core.config import load_config
from tasks.launch.launcher import StageRefusedError
from tasks.launch.story import REFUSAL_PREFIX, ConsoleFilter
from tasks.stage_io import checkpoint_steps
from tasks.stages.reward_model import worker_body as reward_worker_body
from tests.distributed.ray_nodes import blind_node, can_unshare, ray_temp_root, start_cluster, stop_cluster
from tests.fixtures.runtime import deadline, environment
from tests.fixtures.servers import MLFLOW_ENV, running_mlflow_server

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.yaml")
SENTINEL = "Sentinel-7c41d9a2"
PLANTED = {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": SENTINEL, "HF_TOKEN": f"hf_{SENTINEL}"}
# the reward model, then GRPO scored by it: 4 steps, a checkpoint after each (no SFT warm start: from the base)
PIPELINE = ["run.num_processes=2", "rl.algorithm=grpo", "rl.total_steps=4", "rl.save_steps=1"]
PIPELINE += ["sft.enabled=false", "init.policy=base"]
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


class RecordingHandler(logging.Handler):
    """Keeps every record."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@contextmanager
def recorded_logs():
    """Every log record of the process while it lasts (the workers' lines come through the stage task's logger)."""
    handler = RecordingHandler()
    logging.getLogger().addHandler(handler)
    try:
        yield handler.records
    finally:
        logging.getLogger().removeHandler(handler)


@pytest.fixture(scope="module")
def cluster():
    """Two nodes of one CPU each; their processes have the planted credentials in their environment. Ray's
    files (the address file too) go to a directory of this fixture's, removed after."""
    root = ray_temp_root()
    try:
        with deadline(120, "starting the Ray cluster"), environment(PLANTED):
            started = start_cluster(root)
        yield started, root / "ray"
        stop_cluster(started, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def kill_rank0_after_a_checkpoint(address: str, stage_root: Path, tracking_port: int, killed: list) -> threading.Thread:
    """A thread that SIGKILLs GRPO's rank-0 worker as soon as GRPO has a complete checkpoint. The workers are
    the alive RayTrainWorker actors (Ray's state API); rank 0 is the one connected to the tracking server
    (only rank 0 talks to MLflow)."""
    import psutil
    from ray.util.state import list_actors

    def rank0_pid() -> int | None:
        workers = list_actors(
            address=address,
            filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")],
            detail=True,
            raise_on_missing_output=False,
        )
        for worker in workers:
            try:
                connections = psutil.Process(worker.pid).net_connections(kind="tcp")
            except psutil.Error:
                continue
            if any(c.raddr and c.raddr.port == tracking_port for c in connections):
                return worker.pid
        return None

    def watch():
        end = time.monotonic() + 400
        while time.monotonic() < end and not killed:
            if any(checkpoint_steps(d) for d in stage_root.glob("*") if d.is_dir()):
                pid = rank0_pid()
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def ray_run(cluster, tmp_path_factory):
    """The pipeline on 2 Ray workers, rank 0 killed after one of GRPO's checkpoints; what it left behind."""
    started, ray_temp = cluster
    tmp = tmp_path_factory.mktemp("ray-run")
    out, specs, killed = tmp / "out", [], []
    real_command = tasks.launch.launcher.launch_command

    def recording_command(cfg, spec, result):  # every spec file, read while it exists
        specs.append(Path(spec).read_text())
        return real_command(cfg, spec, result)

    with (
        pytest.MonkeyPatch.context() as mp,
        recorded_logs() as records,
        running_mlflow_server(tmp / "server") as (host, store),
        environment(PLANTED),
    ):
        mp.setattr(tasks.launch.launcher, "launch_command", recording_command)
        overrides = [f"run.output_dir={out}", f"tracking.uri=http://{host}", *PIPELINE]
        overrides += ["run.launcher=ray", f"run.ray_address={started.address}", "run.max_failures=1"]
        port = int(host.rsplit(":", 1)[1])
        watcher = kill_rank0_after_a_checkpoint(started.address, out / "grpo", port, killed)
        with deadline(480, "the pipeline on Ray"):
            state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
        watcher.join(5)
        yield {
            "state": state,
            "out": out,
            "uri": f"http://{host}",
            "store": store,
            "specs": specs,
            "killed": killed,
            "messages": [r.getMessage() for r in records],
            "address": started.address,
            "ray_temp": ray_temp,
        }


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    """The same pipeline under torchrun (run.launcher 'local'), uninterrupted."""
    tmp = tmp_path_factory.mktemp("torchrun-run")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    overrides = [f"run.output_dir={tmp / 'out'}", f"tracking.uri={uri}", *PIPELINE]
    with (
        recorded_logs() as records,
        deadline(480, "the pipeline under torchrun"),
        environment({k: None for k in MLFLOW_ENV}),
    ):
        state = rlhf_pipeline(config_path=SMOKE, overrides=overrides, return_state=True)
    return {"state": state, "out": tmp / "out", "uri": uri, "messages": [r.getMessage() for r in records]}


def weights(out: Path, pattern: str) -> dict[str, torch.Tensor]:
    (path,) = sorted(out.glob(pattern))
    return load_file(str(path))


def test_stages_under_torchrun_log_once_per_step_and_register_each_checkpoint_once(prefect_harness, torchrun_run):
    assert torchrun_run["state"].is_completed(), torchrun_run["state"].message
    summary = torchrun_run["state"].result()
    client = MlflowClient(torchrun_run["uri"], registry_uri=torchrun_run["uri"])
    rewards = sorted(
        (int(v.version), v.tags["step"]) for v in client.search_model_versions("name = 'smoke-reward-model'")
    )
    assert [step for _, step in rewards] == ["2", "4"]
    assert summary["reward_model_uri"] == f"models:/smoke-reward-model/{rewards[-1][0]}"
    policies = sorted(client.search_model_versions("name = 'smoke-policy'"), key=lambda v: int(v.version))
    assert [(v.tags["stage"], v.tags["step"]) for v in policies] == [
        ("grpo", "1"),
        ("grpo", "2"),
        ("grpo", "3"),
        ("grpo", "4"),
        ("export", str(summary["selected_step"])),
    ]
    # one MLflow run per stage: the second process never opened one
    parent = client.get_run(summary["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.info.run_name for r in children) == ["data", "export", "grpo", "reward"]
    [grpo_run] = [r for r in children if r.info.run_name == "grpo"]
    # one writer: one value per step; with 2 processes of 8 completions each, 16 x 6 tokens at most
    lengths = client.get_metric_history(grpo_run.info.run_id, "completions/mean_length")
    assert [m.step for m in lengths] == [1, 2, 3, 4] and all(1.0 <= m.value <= 6.0 for m in lengths)
    # the processes' log went through the task's logger
    messages = torchrun_run["messages"]
    assert any("reward stage on 2 processes: " in m and "torchrun" in m for m in messages)
    assert any(m.startswith("[rank 0] reward checkpoint 4 is models:/smoke-reward-model/") for m in messages)


def test_ray_workers_ran_on_both_nodes_and_trained_the_weights_torchrun_trains(prefect_harness, ray_run, torchrun_run):
    assert ray_run["state"].is_completed(), ray_run["state"].message
    # each stage's two workers, one per node (the controller's story line, streamed into the task's log)
    for stage in ("reward", "rl"):
        [placed] = [
            m for m in ray_run["messages"] if m.startswith(f"{stage} stage: 2 workers started: rank 0 on node ")
        ]
        assert len(set(re.findall(r"rank \d on node (\w+)", placed))) == 2, placed
    assert any("reward stage on 2 processes: " in m and "tasks.launch.ray_driver" in m for m in ray_run["messages"])
    # the same reward model, and the same exported policy, as torchrun's uninterrupted run
    for pattern in ("reward/*/checkpoint-4/model.safetensors", "export/model.safetensors"):
        ray_weights, torchrun_weights = weights(ray_run["out"], pattern), weights(torchrun_run["out"], pattern)
        assert ray_weights.keys() == torchrun_weights.keys()
        for name, tensor in torchrun_weights.items():
            torch.testing.assert_close(ray_weights[name], tensor, rtol=0, atol=1e-6, msg=f"{pattern}: {name}")


def test_a_killed_worker_is_restarted_and_its_stage_resumes_without_duplicates_or_runs_left_running(ray_run):
    assert ray_run["killed"], "the watcher never killed a worker (GRPO finished before its first checkpoint?)"
    # the console's story: one line for the loss, one for the restart, one for the resume, from the same checkpoint;
    # none of Ray's own lines, no line twice (both simulated nodes forward every worker's line)
    messages = ray_run["messages"]
    [lost] = [m for m in messages if m.startswith("rl stage: rank 0 on node ") and " lost: " in m]
    assert lost.endswith("restart 1 of 1)") and "its process died (killed, or crashed); restarting" in lost
    step = re.search(r"restarting the workers from checkpoint (\d+) ", lost).group(1)
    assert len([m for m in messages if m.startswith("rl stage: 2 workers restarted (restart 1 of 1): ")]) == 1
    assert [m for m in messages if " resumes from " in m] == [f"[rank 0] the rl stage resumes from checkpoint {step}"]
    streamed = [m for m in messages if m.startswith(("[rank ", "rl stage: ", "reward stage: "))]
    assert len(streamed) == len(set(streamed)) and streamed
    assert not [m for m in messages if re.match(r"\((RayTrainWorker|TrainController|raylet)", m) or "Traceback" in m]
    log = (ray_run["out"] / "logs" / "rl.log").read_text()
    assert "(TrainController pid=" in log and "[FailurePolicy] RETRY" in log  # Ray's own word, in the stage's log
    # nothing of the run alive on the cluster: no actor (Ray Train's detached coordinator included), no placement group
    from ray.util.state import list_actors, list_placement_groups

    alive = list_actors(address=ray_run["address"], filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
    assert [a.class_name for a in alive] == []
    groups = list_placement_groups(address=ray_run["address"], raise_on_missing_output=False)
    assert [g.state for g in groups if g.state != "REMOVED"] == []
    client = MlflowClient(ray_run["uri"], registry_uri=ray_run["uri"])
    policies = sorted(client.search_model_versions("name = 'smoke-policy'"), key=lambda v: int(v.version))
    assert [(v.tags["stage"], v.tags["step"]) for v in policies] == [
        ("grpo", "1"),
        ("grpo", "2"),
        ("grpo", "3"),
        ("grpo", "4"),
        ("export", str(ray_run["state"].result()["selected_step"])),
    ]
    rewards = client.search_model_versions("name = 'smoke-reward-model'")
    assert sorted(v.tags["step"] for v in rewards) == ["2", "4"]
    experiment = client.get_experiment_by_name("rlhf-smoke")
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    grpo = {r.info.status: r for r in runs if r.info.run_name == "grpo"}
    # the killed attempt's run was ended by the launcher; the restarted one resumed from a checkpoint, not
    # from the start (metrics logged in the background may die with the killed worker: the steps before
    # are not pinned)
    assert sorted(grpo) == ["FINISHED", "KILLED"] and "launcher" in grpo["KILLED"].data.tags["rlhf.ended_by"]
    after = [m.step for m in client.get_metric_history(grpo["FINISHED"].info.run_id, "completions/mean_length")]
    assert 1 < after[0] and after == list(range(after[0], 5))


def test_no_planted_credential_reaches_a_spec_file_ray_or_the_stores(ray_run):
    from ray.util.state import list_actors, list_jobs

    assert len(ray_run["specs"]) == 2  # the reward stage's and GRPO's
    for spec in ray_run["specs"]:
        assert json.loads(spec)["config"]["tracking"]["uri"] == ray_run["uri"]
    address = ray_run["address"]
    jobs, actors = list_jobs(address=address, detail=True), list_actors(address=address, detail=True, limit=1000)
    assert any(a.class_name == "RayTrainWorker" for a in actors)
    views = {"spec files": "\n".join(ray_run["specs"]), "Ray jobs": repr(jobs), "Ray actors": repr(actors)}
    views["the task's log"] = "\n".join(ray_run["messages"])
    for where, text in views.items():
        for secret in PLANTED.values():
            if secret != "alice":
                assert secret not in text, f"{secret!r} found in {where}"
    needle = SENTINEL.encode()
    for root in (ray_run["ray_temp"], ray_run["store"], ray_run["out"]):
        leaked = [
            str(p) for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink() and needle in p.read_bytes()
        ]
        assert leaked == [], f"the planted secret is in {leaked}"


def stage_config(tmp_path: Path, *overrides: str):
    return load_config(
        SMOKE,
        [f"run.output_dir={tmp_path / 'out'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", *overrides],
    )


@pytest.mark.skipif(not can_unshare(), reason="needs unshare --mount (root or CAP_SYS_ADMIN)")
def test_an_output_directory_one_node_does_not_share_fails_in_seconds_naming_it_and_the_node(
    cluster, tmp_path, monkeypatch
):
    started, ray_temp = cluster
    monkeypatch.setenv("RAY_ADDRESS", started.address)  # run.ray_address 'auto' finds the cluster through it
    out = tmp_path / "out"
    out.mkdir()
    cfg = stage_config(
        tmp_path,
        "run.launcher=ray",
        "run.ray_address=auto",  # RAY_ADDRESS names the cluster
        "run.num_processes=3",
        "run.ray_placement_strategy=STRICT_SPREAD",  # one worker on each of the three nodes
    )
    with blind_node(started.address, ray_temp, out) as blind:
        begin = time.monotonic()
        with deadline(120, "the stage"), pytest.raises(StageRefusedError) as failed:
            tasks.launch.launcher.launch("reward", reward_worker_body, cfg, data={}, policy=None, parent_run_id=None)
        took = time.monotonic() - begin
    message = str(failed.value)
    assert message.startswith(f"run.output_dir {out} is not shared storage: the worker of rank ")
    assert f"node {blind[:12]}" in message and message.endswith("(NFS, a shared volume)")
    # nothing trained, nothing left behind but the stage's log; 90 s: Ray's and torch's process start-up alone took
    # 63 s at load 10 here
    assert took < 90 and sorted(p.name for p in out.iterdir()) == ["logs"]


@pytest.mark.parametrize("launcher", ["ray", "local"])
def test_a_user_error_inside_a_worker_ends_the_stage_at_once_with_its_sentence(
    cluster, tmp_path, monkeypatch, launcher
):
    """A reward base that does not exist is found by the workers (the launcher never resolves it): a restart cannot
    mend it, so neither Ray nor torchrun spends run.max_failures on it."""
    started, _ = cluster
    monkeypatch.setenv("RAY_ADDRESS", started.address)
    cfg = stage_config(
        tmp_path,
        f"run.launcher={launcher}",
        "run.ray_address=auto",
        "run.num_processes=2",
        "run.max_failures=2",
        f"reward.base={tmp_path / 'no-such-model'}",
    )
    fingerprints = {"preference": "0" * 16, "preference_eval": "1" * 16}  # the stage's key reads them
    data = {"tables": {}, "fingerprints": fingerprints, "base_model": str(tmp_path), "tokenizer": str(tmp_path)}
    with deadline(240, "the refused stage"), pytest.raises(StageRefusedError) as refused:
        tasks.launch.launcher.launch("reward", reward_worker_body, cfg, data=data, policy=None, parent_run_id=None)
    assert str(refused.value) == f"reward.base: directory {tmp_path / 'no-such-model'} does not exist"
    log = (tmp_path / "out" / "logs" / "reward.log").read_text().splitlines()
    if launcher == "ray":  # one worker group, never restarted: what the console showed
        console = ConsoleFilter()
        shown = [line for raw in log if (line := console.keep(raw)) is not None]
        assert len([m for m in shown if m.startswith("reward stage: 2 workers started: ")]) == 1
        assert not [m for m in shown if "restart" in m] and console.refusal == str(refused.value)
    else:  # torchrun restarts the processes anyway: each attempt after the first ends on the first one's sentence
        said = [line for line in log if line.startswith(REFUSAL_PREFIX)]
        assert len(said) > 2 and {line.removeprefix(REFUSAL_PREFIX) for line in said} == {str(refused.value)}
