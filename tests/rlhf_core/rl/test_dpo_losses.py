"""The DPO loss family by hand (rlhf_core/rl/dpo_losses.py): each loss type's value on two pairs worked out in
the comments, the summed log-probs under the mask, the metrics, reference_free and the sentences of
`check_spec`. Every loss type is pinned against TRL 1.16's own `_compute_loss` in
tests/parity/test_trl_dpo_losses.py."""

import math

import pytest
import torch

from rlhf_core.rl.dpo_losses import (
    LOSS_TYPES,
    PER_PAIR_LOSSES,
    DPOLossSpec,
    check_spec,
    dpo_loss,
    sequence_logps,
)
from rlhf_core.rl_math import INVALID_LOGPROB

P = INVALID_LOGPROB  # what this repo writes on padding
BETA = 0.1


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))  # -log sigmoid(-x)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# B = 2 pairs, rows [chosen_1, chosen_2, rejected_1, rejected_2], R = 3:
#   chosen   [-2.0]              -> -2.0 (1 token)    [-1.0, -0.5, -1.5] -> -3.0 (3 tokens)
#   rejected [-4.0]              -> -4.0 (1 token)    [-0.5, -2.0]       -> -2.5 (2 tokens)
#   reference chosen [-2.5, -2.0], rejected [-3.0, -3.5]
#   log-ratios: chosen [0.5, -1.0], rejected [-1.0, 1.0]; delta = [1.5, -2.0]; beta * delta = [0.15, -0.2]
LOGP = [[-2.0, P, P], [-1.0, -0.5, -1.5], [-4.0, P, P], [-0.5, -2.0, P]]
MASK = [[1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
REF_CHOSEN, REF_REJECTED = [-2.5, -2.0], [-3.0, -3.5]


def loss_of(*loss_types: str, logp=None, **spec) -> torch.Tensor:
    logp = torch.tensor(LOGP) if logp is None else logp
    out = dpo_loss(
        logp,
        torch.tensor(MASK),
        torch.tensor(REF_CHOSEN),
        torch.tensor(REF_REJECTED),
        DPOLossSpec(loss_types=loss_types, beta=spec.pop("beta", BETA), **spec),
    )
    return out.loss


def test_the_family_is_trls_in_trls_order():
    assert LOSS_TYPES[:4] == ("sigmoid", "hinge", "ipo", "exo_pair") and len(LOSS_TYPES) == 15
    assert tuple(PER_PAIR_LOSSES) == LOSS_TYPES


def test_sigmoid():
    # -log sig(0.15) = softplus(-0.15) = 0.620957; -log sig(-0.2) = softplus(0.2) = 0.798139; mean 0.709548
    expected = (softplus(-0.15) + softplus(0.2)) / 2
    assert loss_of("sigmoid").item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.709548, abs=1e-6)


def test_hinge():
    # relu(1 - 0.15) = 0.85, relu(1 + 0.2) = 1.2; mean 1.025; beta 1: relu(1 - 1.5) = 0 and relu(1 + 2) = 3
    assert loss_of("hinge").item() == pytest.approx(1.025, abs=1e-6)
    assert loss_of("hinge", beta=1.0).item() == pytest.approx(1.5, abs=1e-6)


def test_ipo_divides_each_side_by_its_own_token_count():
    # per-token log-ratios: chosen [0.5 / 1, -1.0 / 3], rejected [-1.0 / 1, 1.0 / 2]
    # delta [1.5, -1/3 - 1/2 = -0.833333]; 1 / (2 beta) = 5
    # (1.5 - 5)^2 = 12.25, (-0.833333 - 5)^2 = 34.027778; mean 23.138889 (summed, unnormalised: 30.625)
    expected = ((1.5 - 5) ** 2 + (-1 / 3 - 1 / 2 - 5) ** 2) / 2
    assert loss_of("ipo").item() == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(23.138889, abs=1e-5)


def test_robust_divides_by_one_minus_twice_the_noise():
    # ls 0.1: ((1 - ls) softplus(-x) - ls softplus(x)) / (1 - 2 ls)
    # x = 0.15: (0.9 * 0.620957 - 0.1 * 0.770957) / 0.8 = 0.602207
    # x = -0.2: (0.9 * 0.798139 - 0.1 * 0.598139) / 0.8 = 0.823139; mean 0.712673
    def robust(x: float) -> float:
        return (0.9 * softplus(-x) - 0.1 * softplus(x)) / 0.8

    expected = (robust(0.15) + robust(-0.2)) / 2
    assert loss_of("robust", label_smoothing=0.1).item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.712673, abs=1e-6)
    assert loss_of("robust").item() == pytest.approx(loss_of("sigmoid").item(), abs=1e-7)  # no noise: DPO


