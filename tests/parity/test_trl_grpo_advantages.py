"""GRPO parity with TRL 1.16: advantages (helpers in tests/parity/trl_grpo_common.py).

TRL's real `_generate_and_score_completions`, with only generation and reward calling replaced, against
`grpo_advantages` on the same per-source rewards (unscorable rows, partly-None groups, groups with one
scorable row or zero std, several weighted functions; atol 1e-6, rtol 1e-5); `nanstd` against TRL's; and the
completion mask of truncated completions against our loop's `resp_mask * has_stop`.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.rl.advantages.group_baselines import grpo_advantages, nanstd
from rlhf_core.rl_math import response_mask
from tests.parity.trl_grpo_common import EOS, NAN, TOL, drive_trl_scoring, fake_completions


def scenario_groups() -> torch.Tensor:
    """(20, 3), groups of 4: full, partly None with an unscorable row, one scorable row, all unscorable, zero std."""
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
            [NAN, NAN, NAN],  # a single scorable row: std NaN
            [NAN, NAN, NAN],
            [NAN, NAN, NAN],
            [NAN, NAN, NAN],
            [NAN, NAN, NAN],  # a whole unscorable group
            [1.0, 1.0, 1.0],
            [1.0, 1.0, 1.0],
            [1.0, 1.0, 1.0],
            [1.0, 1.0, NAN],  # one source None in the last row (the sums differ: not zero std)
        ]
    )


def scenario_random() -> torch.Tensor:
    """(24, 2) seeded rewards, about a third None, plus two unscorable rows."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 2, generator=g) * 3.0
    x[torch.rand(24, 2, generator=g) < 0.35] = NAN
    x[[5, 17]] = NAN
    return x


SCENARIOS = {
    "groups": (scenario_groups, [1.0, 0.5, -2.0]),
    "groups_unit": (scenario_groups, [1.0, 1.0, 1.0]),
    "random": (scenario_random, [0.7, 1.3]),
}


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_advantages_match_trl_generate_and_score(make_trainer, scenario, scale_rewards, aggregation):
    """`grpo_advantages` == the `advantages` output of TRL's `_generate_and_score_completions` on the
    same rewards per function (NaN = None): unscorable rows, partly-None groups, groups with one
    scorable row or zero std, several weighted functions. Tolerance atol 1e-6, rtol 1e-5."""
    make, weights = SCENARIOS[scenario]
    per_source = make()
    names = [f"r{i}" for i in range(per_source.shape[1])]
    trainer = make_trainer(
        reward_names=names, reward_weights=weights, scale_rewards=scale_rewards, multi_objective_aggregation=aggregation
    )
    trl_out = drive_trl_scoring(trainer, per_source)

    ours = grpo_advantages(
        per_source, torch.tensor(weights), trainer.num_generations, scale_rewards=scale_rewards, aggregation=aggregation
    )
    torch.testing.assert_close(ours.advantages, trl_out["advantages"], **TOL)
    unscorable = torch.isnan(per_source).all(dim=1)
    assert torch.equal(ours.unscorable, unscorable) and unscorable.any()
    assert torch.all(ours.advantages[unscorable] == 0) and torch.all(trl_out["advantages"][unscorable] == 0)
    assert ours.advantages.abs().max() > 0.1  # not a trivially zero comparison
    # what TRL logs as frac_reward_zero_std comes from the same std we return
    assert trainer._metrics["train"]["frac_reward_zero_std"][-1] == pytest.approx(
        torch.isclose(ours.std, torch.zeros_like(ours.std)).float().mean().item()
    )


def test_nanstd_matches_trl():
    """`rlhf_core.rl.grpo.nanstd` == `trl.trainer.utils.nanstd` (whole tensor, per dim, keepdim; rows with 0/1 values)."""
    from trl.trainer.utils import nanstd as trl_nanstd

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 3, generator=g)
    x[torch.rand(6, 4, 3, generator=g) < 0.4] = NAN
    x[0, :, 0] = NAN
    x[1, 1:, 1] = NAN  # one value left
    for dim, keepdim in [(None, False), (1, False), (1, True), (0, True)]:
        kwargs = {} if dim is None else {"dim": dim, "keepdim": keepdim}
        torch.testing.assert_close(nanstd(x, **kwargs), trl_nanstd(x, **kwargs), equal_nan=True, **TOL)


def test_truncated_completion_mask_matches_trl(make_trainer):
    """mask_truncated_completions: TRL's `completion_mask` (padded, truncated rows zeroed) == our loop's
    `resp_mask * has_stop` from `response_mask` on the same right-padded completions (exact)."""
    trainer = make_trainer(mask_truncated_completions=True)
    completions = fake_completions(8, truncated_every=3)
    out = drive_trl_scoring(trainer, torch.arange(8.0).view(8, 1), completions)
    resp_mask, _, has_stop = response_mask(out["completion_ids"], (EOS,))
    assert (~has_stop).sum() == 3
    assert torch.equal(out["completion_mask"].long(), (resp_mask * has_stop.unsqueeze(1)).long())
    assert out["num_items_in_batch"].item() == (resp_mask * has_stop.unsqueeze(1)).sum().item()  # dapo's token count
    trainer.mask_truncated_completions = False
    out = drive_trl_scoring(trainer, torch.arange(8.0).view(8, 1), completions)
    assert torch.equal(out["completion_mask"].long(), resp_mask.long())
    assert out["num_items_in_batch"].item() == resp_mask.sum().item()
