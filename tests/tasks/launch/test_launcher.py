"""tasks/launch/launcher.py: the command that starts a stage on N processes, and the spec they read."""

import json
from pathlib import Path

import pytest

from rlhf_core.config import PipelineConfig, load_config
from tasks.launch.launcher import launch_command, worker_spec
from tasks.stages.reward_model import worker_body as reward_worker_body
from tasks.stages.rl.stage import worker_body as rl_worker_body

REPO = Path(__file__).resolve().parents[3]
SECRET = "Pl4nted-s3cret"


def test_stage_launch_command_cpu_torchrun_cuda_accelerate_with_the_config_file(tmp_path, monkeypatch):
    spec, result = tmp_path / "spec.json", tmp_path / "result.json"
    cpu = PipelineConfig.model_validate({"run": {"device": "cpu", "num_processes": 2}})
    command = launch_command(cpu, spec, result)
    assert Path(command[0]).name == "torchrun" and command[1:4] == ["--standalone", "--nproc_per_node", "2"]
    assert command[4:] == ["-m", "tasks.launch.worker", str(spec), str(result)]
    restarting = PipelineConfig.model_validate({"run": {"device": "cpu", "num_processes": 2, "max_failures": 3}})
    assert launch_command(restarting, spec, result)[4:6] == ["--max-restarts", "3"]
    monkeypatch.chdir(REPO)
    example = load_config(REPO / "configs" / "examples" / "multi-gpu.yaml")
    command = launch_command(example, spec, result)
    assert Path(command[0]).name == "accelerate" and command[1:4] == ["launch", "--num_processes", "8"]
    assert command[4:6] == ["--config_file", "configs/accelerate/deepspeed_zero2.yaml"]
    plain = PipelineConfig.model_validate({"run": {"device": "cuda", "num_processes": 4, "mixed_precision": "bf16"}})
    assert "--multi_gpu" in launch_command(plain, spec, result)


def test_the_ray_launcher_runs_the_driver_in_its_own_process(tmp_path):
    spec, result = tmp_path / "spec.json", tmp_path / "result.json"
    cfg = PipelineConfig.model_validate({"run": {"num_processes": 2, "launcher": "ray", "ray_address": "auto"}})
    # two file names and nothing else: Ray records the driver's command line as the job's entry point
    assert launch_command(cfg, spec, result)[1:] == ["-m", "tasks.launch.ray_driver", str(spec), str(result)]


def test_the_spec_carries_no_credential_the_workers_take_it_from_their_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = {"run": {"num_processes": 2, "output_dir": "out"}}
    cfg = PipelineConfig.model_validate({**base, "tracking": {"uri": f"https://alice:{SECRET}@mlflow.example:443"}})
    spec, env = worker_spec("rl", rl_worker_body, cfg, {"parent_run_id": "abc"})
    assert spec["config"]["tracking"]["uri"] == "https://mlflow.example:443"
    assert env == {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": SECRET}
    assert spec["env_needed"] == ["MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_USERNAME"]
    assert SECRET not in json.dumps(spec)
    # relative paths mean the same in every process: the run directory absolute, the launching directory given
    assert spec["config"]["run"]["output_dir"] == str(tmp_path / "out") and spec["cwd"] == str(tmp_path)
    assert spec["inputs"] == {"parent_run_id": "abc"} and spec["stage"] == "rl"
    assert spec["body"] == "tasks.stages.rl.stage:worker_body"  # what each worker imports and runs

    # a secret that cannot move into MLflow's username/password variables: the URI stays out entirely
    token = PipelineConfig.model_validate({**base, "tracking": {"uri": f"https://mlflow.example/?token={SECRET}"}})
    spec, env = worker_spec("rl", rl_worker_body, token, {})
    assert spec["config"]["tracking"]["uri"] is None and env == {"MLFLOW_TRACKING_URI": token.tracking.uri}
    assert spec["env_needed"] == ["MLFLOW_TRACKING_URI"] and SECRET not in json.dumps(spec)

    # a URI from the environment is written down resolved (a worker on another node has another environment)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    spec, env = worker_spec("reward", reward_worker_body, PipelineConfig.model_validate(base), {})
    assert spec["config"]["tracking"]["uri"] == "http://mlflow.internal:5000" and env == {}


def test_a_credential_anywhere_else_in_the_spec_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = PipelineConfig.model_validate({"model": {"base": f"https://hf.example/model?token={SECRET}"}})
    with pytest.raises(ValueError, match=r"^model.base carries a credential, which would be written") as raised:
        worker_spec("rl", rl_worker_body, cfg, {})
    assert SECRET not in str(raised.value)


def test_a_worker_without_the_credentials_the_spec_left_out_is_named_with_its_node(monkeypatch):
    from tasks.launch.worker import env_verdict, missing_env

    spec = {"env_needed": ["MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_USERNAME"]}
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    assert missing_env(spec) == ["MLFLOW_TRACKING_PASSWORD"] and missing_env({}) == []
    # every worker's view is gathered; the first that lacks one is named, and every worker returns the sentence
    assert env_verdict([("node a (gpu-1, 10.0.0.1)", []), ("node b (gpu-2, 10.0.0.2)", [])]) is None
    assert env_verdict([("node a (gpu-1, 10.0.0.1)", []), ("node b (gpu-2, 10.0.0.2)", ["MLFLOW_TRACKING_URI"])]) == (
        "the worker on node b (gpu-2, 10.0.0.2) has no MLFLOW_TRACKING_URI in its environment, and the tracking "
        "credentials are never sent to the workers: set them in the environment of every node of the cluster "
        "(docs/ray.md)"
    )
