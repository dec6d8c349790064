import math

import pytest
import torch

from rlhf_core.config import GRPOConfig, RLConfig, RunConfig
from rlhf_core.demo.world import world_rows
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rewards.functions import RewardFunctionError
from rlhf_core.rewards.sources import function_reward
from rlhf_core.rl.grpo import mix_into_reference, train_grpo
from rlhf_core.rl.grpo_losses import grpo_token_loss, high_entropy_mask, reduce_loss
from rlhf_core.rl.inputs import rl_inputs
from tests.fixtures.small_models import first_step_gradients


def test_token_loss_clips_asymmetrically():
    old = torch.zeros(2, 1)
    new = torch.log(torch.tensor([[1.5], [0.5]]))
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 1)
    loss, stats = grpo_token_loss(new, old, adv, mask, GRPOConfig(epsilon=0.2, epsilon_high=0.28))
    # row 1: -min(1.5, 1.28) = -1.28 ; row 2: -min(-0.5, -0.8) = 0.8
    torch.testing.assert_close(loss, torch.tensor([[-1.28], [0.8]]))
    assert stats["high_clipped"].tolist() == [[1.0], [0.0]] and stats["low_clipped"].tolist() == [[0.0], [1.0]]
    ref = torch.log(torch.tensor([[1.0], [1.0]]))
    plain_kl = GRPOConfig(epsilon=0.2, epsilon_high=0.28, beta=0.1, use_bias_correction_kl=False)
    with_kl, stats = grpo_token_loss(new, old, adv, mask, plain_kl, ref_logp=ref)
    k3 = torch.expm1(ref - new) - (ref - new)
    torch.testing.assert_close(with_kl, loss + 0.1 * k3)
    # TRL 1.16's default: the KL term times the importance ratio (1.5 and 0.5 here)
    corrected, _ = grpo_token_loss(
        new, old, adv, mask, plain_kl.model_copy(update={"use_bias_correction_kl": True}), ref_logp=ref
    )
    torch.testing.assert_close(corrected, loss + 0.1 * k3 * torch.tensor([[1.5], [0.5]]))


def test_each_loss_type_normalizes_as_its_paper():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert reduce_loss(per_token, mask, "grpo", max_completion_length=3, total_tokens=8).item() == pytest.approx(
        (2.0 + 4.0) / 2
    )
    assert reduce_loss(per_token, mask, "bnpo", max_completion_length=3, total_tokens=8).item() == pytest.approx(10 / 4)
    assert reduce_loss(per_token, mask, "dr_grpo", max_completion_length=3, total_tokens=8).item() == pytest.approx(
        10 / 6
    )
    assert reduce_loss(per_token, mask, "dapo", max_completion_length=3, total_tokens=8).item() == pytest.approx(10 / 8)


def setup(world):
    tok = load_tokenizer(str(world.tokenizer))
    return tok, load_causal_lm(str(world.base_model))


def make_reward(tok):
    """Easy reward: the share of completion words whose id is in the upper half of the vocabulary."""
    cut = len(tok) // 2

    def high_ids(prompts, completions, **_):
        out = []
        for completion in completions:  # conversational prompts: [{"role": "assistant", "content": text}]
            text = completion[0]["content"] if isinstance(completion, list) else completion
            ids = tok(text, add_special_tokens=False)["input_ids"]
            out.append(sum(i >= cut for i in ids) / len(ids) if ids else None)
        return out

    return function_reward("high_ids", 1.0, high_ids)


def prompt_rows(world):

    return world_rows(world, "prompt", "train")


RL = dict(batch_size=16, learning_rate=3e-3, response_length=6, temperature=1.0, save_steps=2, log_steps=1)


