"""rlhf_core/config/cross_checks.py: PipelineConfig's cross-field checks, each on the sections it reads."""

from __future__ import annotations

from pathlib import Path

import pytest

import rlhf_core.config.cross_checks as cross_checks
from rlhf_core.config import (
    ConfigError,
    EvalConfig,
    GRPOConfig,
    GuardConfig,
    InitConfig,
    PPOConfig,
    RewardConfig,
    RLConfig,
    RunConfig,
    SFTConfig,
    load_config,
)
from rlhf_core.config.cross_checks import (
    check_eval_columns,
    check_generation_batch,
    check_group_family,
    check_group_fields,
    check_group_rewards,
    check_init_policy,
    check_init_reference,
    check_launcher,
    check_nonfinite_skipping,
    check_ppo_accumulation,
    check_ppo_mini_batches,
    check_sync_ref_model,
    group_batch_field,
)

REPO = Path(__file__).resolve().parents[3]
ACCELERATE = REPO / "configs" / "accelerate"


def test_ppo_batch_arithmetic():
    check_ppo_mini_batches(RLConfig(algorithm="ppo", batch_size=8), PPOConfig(num_mini_batches=4))
    with pytest.raises(ValueError, match="^rl.batch_size 6 must be a multiple of ppo.num_mini_batches 4$"):
        check_ppo_mini_batches(RLConfig(algorithm="ppo", batch_size=6), PPOConfig(num_mini_batches=4))
    check_ppo_mini_batches(RLConfig(algorithm="grpo", batch_size=6), PPOConfig(num_mini_batches=4))  # not PPO
    rl = RLConfig(algorithm="ppo", batch_size=8, gradient_accumulation_steps=3)
    with pytest.raises(ValueError, match=r"^a PPO mini-batch of 4 \(rl.batch_size / ppo.num_mini_batches\) must be"):
        check_ppo_accumulation(rl, PPOConfig(num_mini_batches=2))
    check_ppo_accumulation(RLConfig(algorithm="ppo", batch_size=8, gradient_accumulation_steps=2), PPOConfig())


def test_init_needs_lora_for_a_disabled_adapter_and_sft_for_an_sft_start():
    check_init_reference(InitConfig(reference="adapter_disabled"), lora_enabled=True)
    with pytest.raises(ValueError, match="needs model.lora.enabled true"):
        check_init_reference(InitConfig(reference="adapter_disabled"), lora_enabled=False)
    check_init_policy(InitConfig(policy="sft"), SFTConfig(enabled=True))
    with pytest.raises(ValueError, match="^init.policy is 'sft' but the SFT stage is off"):
        check_init_policy(InitConfig(policy="sft"), SFTConfig(enabled=False))


def test_the_launcher_reads_the_accelerate_file_once_and_refuses_ray_before_reading_it(monkeypatch):
    reads = []
    monkeypatch.setattr(cross_checks, "accelerate_strategy", lambda path: reads.append(path) or "zero3")
    assert check_launcher(RunConfig(), trains_lora=True) is None and reads == []
    with pytest.raises(ValueError, match="run.launcher 'ray' does not run"):
        check_launcher(RunConfig(launcher="ray", accelerate_config=Path("/no/such.yaml")), trains_lora=False)
    assert reads == []  # the missing file is not what the user hears first
    assert check_launcher(RunConfig(accelerate_config=Path("z3.yaml")), trains_lora=False) == "zero3"
    with pytest.raises(ValueError, match=r"shards parameters \(zero3\), which LoRA training does not need"):
        check_launcher(RunConfig(accelerate_config=Path("z3.yaml")), trains_lora=True)
    assert reads == [Path("z3.yaml"), Path("z3.yaml")]


def test_a_whole_config_reads_its_accelerate_file_once(monkeypatch):
    # the launcher, sync_ref_model and DeepSpeed's non-finite steps all ask for the strategy: one read
    reads = []
    monkeypatch.setattr(cross_checks, "accelerate_strategy", lambda path: reads.append(path) or "ddp")
    overrides = ["rl.algorithm=grpo", "grpo.sync_ref_model=true", f"run.accelerate_config={ACCELERATE / 'ddp.yaml'}"]
    load_config(REPO / "configs" / "demo.yaml", overrides)
    assert reads == [ACCELERATE / "ddp.yaml"]


def test_fsdp_version_1_is_refused(tmp_path):
    fsdp1 = tmp_path / "fsdp1.yaml"
    fsdp1.write_text("distributed_type: FSDP\nfsdp_config: {fsdp_version: 1}\n")
    with pytest.raises(ValueError, match="uses FSDP version 1; set fsdp_config.fsdp_version: 2"):
        check_launcher(RunConfig(accelerate_config=fsdp1), trains_lora=False)


