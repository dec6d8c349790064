"""RLOO parity with TRL 1.16's `RLOOTrainer` (helpers in tests/parity/trl_rloo_common.py).

Every expected value comes out of a real `trl.RLOOTrainer` built offline (`make_rloo_trainer`,
tests/parity/conftest.py) around a tiny seeded Llama; our side gets the very same tensors. Of TRL, only
generation (`_generate`: fixed completions) and reward calling (`_calculate_rewards`: fixed rewards per
function, NaN for None) are replaced; with beta > 0, TRL loads its own reference model (the untrained policy)
from a local directory and computes its own old and reference log-probabilities.

- Advantages: the `advantages` output of TRL's `_generate_and_score_completions` against `rloo_advantages`
  (the k1 KL summed over each completion from our `response_logprobs` of TRL's policy and reference, checked
  against TRL's `_get_per_token_logps_and_entropies`), on unscorable rows, partly-None groups, a group with one
  scorable row, zero-std groups, several weighted functions, unequal (and truncated) completion lengths; beta 0
  and > 0, reward_clip_range set and not, normalize_advantages on and off. TRL's logged reward, reward_std,
  frac_reward_zero_std, kl and rewards/<f>/mean|std against what our metrics phase computes from them; and our
  advantages phase (`leave_one_out_estimate`, mask_truncated_completions too) against TRL.
- Loss: `trainer._compute_loss(model, inputs)` (TRL's fused, temperature-scaled log-probability head) against
  `rloo_sequence_loss(response_logprobs(...))`: the loss value, the gradient of every model parameter, the logged
  clip ratios and entropy; with old log-probabilities whose sequence ratios put rows in every clipping case,
  epsilon_high set and not, on-policy, and one step end to end from TRL's own scoring output.

Tolerance: atol 1e-6, rtol 1e-5 (float32, CPU) everywhere, each gradient entry included.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.config import GRPOConfig as OurGRPOConfig
from rlhf_core.models.forward import response_logprobs
from rlhf_core.rl.advantages.estimators import EstimatorContext, leave_one_out_estimate
from rlhf_core.rl.advantages.group_baselines import nanstd, rloo_advantages
from rlhf_core.rl.grpo_losses import rloo_sequence_loss, stat_mean
from rlhf_core.rl_math import kl_per_token, masked_mean, response_mask
from rlhf_core.rollout.collect import Rollout, RolloutBatch
from tests.parity.trl_grpo_common import EOS, MAX_COMPLETION, NAN, PAD, TOL, VOCAB, build_policy, fake_completions
from tests.parity.trl_rloo_common import drive_trl_rloo_scoring

G = 4  # num_generations of make_rloo_trainer
TEMPERATURE = 0.7
CLIP = (-1.0, 1.5)

# ------------------------------------------------------------------------------------------
# advantages: TRL's _generate_and_score_completions against rloo_advantages
# ------------------------------------------------------------------------------------------


def scenario_groups() -> torch.Tensor:
    """(24, 3), groups of 4: every source scored, partly None with an unscorable row, one scorable row,
    all unscorable, zero std, zero std among the scorable rows (one unscorable)."""
    return torch.tensor(
        [
            [1.0, 0.5, 2.0],
            [2.0, -1.0, 0.0],
            [0.5, 0.25, 1.0],
            [3.0, 2.0, -1.0],  # every source scored
            [1.0, NAN, 2.0],
            [NAN, NAN, NAN],
            [NAN, 1.5, NAN],
            [0.0, NAN, 0.5],  # partly None, one unscorable row
            [NAN, NAN, NAN],
            [NAN, 2.0, NAN],
            [NAN, NAN, NAN],
            [NAN, NAN, NAN],  # a single scorable row: baseline 0/0, advantage 0
            [NAN, NAN, NAN],
            [NAN, NAN, NAN],
            [NAN, NAN, NAN],
            [NAN, NAN, NAN],  # a whole unscorable group
            [0.2, 0.2, 0.2],
            [0.2, 0.2, 0.2],
            [0.2, 0.2, 0.2],
            [0.2, 0.2, 0.2],  # zero std
            [0.5, NAN, 0.1],
            [NAN, NAN, NAN],
            [0.5, NAN, 0.1],
            [0.5, NAN, 0.1],  # zero std over the three scorable rows
        ]
    )


def scenario_random() -> torch.Tensor:
    """(24, 2) seeded rewards, about a third None, plus two unscorable rows."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 2, generator=g) * 3.0
    x[torch.rand(24, 2, generator=g) < 0.35] = NAN
    x[[5, 17]] = NAN
    return x