def run(world, out, steps=4, on_log=None, grpo=None, rewards=None, **rl):
    tok, policy = setup(world)
    logs, ckpts, completions = [], [], []

    def log(metrics, step):
        logs.append((step, metrics))
        if on_log:
            on_log(metrics, step)

    ref = load_causal_lm(str(world.base_model)) if grpo is not None and grpo.beta else None
    result = train_grpo(
        rl_inputs(
            policy,
            tok,
            prompt_rows(world),
            out,
            reference=ref,
            rewards=rewards or [make_reward(tok)],
            rl=RLConfig(**{"total_steps": steps, "algorithm": "grpo", **RL, **rl}),
            grpo=grpo or GRPOConfig(num_generations=4, log_completions_steps=2),
            run=RunConfig(device="cpu", seed=5),
            max_prompt_length=12,
            on_log=log,
            on_checkpoint=lambda p, s: ckpts.append(s),
            on_completions=lambda rows, s: completions.append((s, rows)),
            show_progress=False,
        )
    )
    return policy, result, logs, ckpts, completions


def test_short_run_changes_parameters_logs_trl_metrics_and_completions(tmp_path, smoke_world):
    _, before = setup(smoke_world)
    policy, result, logs, ckpts, completions = run(smoke_world, tmp_path / "g")
    before_params = dict(before.named_parameters())
    for name, param in policy.named_parameters():
        assert not torch.equal(before_params[name], param), f"{name} did not change"
    names = set(logs[-1][1])
    assert {
        "reward",
        "reward_std",
        "rewards/high_ids/mean",
        "rewards/high_ids/std",
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/clipped_ratio",
        "entropy",
        "clip_ratio/region_mean",
        "perf/step_seconds",
    } <= names
    assert "kl" not in names  # beta 0: no reference at all
    assert {"time/generate_s", "time/reward_s", "time/optimize_s"} <= names and "time/reference_s" not in names
    assert ckpts == [2, 4] and not (result.checkpoint / "value").exists()
    assert [s for s, _ in completions] == [2, 4]
    row = completions[0][1][0]
    assert (
        set(row) == {"step", "prompt", "completion", "advantage", "reward", "high_ids"} and len(completions[0][1]) == 16
    )


def test_beta_uses_a_reference_and_logs_kl(tmp_path, smoke_world):
    tok, policy = setup(smoke_world)
    ref = load_causal_lm(str(smoke_world.base_model))
    logs = []
    train_grpo(
        rl_inputs(
            policy,
            tok,
            prompt_rows(smoke_world),
            tmp_path / "b",
            reference=ref,
            rewards=[make_reward(tok)],
            rl=RLConfig(total_steps=2, algorithm="grpo", **RL),
            grpo=GRPOConfig(num_generations=4, beta=0.04, loss_type="grpo", num_iterations=2),
            run=RunConfig(device="cpu", seed=5),
            max_prompt_length=12,
            on_log=lambda m, s: logs.append(m),
            show_progress=False,
        )
    )
    assert "kl" in logs[-1] and logs[-1]["kl"] >= 0


FAMILY = {  # each group algorithm with the options that make its own code paths run
    "grpo": {},
    "rloo": {"beta": 0.05, "normalize_advantages": True, "reward_clip_range": [0.0, 0.8], "num_iterations": 2},
    "reinforce_plus_plus": {"beta": 0.05, "gamma": 0.9},
    "reinforce_plus_plus_baseline": {"beta": 0.05, "kl_estimator": "k3"},
}


@pytest.mark.parametrize("algorithm", list(FAMILY))
def test_resume_after_a_crash_matches(tmp_path, smoke_world, algorithm):
    grpo = GRPOConfig(num_generations=4, log_completions_steps=2, **FAMILY[algorithm])
    straight, full, _, _, _ = run(smoke_world, tmp_path / "a", algorithm=algorithm, grpo=grpo)

    def crash(metrics, step):
        if step == 3:
            raise RuntimeError("injected crash")

    with pytest.raises(RuntimeError):
        run(smoke_world, tmp_path / "b", on_log=crash, algorithm=algorithm, grpo=grpo)
    resumed, result, logs, ckpts, _ = run(smoke_world, tmp_path / "b", algorithm=algorithm, grpo=grpo)
    assert result.resumed_from == 2 and [s for s, _ in logs] == [3, 4] and ckpts == [4]
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} differs after resume")


