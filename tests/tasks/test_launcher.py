"""tasks/launcher.py: the command that starts a stage on N processes."""

from pathlib import Path

from rlhf_core.config import PipelineConfig, load_config
from tasks.launcher import launch_command

REPO = Path(__file__).resolve().parents[2]


def test_stage_launch_command_cpu_torchrun_cuda_accelerate_with_the_config_file(tmp_path, monkeypatch):
    cpu = PipelineConfig.model_validate({"run": {"device": "cpu", "num_processes": 2}})
    command = launch_command(cpu, tmp_path / "spec.json")
    assert Path(command[0]).name == "torchrun" and command[1:4] == ["--standalone", "--nproc_per_node", "2"]
    assert command[-3:] == ["-m", "tasks.distributed", str(tmp_path / "spec.json")]
    monkeypatch.chdir(REPO)
    example = load_config(REPO / "configs" / "examples" / "multi-gpu.yaml")
    command = launch_command(example, tmp_path / "spec.json")
    assert Path(command[0]).name == "accelerate" and command[1:4] == ["launch", "--num_processes", "8"]
    assert command[4:6] == ["--config_file", "configs/accelerate/deepspeed_zero2.yaml"]
    plain = PipelineConfig.model_validate({"run": {"device": "cuda", "num_processes": 4, "mixed_precision": "bf16"}})
    assert "--multi_gpu" in launch_command(plain, tmp_path / "spec.json")