SCENARIOS = {"groups": (scenario_groups, [1.0, 0.5, -2.0]), "random": (scenario_random, [0.7, 1.3])}


def completions_of(batch: int) -> list[list[int]]:
    """Unequal lengths within every group (2..6 tokens with the eos) and some truncated (6 tokens, no eos)."""
    return fake_completions(batch, truncated_every=5)


def our_logprobs(model, out: dict, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logp, _ = response_logprobs(
            model, out["prompt_ids"], out["prompt_mask"], out["completion_ids"], mask, TEMPERATURE
        )
    return logp


def trl_logprobs(trainer, model, out: dict) -> torch.Tensor:
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            model,
            torch.cat([out["prompt_ids"], out["completion_ids"]], 1),
            torch.cat([out["prompt_mask"], out["completion_mask"]], 1),
            out["completion_ids"].shape[1],
        )
    return logp


def policy_and_reference_logprobs(trainer, out: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Our per-token log-probs of TRL's policy and (beta > 0) of TRL's own reference model, each checked against
    TRL's `_get_per_token_logps_and_entropies` on the real tokens; TRL's `old_logps` output == their masked sum."""
    mask = out["completion_mask"]
    real = mask.bool()
    logp = our_logprobs(trainer.model, out, mask)
    torch.testing.assert_close(logp[real], trl_logprobs(trainer, trainer.model, out)[real], **TOL)
    torch.testing.assert_close((logp * mask).sum(1), out["old_logps"], **TOL)
    if trainer.ref_model is None:
        return logp, None
    ref_logp = our_logprobs(trainer.ref_model, out, mask)
    torch.testing.assert_close(ref_logp[real], trl_logprobs(trainer, trainer.ref_model, out)[real], **TOL)
    return logp, ref_logp


def logged(trainer) -> dict[str, float]:
    return {k: v[-1] for k, v in trainer._metrics["train"].items()}


ADVANTAGE_CASES = [
    (scenario, beta, clip, normalize)
    for scenario in SCENARIOS
    for beta in (0.0, 0.5)
    for clip in (None, CLIP)
    for normalize in (False, True)
]


@pytest.mark.parametrize(
    "scenario,beta,clip,normalize",
    ADVANTAGE_CASES,
    ids=[f"{s}-beta{b}-clip{int(c is not None)}-norm{int(n)}" for s, b, c, n in ADVANTAGE_CASES],
)
def test_advantages_and_reward_metrics_match_trl(make_rloo_trainer, scenario, beta, clip, normalize):
    """`rloo_advantages` == the `advantages` output of TRL's `_generate_and_score_completions` on the same
    rewards per function (NaN = None) and, with beta > 0, the k1 KL summed over each completion's mask (from our
    log-probs of TRL's policy and reference, which equal TRL's); TRL's logged reward / reward_std /
    frac_reward_zero_std / kl / rewards/<f>/mean|std == what our metrics phase computes from our rewards, std and
    per-token KL. Tolerance atol 1e-6, rtol 1e-5."""
    make, weights = SCENARIOS[scenario]
    per_source = make()
    names = [f"r{i}" for i in range(per_source.shape[1])]
    trainer = make_rloo_trainer(
        temperature=TEMPERATURE,
        reward_names=names,
        reward_weights=weights,
        beta=beta,
        reward_clip_range=clip,
        normalize_advantages=normalize,
    )
    out = drive_trl_rloo_scoring(trainer, per_source, completions_of(per_source.shape[0]))
    metrics = logged(trainer)
    mask = out["completion_mask"]
    assert len(set(mask.sum(1).tolist())) > 3  # unequal completion lengths

    logp, ref_logp = policy_and_reference_logprobs(trainer, out)
    kl_tokens = kl = None
    if beta:
        kl_tokens = kl_per_token(logp, ref_logp, "k1") * mask
        kl = kl_tokens.sum(-1)
        assert kl.abs().max() > 0.5 and (kl_tokens < 0).any()  # the penalty matters (k1 can be negative)
    ours = rloo_advantages(
        per_source,
        torch.tensor(weights),
        trainer.num_generations,
        kl=kl,
        beta=beta,
        reward_clip_range=clip,
        normalize=normalize,
    )

    torch.testing.assert_close(ours.advantages, out["advantages"], **TOL)
    unscorable = torch.isnan(per_source).all(dim=1)
    assert torch.equal(ours.unscorable, unscorable) and unscorable.any()
    assert torch.all(ours.advantages[unscorable] == 0) and torch.all(out["advantages"][unscorable] == 0)
    assert ours.advantages.abs().max() > 0.1  # not a trivially zero comparison
    if clip is not None:  # the clipping changes some rewards
        assert ((ours.rewards < clip[0]) | (ours.rewards > clip[1])).any()
    if scenario == "groups":  # a group's only scorable row: no baseline, advantage 0 on both sides
        assert ours.advantages[9] == 0 and out["advantages"][9] == 0
        if not beta and not normalize:  # zero-std groups: advantage exactly 0
            assert torch.all(out["advantages"][16:24] == 0) and torch.all(ours.advantages[16:24] == 0)

    # what TRL logs against what our metrics phase computes (GRPOSteps.metrics in rlhf_core/rl/grpo.py)
    torch.testing.assert_close(torch.nanmean(ours.rewards).item(), metrics["reward"], **TOL)
    torch.testing.assert_close(nanstd(ours.rewards).item(), metrics["reward_std"], **TOL)
    frac_zero_std = torch.isclose(ours.std, torch.zeros_like(ours.std)).float().mean().item()
    assert frac_zero_std == pytest.approx(metrics["frac_reward_zero_std"], abs=1e-7)
    if scenario == "groups" and not beta:
        assert metrics["frac_reward_zero_std"] == pytest.approx(2 / 6)  # the two zero-std groups
    for i, name in enumerate(names):
        column = per_source[:, i]
        torch.testing.assert_close(torch.nanmean(column).item(), metrics[f"rewards/{name}/mean"], **TOL)
        torch.testing.assert_close(nanstd(column).item(), metrics[f"rewards/{name}/std"], **TOL)
    if beta:
        torch.testing.assert_close(masked_mean(kl_tokens, mask).item(), metrics["kl"], **TOL)
    else:
        assert "kl" not in metrics


class OneProcess:
    """The collectives of a single process."""

    rank, world = 0, 1

    def gather(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def global_sum(self, value: torch.Tensor) -> torch.Tensor:
        return value


ESTIMATOR_CASES = [(0.5, CLIP, True, False), (0.5, None, False, True), (0.5, CLIP, True, True), (0.0, None, True, True)]


@pytest.mark.parametrize(
    "beta,clip,normalize,mask_truncated",
    ESTIMATOR_CASES,
    ids=[f"beta{b}-clip{int(c is not None)}-norm{int(n)}-masktrunc{int(m)}" for b, c, n, m in ESTIMATOR_CASES],
)
def test_our_advantages_phase_matches_trl(make_rloo_trainer, beta, clip, normalize, mask_truncated):
    """Our advantages phase for rl.algorithm rloo (`leave_one_out_estimate` on a rollout as our loop records it:
    log-probs under the response mask, kl_estimator k1, `trained_mask` with mask_truncated_completions) == TRL's
    advantages, and the reward / kl statistics it hands the metrics phase == TRL's logged ones."""
    per_source, weights = scenario_groups(), [1.0, 0.5, -2.0]
    names = [f"r{i}" for i in range(per_source.shape[1])]
    trainer = make_rloo_trainer(
        temperature=TEMPERATURE,
        reward_names=names,
        reward_weights=weights,
        beta=beta,
        reward_clip_range=clip,
        normalize_advantages=normalize,
        mask_truncated_completions=mask_truncated,
    )
    out = drive_trl_rloo_scoring(trainer, per_source, completions_of(per_source.shape[0]))
    metrics = logged(trainer)

    resp_mask, last_index, has_stop = response_mask(out["completion_ids"], (EOS,))
    assert (~has_stop).any()
    trained = resp_mask * has_stop.unsqueeze(1) if mask_truncated else resp_mask
    assert torch.equal(out["completion_mask"].long(), trained.long())
    logp = our_logprobs(trainer.model, out, resp_mask)  # our rollout: the whole response attended to
    ref_logp = our_logprobs(trainer.ref_model, out, resp_mask) if beta else None
    rollout = Rollout(
        query_ids=out["prompt_ids"],
        query_mask=out["prompt_mask"],
        responses=out["completion_ids"],
        resp_mask=resp_mask,
        last_index=last_index,
        logprobs=logp,
        ref_logprobs=ref_logp,
        has_stop=has_stop,
    )
    config = OurGRPOConfig(
        num_generations=G,
        beta=beta,
        kl_estimator="k1",
        reward_clip_range=list(clip) if clip is not None else None,
        normalize_advantages=normalize,
        mask_truncated_completions=mask_truncated,
    )
    ctx = EstimatorContext(config, OneProcess(), G, torch.tensor(weights))
    estimate = leave_one_out_estimate(RolloutBatch(rollout, per_source), ctx)

    torch.testing.assert_close(estimate.advantages, out["advantages"], **TOL)
    stats = estimate.stats
    torch.testing.assert_close(torch.nanmean(stats["rewards"]).item(), metrics["reward"], **TOL)
    torch.testing.assert_close(nanstd(stats["rewards"]).item(), metrics["reward_std"], **TOL)
    frac_zero_std = torch.isclose(stats["std"], torch.zeros_like(stats["std"])).float().mean().item()
    assert frac_zero_std == pytest.approx(metrics["frac_reward_zero_std"], abs=1e-7)
    if beta:
        torch.testing.assert_close(stats["kl"].item(), metrics["kl"], **TOL)
    else:
        assert "kl" not in stats and "kl" not in metrics