def test_sppo_hard():
    # 0.5 / beta = 5; pair 1: (0.5 - 5)^2 + (-1 + 5)^2 = 20.25 + 16 = 36.25; pair 2: (-1 - 5)^2 + (1 + 5)^2 = 72
    assert loss_of("sppo_hard").item() == pytest.approx((36.25 + 72) / 2, rel=1e-6)


def test_apo_zero():
    # pair 1: 1 - sig(0.05) + sig(-0.1) = 1 - 0.512497 + 0.475021 = 0.962524
    # pair 2: 1 - sig(-0.1) + sig(0.1)  = 1 - 0.475021 + 0.524979 = 1.049958; mean 1.006241
    expected = ((1 - sigmoid(0.05) + sigmoid(-0.1)) + (1 - sigmoid(-0.1) + sigmoid(0.1))) / 2
    assert loss_of("apo_zero").item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(1.006241, abs=1e-6)


def test_sft_is_the_mean_over_every_chosen_token_of_the_batch():
    # chosen tokens -2.0 | -1.0 -0.5 -1.5: -(-5.0 / 4) = 1.25 (not the mean of the rows' means, 1.5); rejected
    # rows and the reference play no part
    assert loss_of("sft").item() == pytest.approx(1.25, abs=1e-6)
    logp = torch.tensor(LOGP, requires_grad=True)
    loss_of("sft", logp=logp).backward()
    expected = torch.tensor(MASK[:2] + [[0, 0, 0], [0, 0, 0]]) * -0.25  # d/dlogp of -sum / 4
    torch.testing.assert_close(logp.grad, expected.float())


def test_aot_sorts_over_the_batch():
    # policy chosen - rejected [2.0, -0.5] sorted [-0.5, 2.0]; reference [0.5, 1.5] sorted [0.5, 1.5]
    # delta [-1.0, 0.5], beta * delta [-0.1, 0.05]: softplus(0.1) = 0.744397, softplus(-0.05) = 0.668201
    expected = (softplus(0.1) + softplus(-0.05)) / 2  # 0.706299; unsorted it would be sigmoid's 0.709548
    assert loss_of("aot").item() == pytest.approx(expected, abs=1e-6)
    # aot_unpaired: chosen log-ratios [0.5, -1] sorted [-1, 0.5], rejected [-1, 1]: delta [0, -0.5]
    expected = (softplus(0.0) + softplus(0.05)) / 2
    assert loss_of("aot_unpaired").item() == pytest.approx(expected, abs=1e-6)


def test_sigmoid_norm_divides_each_side_by_its_own_token_count():
    # per-token delta [0.5 / 1 + 1.0 / 1, -1.0 / 3 - 1.0 / 2] = [1.5, -0.833333]; beta * delta [0.15, -0.083333]
    # softplus(-0.15) = 0.620957, softplus(0.083333) = 0.735682; mean 0.678319 (summed: sigmoid's 0.709548)
    expected = (softplus(-0.15) + softplus(0.1 * (1 / 3 + 1 / 2))) / 2
    assert loss_of("sigmoid_norm").item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.678319, abs=1e-6)


def exo(x: float, eps: float = 1e-3) -> float:
    return sigmoid(x) * (-softplus(-x) - math.log1p(-eps)) + sigmoid(-x) * (-softplus(x) - math.log(eps))


