"""PPO parity with TRL 1.12: KL, per-token rewards, GAE advantages and returns (setup in trl_ppo_common.py).

On TRL's own recorded inputs, our math (`our_math`: kl_per_token -> kl_penalized_rewards -> [masked_whiten
rewards] -> compute_gae -> masked_whiten advantages) gives TRL's tensors exactly when no response stops; when
responses stop early, TRL's tensors are ours with the score moved one position later (the one documented
difference); with pad == eos, TRL drops the stop token from its mask, and its tensors are ours composed its
way one token earlier, while ours keeps the stop token's KL and advantage.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.models.forward import response_logprobs, sequence_scores
from rlhf_core.rl.ppo import score_rollout
from rlhf_core.rollout.collect import Rollout
from tests.parity.trl_ppo_common import (
    ATOL_MODEL,
    BATCH,
    EOS,
    RESPONSE_LENGTH,
    SETTINGS,
    close,
    inputs,
    our_math,
    trl_outputs,
    trl_way,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("report_max_diffs")]  # TRL 1.12 runs in a process of its own


@pytest.mark.parametrize("name", ["full_k1", "full_k3_whiten"])
def test_full_length_responses_match_trl_exactly(world, name):
    """No response stops: rewards, advantages (raw and whitened) and returns are TRL's."""
    _, results = world
    r = results[name]
    _, _, _, mask, last, has_stop = inputs(r)
    assert not has_stop.any() and bool(mask.all()) and bool((last == RESPONSE_LENGTH - 1).all())
    assert torch.equal(r["frame_actual_end"], last)  # TRL's score column: last + 1 is past the end

    ours = our_math(r, r["frame_logprobs"], r["frame_ref_logprobs"], r["frame_values"], r["frame_scores"], mask, last)
    theirs = trl_outputs(r)
    for key in ("kl", "non_score", "raw_rewards", "rewards", "raw_advantages", "advantages", "returns"):
        close(f"{key} [{name}]", ours[key], theirs[key])
    if r["ppo"]["whiten_rewards"]:
        assert not torch.allclose(ours["rewards"], ours["raw_rewards"])  # whitening did something


@pytest.mark.parametrize("name", ["stop_k1", "stop_k3_whiten"])
def test_early_stop_differs_from_trl_only_by_score_placement(world, name):
    """pad != eos, responses that stop early. Documented difference: our score is on the stop token (the last
    real token, `last`), TRL 1.12's on last + 1 (`actual_end`), with TRL's values, reward whitening and GAE
    running to last + 1 too. TRL's rewards, advantages and returns equal ours composed that way."""
    _, results = world
    r = results[name]
    _, _, _, mask, last, has_stop = inputs(r)
    width = mask.shape[1]
    rows = torch.arange(BATCH)
    logprobs, ref_logprobs, values, scores = (
        r["frame_logprobs"],
        r["frame_ref_logprobs"],
        r["frame_values"],
        r["frame_scores"],
    )
    theirs = trl_outputs(r)

    # 1. the KL part is the same: per-token KL on the real tokens, zero after the stop token
    ours = our_math(r, logprobs, ref_logprobs, values, scores, mask, last)
    close(f"kl [{name}]", ours["kl"], theirs["kl"])
    close(f"non_score [{name}]", ours["non_score"], theirs["non_score"])

    # 2. the score goes to last + 1 in TRL, unless that is past the end (stop on the last position or no stop)
    shifted = last + 1 < width
    assert torch.equal(r["frame_actual_end"], torch.where(shifted, last + 1, last))
    assert shifted.tolist() == [s is not None and s < width - 1 for s in r["stops"]]

    # 3. TRL's result == ours with the score moved to last + 1 and the values kept to last + 1
    moved = trl_way(r, logprobs, ref_logprobs, values, scores, mask, last)
    assert torch.equal(moved["mask_p1"].bool(), ~r["frame_padding_mask_p1"])
    for key in ("raw_rewards", "rewards", "raw_advantages", "advantages", "returns"):
        close(f"{key}, score moved to last+1 [{name}]", moved[key], theirs[key])

    # 4. where and how ours differs: the raw rewards only at (row, last) and (row, last + 1), by the score
    delta = theirs["raw_rewards"] - ours["raw_rewards"]
    expected = torch.zeros_like(delta)
    expected[rows[shifted], last[shifted]] = -scores[shifted]
    expected[rows[shifted], last[shifted] + 1] = scores[shifted]
    close(f"raw reward difference = score moved [{name}]", delta, expected)
    # rows where the score lands on the same token (no stop, or a stop on the last position) agree on the
    # raw advantages and the returns, unless the rewards are whitened (batch statistics mix the rows)
    same = ~shifted
    if not r["ppo"]["whiten_rewards"]:
        close(
            f"raw advantages on unshifted rows [{name}]", ours["raw_advantages"][same], theirs["raw_advantages"][same]
        )
        close(f"returns on unshifted rows [{name}]", ours["returns"][same], theirs["returns"][same])
    # on shifted rows: our advantage at the stop token is r_last + score - V_last; TRL's is
    # r_last + gamma * V_{last+1} - V_last + gamma * lam * A_{last+1} with A_{last+1} = score' - V_{last+1}
    # (score' the whitened reward there with whiten_rewards), and TRL's return at last + 1 is that reward,
    # where ours is 0 (past the response)
    p1 = last[shifted] + 1
    close(
        f"TRL return at last+1 == its reward [{name}]",
        theirs["returns"][rows[shifted], p1],
        theirs["rewards"][rows[shifted], p1],
    )
    assert bool((ours["returns"][rows[shifted], p1] == 0).all())
    assert bool((theirs["advantages"][rows[shifted], p1] == 0).all())  # whitened advantages: both masked there
    assert not torch.allclose(ours["advantages"], theirs["advantages"], atol=1e-3)  # the difference is real