@pytest.mark.slow
def test_reward_rises_with_an_easy_callable_reward(tmp_path, smoke_world):
    _, _, logs, _, _ = run(
        smoke_world,
        tmp_path / "learn",
        steps=30,
        batch_size=32,
        response_length=8,
        learning_rate=1e-2,
        lr_scheduler="constant",
        save_steps=100,
        grpo=GRPOConfig(num_generations=8, log_completions_steps=100),
    )
    rewards = [m["reward"] for _, m in logs]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.1, f"reward did not rise: {rewards}"


# --- TRL 1.16's reward handling and GRPO options, pinned by hand ------------------------------------------------


def test_cispo_sapo_delta_and_sequence_level_by_hand():
    old, mask = torch.zeros(2, 1), torch.ones(2, 1)
    adv = torch.tensor([1.0, -1.0])
    # cispo: -sg(min(r, eps_high)) * A * logp; the gradient with respect to logp is -min(r, eps_high) * A
    logp = torch.log(torch.tensor([[1.5], [0.5]])).requires_grad_()
    loss, stats = grpo_token_loss(logp, old, adv, mask, GRPOConfig(loss_type="cispo", epsilon_high=1.2))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.2], [0.5]]))
    assert stats["cispo_clipped"].tolist() == [[1.0], [0.0]]
    # sapo: -(4 / tau) sigmoid(tau (r - 1)) A; on-policy (r = 1) its gradient is the plain policy gradient -A
    logp = torch.zeros(2, 1, requires_grad=True)
    loss, _ = grpo_token_loss(logp, old, adv, mask, GRPOConfig(loss_type="sapo"))
    torch.testing.assert_close(loss.detach(), torch.tensor([[-4 * 0.5 * 1.0], [4 * 0.5 / 1.05]]))  # sigmoid(0) = 0.5
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0], [1.0]]))
    # delta: a negative advantage with r = 3 costs min(r, delta) = 2, not 3
    far = torch.log(torch.tensor([[3.0]]))
    plain, _ = grpo_token_loss(far, old[:1], adv[1:], mask[:1], GRPOConfig())
    capped, _ = grpo_token_loss(far, old[:1], adv[1:], mask[:1], GRPOConfig(delta=2.0))
    assert plain.item() == pytest.approx(3.0) and capped.item() == pytest.approx(2.0)
    # GSPO: one ratio per sequence, exp of the mean log ratio over its real tokens
    logp, old2 = torch.tensor([[0.2, 0.4, 9.0]]), torch.zeros(1, 3)
    seq, _ = grpo_token_loss(
        logp,
        old2,
        torch.tensor([1.0]),
        torch.tensor([[1, 1, 0]]),
        GRPOConfig(importance_sampling_level="sequence", epsilon=0.5),
    )
    assert seq.shape == (1, 1) and seq.item() == pytest.approx(-math.exp(0.3))


def test_high_entropy_mask_keeps_the_top_quantile_of_real_tokens():
    entropies = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # real tokens 0.1 0.3 0.5 0.7 0.9: the 0.6 quantile is 0.58, so the top 40% are 0.7 and 0.9; padding never
    keep = high_entropy_mask(entropies, mask, 0.4)
    assert keep.tolist() == [[False, False, True], [False, True, False]]
    # the mask multiplies the policy term only; the KL term still counts on every token
    logp, ref = torch.zeros(1, 2), torch.tensor([[-0.5, -0.5]])
    per_token, _ = grpo_token_loss(
        logp,
        logp,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        GRPOConfig(beta=0.1),
        ref_logp=ref,
        entropy_mask=torch.tensor([[1.0, 0.0]]),
    )
    k3 = math.exp(-0.5) + 0.5 - 1
    torch.testing.assert_close(per_token, torch.tensor([[-1.0 + 0.1 * k3, 0.1 * k3]]))


def test_reference_sync_mixes_alpha_of_the_policy():
    ref, policy = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with torch.no_grad():
        ref.weight.fill_(1.0), policy.weight.fill_(3.0)
    mix_into_reference(ref, policy, 0.6)
    torch.testing.assert_close(ref.weight, torch.full((1, 2), 0.6 * 3.0 + 0.4 * 1.0))


