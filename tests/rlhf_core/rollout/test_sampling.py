"""Top-k and top-p filtering and the one-token sampler."""

import torch

from rlhf_core.rollout.sampling import SamplingSettings, filter_logits, sample_next


def test_filtering_and_sampling():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [[True, False, False, True]]
    # softmax of [3, 2, 1, 0] is [0.64, 0.24, 0.09, 0.03]: top_p 0.7 keeps the two tokens that reach it
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.7)).tolist() == [[True, False, False, True]]
    torch.manual_seed(0)
    draws = torch.stack(
        [sample_next(logits.expand(4000, 4), SamplingSettings(response_length=1)) for _ in range(5)]
    ).flatten()
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.02, rtol=0)
    assert sample_next(logits, SamplingSettings(response_length=1, greedy=True)).item() == 1
    # filtered tokens are never drawn, even with a uniform draw at the very end of the mass
    top2 = torch.stack(
        [sample_next(logits.expand(2000, 4), SamplingSettings(response_length=1, top_k=2)) for _ in range(3)]
    )
    assert set(top2.flatten().tolist()) == {1, 2}
