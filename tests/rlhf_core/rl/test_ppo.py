"""PPO on the smoke world's tiny Llama: parameters move, the reference does not, resume is exact."""

import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.config import PPOConfig, RLConfig, RunConfig
from rlhf_core.demo.world import world_rows
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rewards.reward_model import load_reward_model
from rlhf_core.rl.inputs import rl_inputs
from rlhf_core.rl.ppo import AdaptiveKLController, FixedKLController, policy_loss, train_ppo, value_loss
from tests.fixtures.small_models import dropout_policy, first_step_gradients


class HighIdBackbone(torch.nn.Module):
    """Per position: how many tokens so far have an id of at least `cut` (an easy reward).

    Word-level ids are ordered by frequency, so prompts (frequent template words) score about 0 and
    the count measures the response alone.
    """

    def __init__(self, cut):
        super().__init__()
        self.cut = cut

    def forward(self, input_ids, attention_mask, **_):
        high = ((input_ids >= self.cut) & attention_mask.bool()).float()
        return SimpleNamespace(last_hidden_state=high.cumsum(1).unsqueeze(-1))


class HighIdReward(torch.nn.Module):
    """A stand-in reward model with the sequence-classifier shape: backbone + score head."""

    base_model_prefix = "backbone"

    def __init__(self, cut):
        super().__init__()
        self.backbone = HighIdBackbone(cut)
        self.score = torch.nn.Linear(1, 1)
        with torch.no_grad():
            self.score.weight.fill_(1.0)
            self.score.bias.zero_()


def prompts_of(world):
    return [r["prompt"] for r in world_rows(world, "prompt", "train")]


def setup(world, *, lora=False):
    tok = load_tokenizer(str(world.tokenizer))
    policy = load_causal_lm(str(world.base_model))
    ref = load_causal_lm(str(world.base_model))
    if lora:
        from peft import LoraConfig, TaskType, get_peft_model

        policy = get_peft_model(
            policy, LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        )
        ref = None
    value = load_reward_model(str(world.base_model), tok, seed=0)
    return tok, policy, ref, value, HighIdReward(len(tok) // 2)


RL = dict(batch_size=8, learning_rate=3e-3, response_length=6, temperature=1.0, save_steps=2, log_steps=1)


def run(world, out, steps=4, lora=False, on_log=None, ppo=None, **rl):
    tok, policy, ref, value, reward = setup(world, lora=lora)
    logs, ckpts = [], []

    def log(metrics, step):
        logs.append((step, metrics))
        if on_log:
            on_log(metrics, step)

    result = train_ppo(
        rl_inputs(
            policy,
            tok,
            prompts_of(world),
            out,
            value=value,
            reference=ref,
            reward_model=reward,
            rl=RLConfig(total_steps=steps, **{**RL, **rl}),
            ppo=ppo or PPOConfig(num_ppo_epochs=2, num_mini_batches=2),
            run=RunConfig(device="cpu", seed=5),
            max_prompt_length=12,
            on_log=log,
            on_checkpoint=lambda p, s: ckpts.append((p, s)),
            show_progress=False,
        )
    )
    return policy, value, ref, result, logs, ckpts


def test_policy_and_value_train_reference_stays_and_checkpoints_hold_the_policy_alone(tmp_path, smoke_world):
    _, policy0, ref0, value0, _ = setup(smoke_world)
    before_p = {n: p.clone() for n, p in policy0.named_parameters()}
    before_v = {n: p.clone() for n, p in value0.named_parameters()}
    policy, value, ref, result, logs, ckpts = run(smoke_world, tmp_path / "ppo")
    for name, param in policy.named_parameters():
        assert not torch.equal(before_p[name], param), f"policy {name} did not change"
    for name, param in value.named_parameters():
        assert not torch.equal(before_v[name], param), f"value {name} did not change"
    for name, param in ref.named_parameters():
        assert torch.equal(before_p[name], param), f"reference {name} changed"
    metric_names = set(logs[-1][1])
    assert {
        "objective/kl",
        "objective/entropy",
        "objective/non_score_reward",
        "objective/rlhf_reward",
        "objective/scores",
        "policy/approxkl_avg",
        "policy/clipfrac_avg",
        "loss/policy_avg",
        "loss/value_avg",
        "val/clipfrac_avg",
        "val/ratio",
        "perf/step_seconds",
        "perf/tokens_per_second",
    } <= metric_names
    # where the step's time went, phase by phase, within the step's own time
    phases = {f"time/{p}_s" for p in ("generate", "policy_logprobs", "reference", "reward", "value", "optimize")}
    assert phases <= metric_names and all(logs[-1][1][k] > 0 for k in phases)
    assert sum(logs[-1][1][k] for k in phases) <= logs[-1][1]["perf/step_seconds"] * 1.05
    # and around the steps: the previous log call and the checkpoint of step 2, reported at the next log
    assert logs[2][0] == 3 and logs[2][1]["time/checkpoint_s"] > 0 and logs[2][1]["time/log_s"] >= 0
    assert "time/checkpoint_s" not in logs[1][1]  # step 2's log comes before step 2's checkpoint
    assert [s for _, s in ckpts] == [2, 4] and ckpts[-1][0] == tmp_path / "ppo" / "checkpoint-4" / "policy"
    weights = load_file(str(result.checkpoint / "policy" / "model.safetensors"))
    assert not [k for k in weights if "score" in k]  # no value head in the policy
    assert "score.weight" in load_file(str(result.checkpoint / "value" / "model.safetensors"))
    assert (result.checkpoint / "training_state" / "tensors.safetensors").is_file()
    assert not list(result.checkpoint.rglob("*.bin")) and not list(result.checkpoint.rglob("*.pt"))


def test_resume_after_a_crash_matches_an_uninterrupted_run(tmp_path, smoke_world):
    straight, straight_value, _, full, _, _ = run(smoke_world, tmp_path / "a")

    def crash(metrics, step):
        if step == 3:
            raise RuntimeError("injected crash")

    with pytest.raises(RuntimeError, match="injected crash"):
        run(smoke_world, tmp_path / "b", on_log=crash)
    resumed, resumed_value, _, result, logs, ckpts = run(smoke_world, tmp_path / "b")
    assert result.resumed_from == 2 and result.step == full.step == 4
    assert [s for s, _ in logs] == [3, 4] and [s for _, s in ckpts] == [4]
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"policy {name} differs after resume")
    for (name, a), (_, b) in zip(straight_value.named_parameters(), resumed_value.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"value {name} differs after resume")


