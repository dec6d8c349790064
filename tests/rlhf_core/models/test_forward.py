"""Log-probabilities of responses read through left-padded prompts."""

import torch

from rlhf_core.models.forward import response_logprobs
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.rl_math import response_mask
from rlhf_core.rollout.generation import generate, position_ids_from_mask
from rlhf_core.rollout.sampling import SamplingSettings
from tests.fixtures.small_models import batch


def test_left_padding_does_not_change_log_probabilities(smoke_world):
    tok, ids, mask = batch(smoke_world)
    model = load_causal_lm(str(smoke_world.base_model)).eval()
    responses = generate(
        model,
        ids,
        mask,
        SamplingSettings(response_length=5),
        pad_token_id=tok.pad_token_id,
        stop_token_ids=[tok.eos_token_id],
    )
    resp_mask, _, _ = response_mask(responses, [tok.eos_token_id])
    with torch.no_grad():
        batched, _ = response_logprobs(model, ids, mask, responses, resp_mask)
        for row in range(ids.shape[0]):
            real = mask[row].bool()
            alone, _ = response_logprobs(
                model, ids[row, real][None], mask[row, real][None], responses[row][None], resp_mask[row][None]
            )
            torch.testing.assert_close(batched[row], alone[0], atol=1e-4, rtol=1e-4)
    assert position_ids_from_mask(torch.tensor([[0, 0, 1, 1]])).tolist() == [[0, 0, 0, 1]]
