"""Parity of our REINFORCE++ / RLOO advantage math with verl 0.9.1's own functions.

What is compared, on the same float32 CPU tensors (tests/parity/verl_common.py builds them): batches of 3
prompts x 4 responses and 4 prompts x 3 responses, right-padded to 8 tokens with unequal lengths (1 to 8),
beta 0 and beta 0.2 with the k1 and the k3 estimator, one case with scores ~100, and two "lone" cases where
the last prompt keeps a single response.
- the KL in the reward: verl's `ray_trainer.apply_kl_penalty` (`core_algos.kl_penalty(...) * mask`,
  `token_level_scores - beta * kld`, the score on the last real token as verl's reward manager puts it)
  and, for k1, `core_algos.compute_rewards`, against our `kl_per_token(...) * mask` and `kl_penalized_rewards`;
- REINFORCE++ (gamma 1.0 and 0.9): `compute_reinforce_plus_plus_outcome_advantage` against
  `reinforce_pp_advantages(rewards, mask, gamma=)`: advantages and returns. Also with the batch split over two
  simulated data-parallel processes (our `all_reduce`) against verl on the whole batch;
- REINFORCE++-baseline: `compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)`
  against `reinforce_pp_advantages(..., num_generations=, scorable=)`. The advantages agree. The second
  output does not, by design: verl returns its whitened advantages twice (`return scores, scores`), ours
  returns the baseline-subtracted scores before whitening (REINFORCE++ has no critic to use them);
- RLOO: `compute_rloo_outcome_advantage` (verl's scores*n/(n-1) - mean*n/(n-1) = r_i - mean_{j!=i} r_j,
  broadcast over the mask; the KL enters through the token rewards) against `rloo_advantages` with the score
  as one source of weight 1 and kl = the KL summed over each response (TRL 1.16's RLOO), broadcast the same;
- a prompt with one response (verl's index holds its uid once; ours: the rest of its group unscorable, mask
  0): REINFORCE++-baseline agrees (verl's baseline 0, our `group_baseline` keeps the lone score). RLOO does
  not: verl leaves the lone response its whole reward as advantage, ours (as TRL's RLOO) gives it 0.
- the k3 estimator far from the reference: verl clamps it to [-10, 10] (and the log-ratio to [-20, 20]),
  ours does not; they agree wherever the clamps do not act.
Everything else is held to atol 1e-6, plus rtol 1e-5 in the case with scores ~100: the largest difference
seen is ~5e-7, and 1.5e-5 (one float32 ulp at ~100) on the raw returns and RLOO advantages of that case.

verl's side runs in a subprocess (tests/parity/verl_side.py) whose PYTHONPATH starts with .venv/verl-0.9.1,
where `make venv` installs verl 0.9.1 with --no-deps --target, beside the few packages its imports need that
our venv lacks (omegaconf, antlr4, tensordict 0.10, pyvers, codetiming, torchdata): this process never imports
verl, and nothing of verl's meets our venv's packages elsewhere. The subprocess takes torch, numpy, ray and
transformers from our venv; verl 0.9.1 declares transformers 5.5-5.10, and its imports (core_algos and
ray_trainer) work with our 5.23. No import is stubbed. The module is skipped, with the command to run, only
when .venv/verl-0.9.1 is missing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from rlhf_core.rl.advantages.group_baselines import group_baseline, reinforce_pp_advantages
from rlhf_core.rl_math import kl_per_token, masked_whiten
from tests.parity.verl_common import (
    CASES,
    GAMMAS,
    LONE_CASES,
    MISSING,
    VERL_VERSION,
    Case,
    close,
    extreme_logprobs,
    make_inputs,
    our_side,
    run_verl,
    verl_dir,
)

CASE_IDS = [c.name for c in CASES]
KL_CASES = [c for c in CASES if c.beta]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("report_max_diffs"),
]  # verl runs in a process of its own; conftest.py: the largest difference per comparison


@pytest.fixture(scope="module")
def verl(tmp_path_factory):
    """Run verl's side once for every case; -> ({case: {name: tensor}}, meta)."""
    if verl_dir() is None:
        pytest.skip(MISSING)
    start = time.perf_counter()
    try:
        result = run_verl(tmp_path_factory.mktemp("verl"))
    except RuntimeError as error:
        pytest.fail(str(error), pytrace=False)
    print(f"\nverl {VERL_VERSION} side: {len(CASES)} cases in {time.perf_counter() - start:.1f} s")
    return result


