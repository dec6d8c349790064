import math

import pytest
import torch

from rlhf_core.rl_math import (
    entropy_from_logits,
    exact_kl_per_token,
    first_true_indices,
    kl_per_token,
    masked_mean,
    masked_whiten,
    response_mask,
    selective_log_softmax,
)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_per_token(logp, ref, "k1").item() == pytest.approx(math.log(2))
    # r = ref/pi = 0.5: k3 = (0.5 - 1) - log 0.5
    assert kl_per_token(logp, ref, "k3").item() == pytest.approx(-0.5 + math.log(2))
    assert kl_per_token(ref, logp, "k3").item() >= 0


def test_response_masks_end_at_the_first_stop_token_which_they_keep():
    cut = torch.tensor([[5, 9, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0]])  # pad 0 after the stop token 9
    mask, last, has_stop = response_mask(cut, [9])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert last.tolist() == [1, 3, 0] and has_stop.tolist() == [True, False, True]
    # pad == eos (Qwen2.5 base, GPT-2): the stop token is still the response's last token
    same = torch.tensor([[5, 0, 0, 0], [5, 6, 7, 8]])
    mask, last, has_stop = response_mask(same, [0])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]] and has_stop.tolist() == [True, False]
    # two stop ids (instruct models): whichever comes first ends the response; a generated pad (3) is a real token
    two = torch.tensor([[3, 7, 8, 8], [8, 2, 2, 2], [3, 3, 3, 3]])
    mask, last, has_stop = response_mask(two, [7, 8])
    assert last.tolist() == [1, 0, 3] and has_stop.tolist() == [True, True, False]
    # no stop token at all: every response is full length
    mask, last, has_stop = response_mask(two, [])
    assert mask.all() and not has_stop.any()
    assert first_true_indices(torch.tensor([[False, False], [False, True]])).tolist() == [2, 1]


def test_masked_statistics_ignore_padding():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert masked_mean(x, mask).item() == 2.0
    w = masked_whiten(x, mask)
    assert masked_mean(w, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert w[0, 1].item() == pytest.approx(-w[0, 0].item(), rel=1e-5)


def test_log_softmax_and_entropy_helpers():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    index = torch.randint(0, 5, (2, 3))
    expected = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, index), expected)
    uniform = torch.zeros(1, 1, 4)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(4))
    # the lse form equals -sum p log p, with or without a precomputed logsumexp, also for peaked rows
    peaked = logits * 30
    direct = -(torch.softmax(peaked, -1) * torch.log_softmax(peaked, -1)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(peaked), direct, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(entropy_from_logits(peaked, torch.logsumexp(peaked, -1)), direct, atol=1e-5, rtol=1e-4)


def test_discounted_returns_match_the_plain_loop():
    from rlhf_core.rl_math import discounted_returns

    rewards = torch.tensor([[1.0, 0.0, 2.0, 9.0], [0.5, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # row 1: 1 + 0.5 * (0 + 0.5 * 2) = 1.5, 0 + 0.5 * 2 = 1, 2 (the 9 is padding); row 2: 0.5 - 0.5, -1
    torch.testing.assert_close(
        discounted_returns(rewards, mask, 0.5), torch.tensor([[1.5, 1.0, 2.0, 0.0], [0.0, -1.0, 0.0, 0.0]])
    )


def test_exact_kl_matches_a_loop_torch_kl_div_and_is_chunk_free():
    torch.manual_seed(0)
    logits, ref_logits = torch.randn(3, 5, 7) * 2, torch.randn(3, 5, 7)
    exact = exact_kl_per_token(logits, ref_logits)
    p, q = torch.softmax(logits, -1), torch.softmax(ref_logits, -1)
    for b in range(3):
        for t in range(5):
            by_hand = sum(float(p[b, t, v] * math.log(p[b, t, v] / q[b, t, v])) for v in range(7))
            assert exact[b, t].item() == pytest.approx(by_hand, rel=1e-5)
    anchor = torch.nn.functional.kl_div(
        torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1), log_target=True, reduction="none"
    ).sum(-1)
    torch.testing.assert_close(exact, anchor)
    torch.testing.assert_close(exact_kl_per_token(logits, ref_logits, chunk=2), exact)
    assert exact_kl_per_token(logits, logits).abs().max() < 1e-6 and (exact >= 0).all()