def test_lora_reference_is_the_policy_with_adapters_disabled(tmp_path, smoke_world):
    policy, _, ref, result, logs, _ = run(smoke_world, tmp_path / "lora", steps=2)
    assert ref is not None  # (full fine-tuning run above for contrast)
    lora_policy, _, lora_ref, lora_result, lora_logs, _ = run(smoke_world, tmp_path / "lora2", steps=2, lora=True)
    assert lora_ref is None
    frozen = {n: p for n, p in lora_policy.named_parameters() if not p.requires_grad}
    base = load_causal_lm(str(smoke_world.base_model))
    base_params = dict(base.named_parameters())
    for name, param in frozen.items():
        plain = name.replace("base_model.model.", "").replace(".base_layer", "")
        if plain in base_params:
            assert torch.equal(param, base_params[plain]), f"frozen {name} changed"
    assert (lora_result.checkpoint / "policy" / "adapter" / "adapter_config.json").is_file()
    assert lora_logs[0][1]["objective/kl"] == pytest.approx(0.0, abs=1e-4)  # adapters start as identity


def one_epoch_steps(world, models: tuple, out, **rl):
    """The input of a short, silent PPO run of `models` (setup's) with one PPO epoch per step."""
    tok, policy, ref, value, reward = models
    return rl_inputs(
        policy,
        tok,
        prompts_of(world),
        out,
        value=value,
        reference=ref,
        reward_model=reward,
        rl=RLConfig(**{**RL, **rl}),
        ppo=PPOConfig(num_ppo_epochs=1),
        run=RunConfig(device="cpu", seed=5),
        max_prompt_length=12,
        show_progress=False,
    )