def sides(verl, case: Case):
    """(our outputs on verl's rows, verl's outputs, inputs): a lone case's dropped rows are left out of ours."""
    x = make_inputs(case)
    ours = our_side(case, x)
    keep = x["keep"]
    return {k: v[keep] for k, v in ours.items()}, verl[0][case.name], x


def test_oracle_is_verl_091(verl):
    meta = verl[1]
    home = verl_dir()
    assert meta["verl_version"] == "0.9.1"
    assert Path(meta["core_algos_file"]).is_relative_to(home), meta
    assert meta["transformers_version"] == __import__("transformers").__version__  # the venv's, not verl's
    assert not Path(meta["transformers_file"]).is_relative_to(home), meta


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kl_in_reward(verl, case):
    """The token rewards both sides feed their estimators (verl: the scores alone with beta 0)."""
    ours, theirs, x = sides(verl, case)
    close(f"kl {case.estimator}", ours["kl"], theirs["kl"])
    close("token rewards", ours["token_rewards"], theirs["token_rewards"], rtol=case.rtol)
    if case.beta and case.estimator == "k1":
        close("token rewards (compute_rewards)", ours["token_rewards"], theirs["token_rewards_compute_rewards"])
    # the score sits on the last real token on both sides
    last = x["last_index"][x["keep"]]
    scores = theirs["token_level_scores"]
    assert torch.equal(scores[torch.arange(len(last)), last], x["scores"][x["keep"]])
    assert int((scores != 0).sum()) == len(last)


@pytest.mark.parametrize("gamma", GAMMAS, ids=[f"gamma{g}" for g in GAMMAS])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reinforce_pp(verl, case, gamma):
    ours, theirs, _ = sides(verl, case)
    close(f"reinforce++ advantages gamma {gamma}", ours[f"rpp_adv_g{gamma}"], theirs[f"rpp_adv_g{gamma}"])
    close(
        f"reinforce++ returns gamma {gamma}",
        ours[f"rpp_ret_g{gamma}"],
        theirs[f"rpp_ret_g{gamma}"],
        rtol=case.rtol,
    )


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reinforce_pp_baseline(verl, case):
    ours, theirs, x = sides(verl, case)
    close("reinforce++-baseline advantages", ours["rppb_adv"], theirs["rppb_adv"])
    # verl's "returns" are its advantages; ours are the baseline-subtracted scores they are whitened from
    assert torch.equal(theirs["rppb_ret"], theirs["rppb_adv"])
    mask = x["mask"][x["keep"]]
    close("reinforce++-baseline returns, whitened", masked_whiten(ours["rppb_ret"], mask) * mask, theirs["rppb_ret"])


@pytest.mark.parametrize("case", [c for c in CASES if not c.lone], ids=[c.name for c in CASES if not c.lone])
def test_rloo(verl, case):
    ours, theirs, _ = sides(verl, case)
    close("rloo advantages", ours["rloo_adv"], theirs["rloo_adv"], rtol=case.rtol)
    assert torch.equal(theirs["rloo_ret"], theirs["rloo_adv"])


@pytest.mark.parametrize("case", LONE_CASES, ids=[c.name for c in LONE_CASES])
def test_group_of_one_baseline(verl, case):
    """verl: a uid seen once has baseline 0. Ours: group_baseline with one scorable row keeps its score."""
    ours, theirs, x = sides(verl, case)
    keep, mask = x["keep"], x["mask"] * x["keep"].view(-1, 1).long()
    lone = int(keep.nonzero()[-1])  # the last prompt's only response
    sums = our_side(case, x)["token_rewards"].sum(-1)
    baselined = group_baseline(sums.masked_fill(~keep, float("nan")), case.group)
    assert baselined[lone] == sums[lone]
    assert torch.isnan(baselined[~keep]).all()
    whitened = masked_whiten(torch.nan_to_num(baselined).unsqueeze(-1) * mask, mask) * mask
    close("group of one: reinforce++-baseline advantages", whitened[keep], theirs["rppb_adv"])
    close("group of one: reinforce++-baseline advantages", ours["rppb_adv"], theirs["rppb_adv"])