def test_steps_per_generation_feeds_several_optimizer_steps_from_one_generation(tmp_path, smoke_world, monkeypatch):
    import rlhf_core.rl.grpo as grpo_module
    from rlhf_core.training.loop import TrainingLoop

    rollouts, steps = [], []
    real_score, real_step = grpo_module.score_sampled, TrainingLoop.optimizer_step
    monkeypatch.setattr(
        grpo_module, "score_sampled", lambda *a, **k: rollouts.append(real_score(*a, **k)) or rollouts[-1]
    )
    monkeypatch.setattr(TrainingLoop, "optimizer_step", lambda self: steps.append(self.step) or real_step(self))
    run(
        smoke_world,
        tmp_path / "spg",
        steps=2,
        batch_size=16,
        gradient_accumulation_steps=2,
        grpo=GRPOConfig(num_generations=4, steps_per_generation=4, num_iterations=2),
    )
    # 16 completions per generation (2 optimizer batches of 8), each batch used twice: 4 optimizer steps per generation
    assert [r.responses.shape[0] for r in rollouts] == [16, 16] and steps == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(r.logprobs is not None for r in rollouts)  # off-policy steps need the sampling-time log-probabilities


def test_sync_ref_model_moves_the_reference_and_saves_it(tmp_path, smoke_world):
    tok, policy = setup(smoke_world)
    ref = load_causal_lm(str(smoke_world.base_model))
    result = train_grpo(
        rl_inputs(
            policy,
            tok,
            prompt_rows(smoke_world),
            tmp_path / "sync",
            reference=ref,
            rewards=[make_reward(tok)],
            rl=RLConfig(total_steps=2, algorithm="grpo", **RL),
            grpo=GRPOConfig(
                num_generations=4, beta=0.04, sync_ref_model=True, ref_model_mixup_alpha=1.0, ref_model_sync_steps=1
            ),
            run=RunConfig(device="cpu", seed=5),
            max_prompt_length=12,
            show_progress=False,
        )
    )
    for (name, a), (_, b) in zip(policy.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a, b, msg=f"alpha 1 after every step: the reference is the policy ({name})")
    assert (result.checkpoint / "ref" / "model.safetensors").is_file()  # a resume restores the moved reference


def test_unscorable_completions_are_counted_and_non_finite_rewards_stop_the_step(tmp_path, smoke_world):
    tok, policy = setup(smoke_world)
    logs = []
    every_other = function_reward(
        "every_other",
        1.0,
        lambda prompts, completions, **_: [None if i % 2 else float(len(c)) for i, c in enumerate(completions)],
    )
    train_grpo(bare_run(smoke_world, tok, policy, tmp_path / "none", [every_other], on_log=lambda m, s: logs.append(m)))
    assert logs[0]["rewards/num_unscorable"] == 8.0 and math.isfinite(logs[0]["reward"])
    broken = function_reward(
        "broken", 1.0, lambda prompts, completions, **_: [1.0] * 3 + [float("inf")] + [0.0] * (len(completions) - 4)
    )
    with pytest.raises(RewardFunctionError, match="reward function broken returned inf for completion 3"):
        train_grpo(bare_run(smoke_world, tok, policy, tmp_path / "inf", [broken]))
    assert not list((tmp_path / "inf").glob("checkpoint-*"))


def bare_run(world, tok, policy, out, rewards: list, *, steps: int = 1, **settings):
    """`rewards` alone, no reference, four completions per prompt, `steps` steps: the input of a short GRPO run."""
    return rl_inputs(
        policy,
        tok,
        prompt_rows(world),
        out,
        rewards=rewards,
        rl=RLConfig(total_steps=steps, algorithm="grpo", **{**RL, **settings.pop("rl", {})}),
        grpo=GRPOConfig(num_generations=4),
        run=RunConfig(device="cpu", seed=5),
        max_prompt_length=12,
        show_progress=False,
        **settings,
    )


