"""rlhf_core/config/run_model_data.py: the run, model and data sections (their cross-field checks live in
PipelineConfig, tests/rlhf_core/config/test_pipeline.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rlhf_core.config import DEMO, DataConfig, DatasetSpec, DemoModelConfig, RunConfig


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