def test_a_non_finite_loss_skips_the_step_and_never_corrupts_a_checkpoint(tmp_path, smoke_world, monkeypatch):
    import rlhf_core.rl.ppo as ppo_module

    models = setup(smoke_world)
    finite_loss = ppo_module.policy_loss

    def inf_loss(*args, **kwargs):  # a forced inf in every policy loss: the gradient norm is not finite
        loss, stats = finite_loss(*args, **kwargs)
        return loss * float("inf"), stats

    monkeypatch.setattr(ppo_module, "policy_loss", inf_loss)
    result = train_ppo(one_epoch_steps(smoke_world, models, tmp_path / "nan", total_steps=2))
    assert result.skipped_steps == 2 and result.metrics["perf/skipped_steps"] == 2.0
    weights = load_file(str(result.checkpoint / "policy" / "model.safetensors"))
    assert all(t.isfinite().all() for t in weights.values())
    # max_nonfinite_steps_in_a_row 0 (what DeepSpeed needs): the run stops at the first such step, saving nothing
    with pytest.raises(
        FloatingPointError, match=r"gradient norm was (inf|nan) in 1 optimizer step\(s\) in a row \(step 1\)"
    ):
        train_ppo(
            one_epoch_steps(smoke_world, models, tmp_path / "stop", total_steps=2, max_nonfinite_steps_in_a_row=0)
        )
    assert not list((tmp_path / "stop").glob("checkpoint-*"))


def test_a_non_finite_reward_model_score_stops_the_step_naming_the_sample(tmp_path, smoke_world):
    from rlhf_core.rewards.functions import RewardFunctionError

    models = setup(smoke_world)
    with torch.no_grad():
        models[4].score.bias.fill_(float("nan"))  # the reward model
    with pytest.raises(RewardFunctionError, match="the reward model returned nan for completion 0"):
        train_ppo(one_epoch_steps(smoke_world, models, tmp_path / "nan", total_steps=1))


def test_empty_prompt_set_is_refused(tmp_path, smoke_world):
    tok, policy, ref, value, reward = setup(smoke_world)
    with pytest.raises(ValueError, match="prompt set is empty"):
        train_ppo(
            rl_inputs(
                policy,
                tok,
                [],
                tmp_path / "x",
                value=value,
                reference=ref,
                reward_model=reward,
                rl=RLConfig(total_steps=1, **RL),
                ppo=PPOConfig(),
                run=RunConfig(device="cpu"),
                max_prompt_length=12,
                show_progress=False,
            )
        )


@pytest.mark.slow
def test_reward_rises_on_an_easy_reward(tmp_path, smoke_world):
    # from a random tiny Llama, about half of the 8 sampled tokens are "high" ids; PPO should push it up
    _, _, _, _, logs, _ = run(
        smoke_world,
        tmp_path / "learn",
        steps=24,
        batch_size=32,
        response_length=8,
        learning_rate=1e-2,
        lr_scheduler="constant",
        save_steps=100,
        ppo=PPOConfig(num_ppo_epochs=4, kl_coef=0.01),
    )
    scores = [m["objective/scores"] for _, m in logs]
    first, last = sum(scores[:4]) / 4, sum(scores[-4:]) / 4
    assert last > first + 1.5, f"scores did not rise: {scores}"


def test_epochs_stop_early_once_the_approximate_kl_passes_its_limit(tmp_path, smoke_world):
    fast = dict(steps=3, learning_rate=3e-2, lr_scheduler="constant", save_steps=100)
    # one mini-batch: the first epoch is on-policy (approximate KL 0) and its update moves the policy far,
    # which the second epoch measures: every step stops after it
    *_, stopped, _ = run(
        smoke_world, tmp_path / "stop", ppo=PPOConfig(num_ppo_epochs=4, early_stop_approx_kl=1e-6), **fast
    )
    assert [m["policy/ppo_epochs"] for _, m in stopped] == [2.0, 2.0, 2.0]
    *_, unlimited, _ = run(smoke_world, tmp_path / "all", ppo=PPOConfig(num_ppo_epochs=4), **fast)
    assert [m["policy/ppo_epochs"] for _, m in unlimited] == [4.0, 4.0, 4.0]
    assert all(m["policy/approxkl_avg"] > 1e-6 for _, m in unlimited)
    *_, loose, _ = run(
        smoke_world, tmp_path / "loose", ppo=PPOConfig(num_ppo_epochs=4, early_stop_approx_kl=1e6), **fast
    )
    assert [m["policy/ppo_epochs"] for _, m in loose] == [4.0, 4.0, 4.0]
    assert loose[-1][1]["objective/kl"] == pytest.approx(
        unlimited[-1][1]["objective/kl"]
    )  # a limit never hit changes nothing