def test_grpo_subtracts_the_missing_stop_penalty(tmp_path, smoke_world):
    tok, policy = setup(smoke_world)
    logs = []
    zero = function_reward("zero", 1.0, lambda prompts, completions, **_: [0.0] * len(completions))
    on_log = lambda m, s: logs.append(m)  # noqa: E731
    train_grpo(
        bare_run(
            smoke_world, tok, policy, tmp_path / "pen", [zero], steps=2, rl={"missing_eos_penalty": 2.0}, on_log=on_log
        )
    )
    for metrics in logs:
        assert 0 < metrics["completions/clipped_ratio"] <= 1
        assert metrics["reward"] == pytest.approx(-2.0 * metrics["completions/clipped_ratio"])


def test_logged_loss_is_the_optimizer_steps_not_a_micro_batch_share(tmp_path, smoke_world):
    whole, split = [], []
    for accumulation, logs in ((1, whole), (4, split)):
        run(
            smoke_world,
            tmp_path / f"ga{accumulation}",
            steps=1,
            gradient_accumulation_steps=accumulation,
            on_log=lambda m, s, logs=logs: logs.append(m),
            grpo=GRPOConfig(num_generations=4, loss_type="grpo"),
        )
    assert split[0]["loss"] == pytest.approx(whole[0]["loss"], rel=1e-4, abs=1e-6)


def test_gather_tokens_pools_every_processs_values_without_the_padding():
    from types import SimpleNamespace

    from rlhf_core.rl.grpo import gather_tokens

    local = torch.tensor([0.5, 2.0])
    assert gather_tokens(SimpleNamespace(world=1), local) is local  # one process: no collective at all
    other = torch.tensor([1.0])  # the other process's, one value shorter
    accelerator = SimpleNamespace(
        pad_across_processes=lambda x, dim, pad_index: torch.cat([x, torch.full((2 - len(x),), pad_index)]),
        gather=lambda x: torch.cat([x, torch.cat([other, torch.tensor([-1e9])])]),
    )
    pooled = gather_tokens(SimpleNamespace(world=2, accelerator=accelerator), local)
    assert pooled.tolist() == [0.5, 2.0, 1.0]


def test_the_first_sampled_token_is_seven_frames_below_the_trainer(tmp_path, smoke_world, monkeypatch):
    """The path ARCHITECTURE.md's "One RL step" lists, from the trainer down: the loop, the step, the stage's
    sampler, `sample`, the engine, the decode loop."""
    import inspect

    import rlhf_core.rollout.engines as engines
    from rlhf_core.rollout import generation

    seen, real = [], generation.generate

    def generate(*args, **kwargs):
        if not seen:
            names = [f.function for f in inspect.stack()]
            seen.append(names[: names.index("train_grpo") + 1])
        return real(*args, **kwargs)

    monkeypatch.setattr(engines, "generate", generate)
    run(smoke_world, tmp_path / "frames", steps=1)
    assert seen == [["generate", "generate", "sample", "sample", "rl_step", "run", "train_grpo"]]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_steps_gradients_are_the_same_whatever_the_micro_batch_plan(tmp_path, smoke_world, monkeypatch, loss_type):
    plans = {"one": dict(gradient_accumulation_steps=1), "tokens": dict(max_tokens_per_micro_batch=40)}
    if loss_type == "grpo":
        plans["rows"] = dict(gradient_accumulation_steps=4)
    seen = {}
    for name, rl in plans.items():
        train = lambda name=name, rl=rl: run(  # noqa: E731
            smoke_world, tmp_path / name, steps=1, grpo=GRPOConfig(num_generations=4, loss_type=loss_type), **rl
        )
        seen[name] = first_step_gradients(monkeypatch, train)
    assert seen["one"][1] == [1] and seen.get("rows", (None, [4]))[1] == [4]
    assert len(set(seen["tokens"][1])) == 1 and seen["tokens"][1][0] > 4  # 16 completions of up to 18 tokens, 40 each
    for name in set(plans) - {"one"}:
        for param, grad in seen["one"][0].items():
            torch.testing.assert_close(seen[name][0][param], grad, atol=1e-6, rtol=1e-4, msg=f"{name}: {param}")
