"""Scale-out pieces that run without a GPU: metric reduction on one process, the launch command, FSDP's wrap
classes (the accelerate config files: tests/rlhf_core/config/test_run_model_data.py)."""

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from rlhf_core.config import PipelineConfig
from rlhf_core.training.parallel import full_parameters, gathered_state_dicts, reduce_metrics

REPO = Path(__file__).resolve().parents[3]
ACCELERATE = REPO / "configs" / "accelerate"


def test_reduce_metrics_on_one_process_brings_tensors_and_floats_back_as_floats():
    out = reduce_metrics(
        Accelerator(cpu=True), {"loss": torch.tensor(0.25), "tokens": torch.tensor(7), "lr": 1e-3}, sums=("tokens",)
    )
    assert out == {"loss": 0.25, "tokens": 7.0, "lr": pytest.approx(1e-3)}
    assert all(type(v) is float for v in out.values())
    assert reduce_metrics(Accelerator(cpu=True), {}) == {}


def test_without_sharding_generation_needs_no_gathering_and_checkpoints_save_the_modules_themselves():
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    with full_parameters(accelerator, model):
        assert model(torch.ones(1, 2)).shape == (1, 2)
    assert gathered_state_dicts(accelerator, model, {"m": model}) is None


@pytest.mark.parametrize("name", ["deepspeed_zero3", "fsdp"])
def test_lora_with_parameter_sharding_is_refused(name):
    path = str(ACCELERATE / f"{name}.yaml")
    rl = {"max_nonfinite_steps_in_a_row": 0}
    reward = {"max_nonfinite_steps_in_a_row": 0}
    with pytest.raises(ValueError, match="shards parameters"):
        PipelineConfig.model_validate(
            {"run": {"accelerate_config": path}, "model": {"lora": {"enabled": True}}, "rl": rl, "reward": reward}
        )
    with pytest.raises(ValueError, match="shards parameters"):
        PipelineConfig.model_validate(
            {"run": {"accelerate_config": path}, "reward": {"lora": True, **reward}, "rl": rl}
        )
    PipelineConfig.model_validate(
        {
            "run": {"accelerate_config": str(ACCELERATE / "deepspeed_zero2.yaml")},
            "model": {"lora": {"enabled": True}},
            "rl": rl,
            "reward": reward,
        }
    )


@pytest.mark.parametrize("name", ["deepspeed_zero2", "deepspeed_zero3"])
def test_deepspeed_cannot_skip_a_non_finite_step_so_the_config_says_so(name):
    path = str(ACCELERATE / f"{name}.yaml")
    with pytest.raises(ValueError, match="rl.max_nonfinite_steps_in_a_row: 0"):
        PipelineConfig.model_validate({"run": {"accelerate_config": path}})
    with pytest.raises(ValueError, match="reward.max_nonfinite_steps_in_a_row: 0"):
        PipelineConfig.model_validate({"run": {"accelerate_config": path}, "rl": {"max_nonfinite_steps_in_a_row": 0}})
    PipelineConfig.model_validate(
        {
            "run": {"accelerate_config": path},
            "rl": {"max_nonfinite_steps_in_a_row": 0},
            "reward": {"max_nonfinite_steps_in_a_row": 0},
        }
    )
    PipelineConfig.model_validate({"run": {"accelerate_config": str(ACCELERATE / "ddp.yaml")}})


def test_ppo_wrapper_exposes_the_decoder_layer_class_for_fsdp_auto_wrap(smoke_world):
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.rewards.reward_model import load_reward_model
    from rlhf_core.rl.ppo import PolicyAndValue

    tok = load_tokenizer(str(smoke_world.tokenizer))
    both = PolicyAndValue(
        load_causal_lm(str(smoke_world.base_model)), load_reward_model(str(smoke_world.base_model), tok)
    )
    assert both._no_split_modules == ["LlamaDecoderLayer"]


def test_cpu_threads_sets_torchs_intra_op_threads_and_none_leaves_them():
    import torch

    from rlhf_core.training.parallel import use_cpu_threads

    before = torch.get_num_threads()
    try:
        use_cpu_threads(1)
        assert torch.get_num_threads() == 1
        use_cpu_threads(None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