# ------------------------------------------------------------------------------------------
# loss: TRL's _compute_loss against rloo_sequence_loss, value and gradient
# ------------------------------------------------------------------------------------------

B = 8
LENGTHS = [6, 2, 5, 1, 6, 3, 4, 2]
EPSILON = 0.2
# each row's sequence ratio exp(sum logp - sum old_logp) and advantage, one per clipping case
RATIOS = [1.5, 0.6, 1.25, 1.0, 0.95, 1.1, 0.7, 1.4]
ADVANTAGES = [0.8, -1.2, 0.5, 0.0, -0.7, 1.1, 0.9, -0.6]
# 0: r > 1 + eps_high, A > 0: clipped high     1: r < 1 - eps, A < 0: clipped low
# 2: 1.2 < r < 1.28, A > 0: clipped high only with epsilon_high None     3: A = 0
# 4, 5: inside the range     6: r < 1 - eps but A > 0, 7: r > 1 + eps but A < 0: the unclipped term is the min
LOW_CLIPPED = [0, 1, 0, 0, 0, 0, 0, 0]


@pytest.fixture(scope="module")
def batch():
    """Prompts without padding (all length 3, so TRL's default positions equal our mask-derived ones), right-padded
    completions of several lengths, per-sequence advantages of both signs (one 0)."""
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, VOCAB, (B, 3), generator=g)
    mask = (torch.arange(MAX_COMPLETION)[None] < torch.tensor(LENGTHS)[:, None]).long()
    completion_ids = torch.randint(3, VOCAB, (B, MAX_COMPLETION), generator=g).masked_fill(mask == 0, PAD)
    return dict(
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones_like(prompt_ids),
        completion_ids=completion_ids,
        completion_mask=mask,
        advantages=torch.tensor(ADVANTAGES),
        noise=torch.randn(B, MAX_COMPLETION, generator=g),
    )