@pytest.mark.parametrize("name", ["padeos_k1", "padeos_k3_whiten"])
def test_pad_equals_eos(world, name):
    """pad == eos (GPT-2, Qwen2.5 base). TRL 1.12 truncates at the eos and then finds the end as the first
    pad token - 1; the eos IS a pad token, so for a response that stopped at s:
      - sequence_lengths = s - 1: the eos is outside TRL's mask (padding_mask): its log-probabilities are
        INVALID_LOGPROB, its KL 0, its advantage 0 -> the policy gradient never trains the stop token;
      - get_reward attends to query_responses != pad, so the reward model never sees the eos, and the score is
        its output at the token before the eos (and a stop at s = 0 would give sequence_lengths = -1: a score
        read at the last prompt token);
      - the score is added at s (= sequence_lengths + 1), on the eos position, where TRL's KL is 0, and the
        values are kept to s (the value of the state before the eos, the same as ours);
      - contain_eos_token is still right (eos in the response).
    Ours: the response ends at its first eos, which is part of it (mask, KL, score on it, has_stop True).
    So TRL here == our pieces composed TRL's way with `last` = s - 1 (as for pad != eos, one token earlier)."""
    models, results = world
    r = results[name]
    queries, query_mask, responses, mask, last, has_stop = inputs(r)
    rows = torch.arange(BATCH)
    stopped = torch.tensor([s is not None for s in r["stops"]])

    # ours keeps the stop token
    assert torch.equal(has_stop, stopped)
    assert bool((responses[rows[stopped], last[stopped]] == EOS).all())
    assert bool((mask[rows[stopped], last[stopped]] == 1).all()), "our mask keeps the stop token"
    assert torch.equal(mask.sum(1), last + 1)
    # TRL's drops it
    trl_last = r["frame_sequence_lengths"]
    assert torch.equal(trl_last, torch.where(stopped, last - 1, last))
    trl_mask = (~r["frame_padding_mask"]).long()
    assert bool((trl_mask[rows[stopped], last[stopped]] == 0).all()), "TRL 1.12's mask drops the eos when pad == eos"
    assert torch.equal(r["frame_contain_eos_token"], has_stop)
    assert torch.equal(r["frame_actual_end"], last)  # TRL's score column: the eos position (s - 1 + 1)
    # ...but the reward model is read one token earlier, at the token before the eos
    assert torch.equal(r["reward_index"] - int(r["context_length"]), trl_last)

    # TRL's score: the reward model at the token before the eos, not attending the eos
    penalty = r["ppo"]["missing_eos_penalty"] or 0.0
    trl_scores_model = sequence_scores(models["reward"], queries, query_mask, responses, trl_mask, trl_last)
    close(
        f"TRL score = reward at last-1 (model) [{name}]",
        trl_scores_model - penalty * (~has_stop).float(),
        r["frame_scores"],
        ATOL_MODEL,
    )
    ours_scores, ours_values = score_rollout(
        Rollout(queries, query_mask, responses, mask, last, None, None, has_stop),
        models["value"],
        models["reward"],
        missing_eos_penalty=r["ppo"]["missing_eos_penalty"],
    )
    close(f"scores of unstopped rows (model) [{name}]", ours_scores[~stopped], r["frame_scores"][~stopped], ATOL_MODEL)
    assert not torch.allclose(ours_scores[stopped], r["frame_scores"][stopped], atol=1e-3)
    # TRL's values are kept to sequence_lengths + 1 = s: exactly our values, on our mask
    close(f"values (model) [{name}]", ours_values, r["frame_values"], ATOL_MODEL)

    # TRL's rewards, advantages and returns == ours composed TRL's way with last = s - 1
    logprobs, ref_logprobs, values, scores = (
        r["frame_logprobs"],
        r["frame_ref_logprobs"],
        r["frame_values"],
        r["frame_scores"],
    )
    theirs = trl_outputs(r)
    moved = trl_way(r, logprobs, ref_logprobs, values, scores, trl_mask, trl_last)
    for key in ("raw_rewards", "rewards", "raw_advantages", "advantages", "returns"):
        close(f"{key}, TRL way with last=s-1 [{name}]", moved[key], theirs[key])
    assert bool((theirs["kl"][rows[stopped], last[stopped]] == 0).all())  # the eos carries no KL in TRL
    assert bool((theirs["advantages"][rows[stopped], last[stopped]] == 0).all())  # nor an advantage

    # ours on the same log-probabilities: the eos has a KL term and an advantage (INVALID_LOGPROB is only on
    # TRL's padding, so ours takes the real log-probabilities of the eos, from our response_logprobs)
    temperature = SETTINGS["temperature"] + 1e-7
    our_lp, _ = response_logprobs(models["policy"], queries, query_mask, responses, mask, temperature=temperature)
    our_ref, _ = response_logprobs(models["ref"], queries, query_mask, responses, mask, temperature=temperature)
    close(f"logprobs on TRL's mask (model) [{name}]", our_lp * trl_mask, logprobs * trl_mask, ATOL_MODEL)
    close(f"ref_logprobs on TRL's mask (model) [{name}]", our_ref * trl_mask, ref_logprobs * trl_mask, ATOL_MODEL)
    ours = our_math(r, our_lp, our_ref, ours_values, ours_scores, mask, last)
    assert bool((ours["kl"][rows[stopped], last[stopped]] != 0).all())
    assert bool((ours["advantages"][rows[stopped], last[stopped]] != 0).all())