def test_deepspeed_cannot_skip_a_nonfinite_step():
    run = RunConfig(accelerate_config=ACCELERATE / "deepspeed_zero2.yaml")
    rl, reward = RLConfig(max_nonfinite_steps_in_a_row=0), RewardConfig(max_nonfinite_steps_in_a_row=3)
    with pytest.raises(ValueError, match=r"set reward.max_nonfinite_steps_in_a_row: 0 \(it is 3;"):
        check_nonfinite_skipping(run, "zero2", rl, reward)
    check_nonfinite_skipping(run, "ddp", rl, reward)  # DDP skips it
    check_nonfinite_skipping(RunConfig(), None, rl, reward)


def test_the_group_family_checks():
    grpo = GRPOConfig(scale_rewards="batch")
    with pytest.raises(ValueError, match="^grpo.scale_rewards applies to rl.algorithm grpo, not 'rloo'"):
        check_group_fields(RLConfig(algorithm="rloo"), grpo)
    with pytest.raises(ValueError, match=r"grpo.reward_clip_range \[2.0, 1.0\] must be \[low, high\]"):
        check_group_fields(RLConfig(algorithm="rloo"), GRPOConfig(reward_clip_range=[2.0, 1.0]))
    with pytest.raises(ValueError, match="^grpo.generation_batch_size 6 must be a multiple of grpo.num_generations 4"):
        check_generation_batch(RLConfig(batch_size=8), GRPOConfig(generation_batch_size=6, num_generations=4))
    rl = RLConfig(missing_eos_penalty=1.0)
    with pytest.raises(ValueError, match="^rl.missing_eos_penalty is subtracted from the summed reward"):
        check_group_rewards(rl, GRPOConfig(multi_objective_aggregation="normalize_then_sum"))
    with pytest.raises(
        ValueError, match="^grpo.dynamic_sampling drops groups of completions, which rl.algorithm 'ppo'"
    ):
        check_group_family(
            RLConfig(algorithm="ppo"), GRPOConfig(dynamic_sampling={"enabled": True}), False, RunConfig(), None
        )


def test_the_generation_batch_is_named_by_the_field_that_sets_it():
    assert group_batch_field(GRPOConfig(generation_batch_size=None)) == "rl.batch_size"
    assert group_batch_field(GRPOConfig(generation_batch_size=16)) == "grpo.generation_batch_size"
    with pytest.raises(ValueError, match="^rl.batch_size 6 must be a multiple of grpo.num_generations 4$"):
        check_generation_batch(RLConfig(batch_size=6), GRPOConfig(generation_batch_size=None, num_generations=4))


def test_sync_ref_model_needs_a_whole_reference_copy():
    sync = GRPOConfig(sync_ref_model=True, beta=0.1)
    check_sync_ref_model(sync, False, RunConfig(), None)
    with pytest.raises(ValueError, match="grpo.beta is 0 so none is loaded"):
        check_sync_ref_model(GRPOConfig(sync_ref_model=True, beta=0.0), False, RunConfig(), None)
    with pytest.raises(ValueError, match="with model.lora.enabled the reference is the policy"):
        check_sync_ref_model(sync, True, RunConfig(), None)
    zero3 = RunConfig(accelerate_config=Path("z3.yaml"))
    with pytest.raises(
        ValueError, match="^grpo.sync_ref_model mixes whole weights, which run.accelerate_config z3.yaml"
    ):
        check_sync_ref_model(sync, False, zero3, "zero3")


def test_guard_and_verifier_name_eval_columns():
    evaluation, guard = EvalConfig(), GuardConfig()
    check_eval_columns(["vader_compound"], "vader_compound", evaluation, guard)
    gold = GuardConfig(divergence={"gold": "nope"})
    with pytest.raises(ValueError, match=r"allowed: none \(eval.metrics is empty\)$"):
        check_eval_columns([], None, evaluation, gold)
    sampled = EvalConfig(samples_per_prompt=4, pass_at_k=[1])
    with pytest.raises(
        ValueError, match="^eval.samples_per_prompt 4 counts correct completions with eval.verifier None"
    ):
        check_eval_columns(["pass_at_1", "maj_at_4"], None, sampled, guard)


def test_the_checks_fire_in_order():
    # both init.reference and the PPO mini-batch are wrong: init's sentence comes first, as before the split
    both = ["init.reference=adapter_disabled", "model.lora.enabled=false", "rl.algorithm=ppo", "rl.batch_size=8"]
    both += ["ppo.num_mini_batches=2", "rl.gradient_accumulation_steps=3"]
    with pytest.raises(ConfigError, match="init.reference 'adapter_disabled' needs model.lora.enabled"):
        load_config(REPO / "configs" / "demo.yaml", both)
    with pytest.raises(ConfigError, match="a PPO mini-batch of 4"):
        load_config(REPO / "configs" / "demo.yaml", both[2:])