def old_logprobs(logp: torch.Tensor, mask: torch.Tensor, noise: torch.Tensor, on_policy: bool) -> torch.Tensor:
    """Old per-token log-probs: the current ones plus per-token noise shifted so that each sequence's ratio is
    RATIOS[row] (0 on padding, as TRL); on-policy: the current ones."""
    logp = logp.detach() * mask
    if on_policy:
        return logp
    lengths = mask.sum(1, keepdim=True)
    d = 0.3 * noise * mask
    target = -torch.log(torch.tensor(RATIOS)).unsqueeze(1)  # sum_t (old - logp) = -log r
    d = d + (target - d.sum(1, keepdim=True)) / lengths * mask
    return logp + d


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare_gradients(model, grads_ours, grads_trl) -> None:
    assert grads_ours.keys() == grads_trl.keys() and len(grads_ours) == len(list(model.parameters()))
    for name in grads_trl:
        torch.testing.assert_close(
            grads_ours[name], grads_trl[name], atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert max(g.abs().max() for g in grads_trl.values()) > 1e-2  # gradients are not trivially zero


def trl_loss(trainer, inputs: dict):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(model, dict(inputs))
    loss.backward()
    return loss.detach(), grads(model), logged(trainer)


def our_loss(model, inputs: dict, old_logp: torch.Tensor, temperature: float, epsilon_high: float | None):
    """Our loss as `train_grpo` computes it for rl.algorithm rloo (one micro-batch = the optimizer batch)."""
    model.zero_grad(set_to_none=True)
    mask = inputs["completion_mask"]
    logp, entropy = response_logprobs(
        model,
        inputs["prompt_ids"],
        inputs["prompt_mask"],
        inputs["completion_ids"],
        mask,
        temperature,
        with_entropy=True,
    )
    loss, stats = rloo_sequence_loss(logp, old_logp, inputs["advantages"], mask, EPSILON, epsilon_high)
    loss.backward()
    return loss.detach(), grads(model), stats, entropy


def compare_statistics(metrics: dict, stats: dict, entropy: torch.Tensor, mask: torch.Tensor) -> None:
    """TRL's logged clip ratios and entropy == the loop's reductions of ours (`stat_mean`, `masked_mean`)."""
    low, high = stats["low_clipped"], stats["high_clipped"]
    assert low.shape == high.shape == (mask.shape[0], 1)
    torch.testing.assert_close(stat_mean(low, mask).item(), metrics["clip_ratio/low_mean"], **TOL)
    torch.testing.assert_close(stat_mean(high, mask).item(), metrics["clip_ratio/high_mean"], **TOL)
    torch.testing.assert_close(
        stat_mean(torch.maximum(low, high), mask).item(), metrics["clip_ratio/region_mean"], **TOL
    )
    torch.testing.assert_close(masked_mean(entropy, mask).item(), metrics["entropy"], **TOL)


LOSS_CASES = [(0.7, None, False), (0.7, 0.28, False), (1.0, None, False), (1.0, 0.28, False), (0.7, 0.28, True)]


@pytest.mark.parametrize(
    "temperature,epsilon_high,on_policy",
    LOSS_CASES,
    ids=[f"T{t}-epshigh{e}{'-onpolicy' if o else ''}" for t, e, o in LOSS_CASES],
)
def test_loss_and_gradient_match_trl_compute_loss(make_rloo_trainer, batch, temperature, epsilon_high, on_policy):
    """Loss value and every parameter's gradient of TRL's `_compute_loss` == `rloo_sequence_loss` of our
    `response_logprobs` on the same inputs (TRL gets the old log-probs summed per sequence, as its scoring
    outputs them), and TRL's logged clip_ratio/low_mean, high_mean, region_mean and entropy == the loop's
    reductions of our statistics. Old log-probs put rows in every clipping case (the row with ratio 1.25 is
    clipped only with epsilon_high None); on-policy: ratio 1. Tolerance atol 1e-6, rtol 1e-5."""
    trainer = make_rloo_trainer(
        temperature=temperature, model=build_policy(seed=0), epsilon=EPSILON, epsilon_high=epsilon_high
    )
    model = trainer.model
    mask = batch["completion_mask"]
    inputs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
    with torch.no_grad():
        logp, _ = response_logprobs(
            model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], mask, temperature
        )
    old = old_logprobs(logp, mask, batch["noise"], on_policy)
    ratio = torch.exp((logp * mask).sum(1) - (old * mask).sum(1))
    torch.testing.assert_close(ratio, torch.ones(B) if on_policy else torch.tensor(RATIOS), atol=1e-5, rtol=1e-5)

    loss_trl, grads_trl, metrics = trl_loss(trainer, {**inputs, "old_logps": (old * mask).sum(1)})
    loss_ours, grads_ours, stats, entropy = our_loss(model, inputs, old, temperature, epsilon_high)

    torch.testing.assert_close(loss_ours, loss_trl, **TOL)
    compare_gradients(model, grads_ours, grads_trl)
    compare_statistics(metrics, stats, entropy, mask)
    # the data exercises every case
    low, high = stats["low_clipped"].squeeze(1).tolist(), stats["high_clipped"].squeeze(1).tolist()
    if on_policy:
        assert sum(low) == sum(high) == 0
        torch.testing.assert_close(loss_ours, -batch["advantages"].mean(), **TOL)
    else:
        assert low == LOW_CLIPPED
        assert high == [1, 0, 0 if epsilon_high else 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_one_step_from_trl_scoring_matches(make_rloo_trainer, epsilon_high):
    """End to end: TRL's own scoring output (advantages with beta 0.5, reward_clip_range, old_logps) fed to its
    `_compute_loss` after one perturbation of the policy (so the ratios move off 1) == our advantages
    (`rloo_advantages` on our KL), our old log-probs and `rloo_sequence_loss`: loss, every gradient, clip ratios."""
    per_source, weights = scenario_random(), [0.7, 1.3]
    trainer = make_rloo_trainer(
        temperature=TEMPERATURE,
        reward_names=["r0", "r1"],
        reward_weights=weights,
        beta=0.5,
        reward_clip_range=CLIP,
        epsilon=EPSILON,
        epsilon_high=epsilon_high,
    )
    out = drive_trl_rloo_scoring(trainer, per_source, completions_of(per_source.shape[0]))
    mask = out["completion_mask"]
    logp, ref_logp = policy_and_reference_logprobs(trainer, out)
    kl = (kl_per_token(logp, ref_logp, "k1") * mask).sum(-1)
    ours = rloo_advantages(per_source, torch.tensor(weights), G, kl=kl, beta=0.5, reward_clip_range=CLIP)
    torch.testing.assert_close(ours.advantages, out["advantages"], **TOL)

    # an optimizer step happened since the rollout: the current policy differs from the old one
    model = trainer.model
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.03)
    rows = slice(0, 8)  # one micro-batch of TRL's per_device_train_batch_size rows
    trl_inputs = {k: v[rows] for k, v in out.items() if isinstance(v, torch.Tensor)}
    loss_trl, grads_trl, metrics = trl_loss(trainer, trl_inputs)
    our_inputs = {**trl_inputs, "advantages": ours.advantages[rows]}
    loss_ours, grads_ours, stats, entropy = our_loss(model, our_inputs, logp[rows], TEMPERATURE, epsilon_high)

    torch.testing.assert_close(loss_ours, loss_trl, **TOL)
    compare_gradients(model, grads_ours, grads_trl)
    compare_statistics(metrics, stats, entropy, mask[rows])
    assert not math.isclose(metrics["clip_ratio/region_mean"], 0.0)  # some rows are clipped
