"""rlhf_core/config/accelerate.py: the accelerate config files and what the config check makes of them."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from rlhf_core.config import PipelineConfig
from rlhf_core.config.accelerate import accelerate_strategy

REPO = Path(__file__).resolve().parents[3]
ACCELERATE = REPO / "configs" / "accelerate"


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