def discopop(x: float, tau: float = 0.1) -> float:
    return softplus(-x) * (1 - sigmoid(x / tau)) + math.exp(-x) * sigmoid(x / tau)


# per pair, of x = beta * delta [0.15, -0.2], rc = beta * chosen log-ratio [0.05, -0.1], rr = beta * rejected
# log-ratio [-0.1, 0.1]
PER_PAIR_BY_HAND = {
    # -log sig(rc) - (log sig(-rc) + log sig(-rr)) / 2: [1.349888, 1.438793]
    "nca_pair": ({}, lambda x, rc, rr: softplus(-rc) + 0.5 * softplus(rc) + 0.5 * softplus(rr)),
    # -log sig(rc) - log sig(-rr): [1.312856, 1.488793]
    "bco_pair": ({}, lambda x, rc, rr: softplus(-rc) + softplus(rr)),
    # sig(rc) + 1 - sig(x): [0.975068, 1.024855]
    "apo_down": ({}, lambda x, rc, rr: sigmoid(rc) + 1 - sigmoid(x)),
    # KL([sig(x), sig(-x)] || [1 - eps, eps]), eps 1e-3: [2.505517, 3.110397]
    "exo_pair": ({"label_smoothing": 1e-3}, lambda x, rc, rr: exo(x)),
    # softplus(-x) (1 - sig(x / tau)) + exp(-x) sig(x / tau), tau 0.1: [0.816971, 0.848593]
    "discopop": ({"discopop_tau": 0.1}, lambda x, rc, rr: discopop(x)),
}


@pytest.mark.parametrize("loss_type", PER_PAIR_BY_HAND)
def test_the_other_per_pair_losses(loss_type):
    settings, per_pair = PER_PAIR_BY_HAND[loss_type]
    expected = (per_pair(0.15, 0.05, -0.1) + per_pair(-0.2, -0.1, 0.1)) / 2
    assert loss_of(loss_type, **settings).item() == pytest.approx(expected, abs=1e-6)


def test_a_weighted_combination_is_the_weighted_sum_of_the_means():
    # 0.8 * sigmoid 0.709548 + 0.2 * sft 1.25 = 0.817638
    weighted = loss_of("sigmoid", "sft", loss_weights=(0.8, 0.2)).item()
    assert weighted == pytest.approx(0.8 * (softplus(-0.15) + softplus(0.2)) / 2 + 0.2 * 1.25, abs=1e-6)
    unweighted = loss_of("sigmoid", "sft").item()  # None: 1.0 each
    assert unweighted == pytest.approx(loss_of("sigmoid").item() + 1.25, abs=1e-6)


def test_metrics_are_trls():
    out = dpo_loss(
        torch.tensor(LOGP), torch.tensor(MASK), torch.tensor(REF_CHOSEN), torch.tensor(REF_REJECTED), DPOLossSpec()
    )
    # rewards beta * log-ratios: chosen [0.05, -0.1], rejected [-0.1, 0.1]; chosen > rejected for pair 1 only
    expected = {
        "rewards/chosen": -0.025,
        "rewards/rejected": 0.0,
        "rewards/accuracies": 0.5,
        "rewards/margins": (0.15 - 0.2) / 2,
        "logps/chosen": -2.5,
        "logps/rejected": -3.25,
    }
    assert out.metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert out.metrics[name].dim() == 0 and not out.metrics[name].requires_grad
        assert out.metrics[name].item() == pytest.approx(value, abs=1e-6), name


@pytest.mark.parametrize("pad", [INVALID_LOGPROB, 0.0, -1e30, float("inf"), float("nan")])
def test_sequence_logps_ignore_whatever_the_masked_positions_hold(pad):
    logp = torch.tensor(LOGP).masked_fill(torch.tensor(MASK) == 0, pad).requires_grad_()
    chosen, rejected = sequence_logps(logp, torch.tensor(MASK))
    torch.testing.assert_close(chosen, torch.tensor([-2.0, -3.0]))
    torch.testing.assert_close(rejected, torch.tensor([-4.0, -2.5]))
    (chosen.sum() - 2 * rejected.sum()).backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[1, 0, 0], [1, 1, 1], [-2, 0, 0], [-2, -2, 0]]).float())