@pytest.mark.parametrize("case", LONE_CASES, ids=[c.name for c in LONE_CASES])
def test_group_of_one_rloo_differs(verl, case):
    """The one difference in RLOO: verl gives a prompt's only response its whole reward as advantage
    (`if response_num > 1` skips the baseline), ours (TRL 1.16's RLOO: no sibling, no estimate) gives it 0."""
    ours, theirs, x = sides(verl, case)
    lone = int(x["keep"].sum()) - 1  # the last row verl sees
    others = torch.arange(lone)
    close("rloo advantages (rows with siblings)", ours["rloo_adv"][others], theirs["rloo_adv"][others])
    mask = x["mask"][x["keep"]][lone]
    reward = theirs["token_rewards"][lone].sum()  # the score minus beta x the KL summed over the response
    close("group of one: verl's rloo advantage = its reward", theirs["rloo_adv"][lone], reward * mask)
    assert reward.abs() > 0.01
    assert torch.equal(ours["rloo_adv"][lone], torch.zeros_like(mask, dtype=ours["rloo_adv"].dtype))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_data_parallel_whitening(verl, case):
    """Two simulated processes, each with whole groups, whiten through `all_reduce` as verl does the whole batch."""
    x = make_inputs(case)
    ours = our_side(case, x)
    keep, theirs = x["keep"], verl[0][case.name]
    mask = x["mask"] * keep.view(-1, 1).long()
    half = (case.groups // 2) * case.group
    parts = [slice(0, half), slice(half, case.rows)]
    barrier, deposits = threading.Barrier(2), [None, None]
    results: dict[tuple[int, str], torch.Tensor] = {}

    def process(rank: int, name: str, **kwargs) -> None:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            deposits[rank] = t
            barrier.wait()
            total = deposits[0] + deposits[1]
            barrier.wait()
            return total

        part = parts[rank]
        rows = dict(scorable=keep[part]) if "num_generations" in kwargs else {}
        results[rank, name] = reinforce_pp_advantages(
            ours["token_rewards"][part], mask[part], all_reduce=all_reduce, **rows, **kwargs
        )[0]

    for name, kwargs in (("rpp", dict(gamma=0.9)), ("rppb", dict(num_generations=case.group))):
        threads = [threading.Thread(target=process, args=(rank, name), kwargs=kwargs) for rank in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert (0, name) in results and (1, name) in results, f"{name}: a simulated process failed"
        joined = torch.cat([results[0, name], results[1, name]])[keep]
        key = "rpp_adv_g0.9" if name == "rpp" else "rppb_adv"
        close(f"{name} advantages, 2 processes", joined, theirs[key])


def test_k3_clamp(verl):
    """verl clamps k3 to [-10, 10] (and the log-ratio to [-20, 20]); ours does not. k1 is never clamped."""
    theirs = verl[0]["extreme"]
    x = extreme_logprobs()
    close("k1 far from the reference", kl_per_token(x["logp"], x["ref"], "k1"), theirs["k1"])
    ours = kl_per_token(x["logp"], x["ref"], "k3")
    inside = ours <= 10
    close("k3 where verl does not clamp", ours[inside], theirs["k3"][inside], rtol=1e-6)
    assert torch.equal(theirs["k3"][~inside], torch.full_like(theirs["k3"][~inside], 10.0))
    # e.g. log pi - log ref = -3: ours e^3 - 4 = 16.09, verl 10
    at = int((x["logp"] - x["ref"]).view(-1).sub(-3).abs().argmin())
    assert abs(ours.view(-1)[at].item() - 16.0855) < 1e-3 and theirs["k3"].view(-1)[at].item() == 10.0
