"""rlhf_core/config/run_model_data.py: the run, model and data sections (their cross-field checks live in
PipelineConfig, tests/rlhf_core/config/test_pipeline.py), and the accelerate config files and what the config
check makes of them."""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from pydantic import ValidationError

from rlhf_core.config import DEMO, DataConfig, DatasetSpec, DemoModelConfig, PipelineConfig, RunConfig
from rlhf_core.config.run_model_data import DemoWorldConfig, accelerate_strategy

REPO = Path(__file__).resolve().parents[3]
ACCELERATE = REPO / "configs" / "accelerate"


def test_run_defaults_and_bounds():
    run = RunConfig()
    assert (run.name, run.output_dir, run.seed, run.device, run.num_processes) == (
        "rlhf",
        Path("outputs/rlhf"),
        42,
        "auto",
        1,
    )
    assert RunConfig(output_dir="x").output_dir == Path("x")  # paths take strings
    assert (run.launcher, run.ray_address, run.ray_cpus_per_worker, run.ray_placement_strategy, run.max_failures) == (
        "local",
        None,
        1.0,
        "SPREAD",
        0,
    )
    bad_values = [{"seed": -1}, {"num_processes": 0}, {"device": "tpu"}, {"name": ""}, {"launcher": "slurm"}]
    bad_values += [{"ray_cpus_per_worker": 0}, {"ray_placement_strategy": "spread"}, {"max_failures": -1}]
    for bad in bad_values:
        with pytest.raises(ValidationError):
            RunConfig(**bad)


def test_the_demo_model_needs_heads_that_divide_the_hidden_size():
    assert DemoModelConfig(hidden_size=32, num_attention_heads=4).hidden_size == 32
    with pytest.raises(ValidationError, match="hidden_size 30 must be divisible by num_attention_heads 4"):
        DemoModelConfig(hidden_size=30, num_attention_heads=4)


def test_the_data_sources_default_to_the_demo_world():
    data = DataConfig()
    assert (data.prompts.path, data.prompts.split, data.eval_prompts.split) == (DEMO, "train", "test")
    with pytest.raises(ValidationError, match="split 'validation' does not exist in the demo world"):
        DatasetSpec(split="validation")
    assert (
        DatasetSpec(path="data/prefs.jsonl", split="validation").split == "validation"
    )  # only the demo has fixed splits


@pytest.mark.parametrize(
    ("name", "strategy"), [("ddp", "ddp"), ("deepspeed_zero2", "zero2"), ("deepspeed_zero3", "zero3"), ("fsdp", "fsdp")]
)
def test_shipped_accelerate_configs_load_in_accelerate_and_say_what_they_shard(name, strategy):
    path = ACCELERATE / f"{name}.yaml"
    loaded = load_config_from_file(str(path))
    assert loaded.num_processes == -1  # taken from run.num_processes at launch
    assert loaded.mixed_precision == "bf16"
    assert accelerate_strategy(path) == strategy
    if strategy == "zero3":
        assert loaded.deepspeed_config["zero3_save_16bit_model"] is True  # checkpoints need the gathered weights


def test_accelerate_config_errors_name_the_field_and_file(tmp_path):
    with pytest.raises(ValueError, match=r"run.accelerate_config: .*nope.yaml does not exist"):
        accelerate_strategy(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("mixed_precision: bf16\n")
    with pytest.raises(ValueError, match=r"bad.yaml has no distributed_type"):
        accelerate_strategy(bad)
    fsdp1 = tmp_path / "fsdp1.yaml"
    fsdp1.write_text("distributed_type: FSDP\nfsdp_config: {fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP}\n")
    with pytest.raises(ValueError, match="FSDP version 1"):
        PipelineConfig.model_validate({"run": {"accelerate_config": str(fsdp1)}})


def test_the_demo_worlds_prompt_count_is_bounded_by_its_config_and_the_limit():
    demo = DemoWorldConfig(num_train_prompts=32, num_eval_prompts=8)
    assert demo.prompt_rows(DatasetSpec()) == (32, "data.demo.num_train_prompts")
    assert demo.prompt_rows(DatasetSpec(split="test")) == (8, "data.demo.num_eval_prompts")
    assert demo.prompt_rows(DatasetSpec(limit=10)) == (10, "data.demo.num_train_prompts and its limit")
    assert demo.prompt_rows(DatasetSpec(limit=100)) == (32, "data.demo.num_train_prompts")


def test_a_traces_source_names_its_experiment_its_window_and_a_train_or_test_split():
    spec = DatasetSpec(path="traces:traffic", since="2026-11-28T00:00:00Z", split="test")
    assert spec.feedback_experiment == "traffic" and spec.since_ms() == 1_795_824_000_000
    assert DatasetSpec(path="data/prefs.jsonl").feedback_experiment is None
    assert DatasetSpec(path="traces:traffic", since="last_training").since_ms() is None
    for fields, said in [
        ({"path": "traces: "}, "names no experiment"),
        ({"path": "traces:t", "since": "yesterday"}, "neither 'all', 'last_training' nor an ISO 8601 time"),
        ({"path": "prefs.jsonl", "since": "last_training"}, "since applies to a traces:<experiment> source"),
        ({"path": "traces:t", "split": "validation"}, "a traces: source's splits are 'train' and 'test'"),
    ]:
        with pytest.raises(ValidationError, match=said):
            DatasetSpec(**fields)