def test_sequence_logps_equal_a_loop():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 5, generator=g) * 3
    mask = (torch.rand(6, 5, generator=g) < 0.6).long()
    chosen, rejected = sequence_logps(logp, mask)
    sums = [sum(logp[i, t].item() for t in range(5) if mask[i, t]) for i in range(6)]
    torch.testing.assert_close(torch.cat([chosen, rejected]), torch.tensor(sums))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_reference_free_equals_a_zero_reference(loss_type):
    ls = 0.1 if loss_type in ("exo_pair", "robust", "aot") else 0.0
    spec = DPOLossSpec(loss_types=(loss_type,), label_smoothing=ls)
    free_spec = DPOLossSpec(loss_types=(loss_type,), label_smoothing=ls, reference_free=True)
    logp, mask = torch.tensor(LOGP), torch.tensor(MASK)
    free = dpo_loss(logp, mask, torch.tensor([5.0, -7.0]), torch.tensor([0.3, 2.0]), free_spec)
    zero = dpo_loss(logp, mask, torch.zeros(2), torch.zeros(2), spec)
    referenced = dpo_loss(logp, mask, torch.tensor(REF_CHOSEN), torch.tensor(REF_REJECTED), spec)
    assert free.loss.item() == zero.loss.item()
    assert {k: v.item() for k, v in free.metrics.items()} == {k: v.item() for k, v in zero.metrics.items()}
    if loss_type != "sft":  # the only loss that ignores the reference
        assert referenced.loss.item() != pytest.approx(zero.loss.item(), abs=1e-4)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_is_finite_and_trains_only_real_tokens(loss_type):
    ls = 0.1 if loss_type in ("exo_pair", "robust") else 0.0
    logp = torch.tensor(LOGP, requires_grad=True)
    loss_of(loss_type, logp=logp, label_smoothing=ls).backward()
    assert torch.isfinite(logp.grad).all()
    masked = torch.tensor(MASK) == 0
    assert (logp.grad[masked] == 0).all() and (logp.grad[~masked] != 0).any()


@pytest.mark.parametrize(
    "spec,field",
    [
        (DPOLossSpec(loss_types=("sigmoid", "dpo")), r"dpo\.loss_type 'dpo' is unknown; TRL 1.16's are sigmoid"),
        (DPOLossSpec(loss_types=()), r"dpo\.loss_type must name at least one"),
        (
            DPOLossSpec(loss_types=("sigmoid", "sft"), loss_weights=(1.0,)),
            r"dpo\.loss_weights needs one weight per loss type \(sigmoid, sft\), got 1",
        ),
        (DPOLossSpec(loss_types=("exo_pair",)), r"dpo\.label_smoothing must be above 0 for exo_pair; the EXO"),
        (DPOLossSpec(loss_types=("robust",), label_smoothing=0.5), r"dpo\.label_smoothing must lie in \[0, 0\.5\)"),
        (DPOLossSpec(loss_types=("robust",), label_smoothing=-0.1), r"dpo\.label_smoothing must lie in"),
        (DPOLossSpec(beta=0.0), r"dpo\.beta must be above 0"),
    ],
)
def test_check_spec_names_the_field(spec, field):
    with pytest.raises(ValueError, match=field) as error:
        check_spec(spec)
    assert str(error.value).count(". ") == 0 and str(error.value).endswith(".")  # one sentence
    with pytest.raises(ValueError, match=field):  # dpo_loss checks its spec too
        dpo_loss(torch.tensor(LOGP), torch.tensor(MASK), torch.zeros(2), torch.zeros(2), spec)


def test_check_spec_accepts_trls_settings():
    for spec in (
        DPOLossSpec(),
        DPOLossSpec(loss_types=("exo_pair",), label_smoothing=1e-3),
        DPOLossSpec(loss_types=("robust", "sft"), loss_weights=(0.8, 0.2), label_smoothing=0.0),
        DPOLossSpec(loss_types=LOSS_TYPES, label_smoothing=0.1),
    ):
        check_spec(spec)