@pytest.mark.parametrize("disable", [True, False])
def test_ppo_ratio_is_one_on_policy_only_with_dropout_off(tmp_path, smoke_world, disable):
    tok, _, _, value, reward = setup(smoke_world)
    logs = []
    train_ppo(
        rl_inputs(
            dropout_policy(smoke_world),
            tok,
            prompts_of(smoke_world),
            tmp_path / str(disable),
            value=value,
            reference=None,
            reward_model=reward,
            rl=RLConfig(total_steps=1, disable_dropout=disable, **RL),
            ppo=PPOConfig(num_ppo_epochs=1),
            run=RunConfig(device="cpu", seed=5),
            max_prompt_length=12,
            on_log=lambda m, s: logs.append(m),
            show_progress=False,
        )
    )
    # one epoch, one mini-batch: the update's log-probabilities are the rollout's own, unless dropout differs
    if disable:
        assert logs[0]["val/ratio"] == pytest.approx(1.0, abs=1e-5) and logs[0]["policy/approxkl_avg"] < 1e-9
    else:
        assert abs(logs[0]["val/ratio"] - 1.0) > 1e-3


def test_policy_loss_by_hand():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    adv = torch.tensor([[1.0, -1.0]])
    loss, stats = policy_loss(new, old, adv, torch.ones(1, 2), cliprange=0.2)
    # token 1: max(-1.5, -1.2) = -1.2 (clipped); token 2: max(0.5, 0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert stats["clipfrac"].item() == 1.0
    assert stats["approxkl"].item() == pytest.approx(0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 2)
    # a masked token does not count
    loss_masked, _ = policy_loss(new, old, adv, torch.tensor([[1, 0]]), cliprange=0.2)
    assert loss_masked.item() == pytest.approx(-1.2)


def test_value_loss_by_hand():
    vpred, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 0.5]])
    loss, stats = value_loss(vpred, old, ret, torch.ones(1, 2), cliprange_value=0.2)
    # token 1: max((1-2)^2, (0.2-2)^2) = 3.24; token 2: max(0.25, 0.25) = 0.25
    assert loss.item() == pytest.approx(0.5 * (3.24 + 0.25) / 2)
    assert stats["clipfrac"].item() == 0.5


def test_adaptive_kl_controller_update():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=100)  # error clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=5.4, n_steps=1000)  # error -0.1
    assert ctl.value == pytest.approx(0.1 * (1 - 0.1 * 0.1))
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 64)
    assert fixed.value == 0.05


def test_the_engine_correction_weighs_each_tokens_policy_term():
    # ratio 1: each token's term is -A; weights 2 and 0.5 (and a padded token weighted 9 that the mask drops)
    logp = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = policy_loss(logp, logp, torch.ones(1, 3), mask, 0.2, is_weights=torch.tensor([[2.0, 0.5, 9.0]]))
    assert loss.item() == pytest.approx(-1.25) and stats["ratio"].item() == 1.0
    sequence, _ = policy_loss(logp, logp, torch.ones(1, 3), mask, 0.2, is_weights=torch.tensor([[3.0]]))
    assert sequence.item() == pytest.approx(-3.0)


def test_ppos_gradients_are_the_same_whatever_the_micro_batch_plan(tmp_path, smoke_world, monkeypatch):
    # four micro-batches by rows against one: tests/distributed/test_equivalence.py
    plans = {"one": {}, "tokens": dict(max_tokens_per_micro_batch=30)}
    seen = {}
    for name, rl in plans.items():
        train = lambda name=name, rl=rl: run(  # noqa: E731
            smoke_world, tmp_path / name, steps=1, ppo=PPOConfig(num_ppo_epochs=1, num_mini_batches=1), **rl
        )
        seen[name] = first_step_gradients(monkeypatch, train)
    assert seen["one"][1] == [1] and seen["tokens"][1][0] > 1
    for param, grad in seen["one"][0].items():
        torch.testing.assert_close(seen["tokens"][0][param], grad, atol=1e-6, rtol=1e-4, msg=param)
