"""The KV-cache decode loop against transformers' generate, shared prefills, prompt tokenizing, the ready SDPA mask."""

import pytest
import torch

from rlhf_core.models.loading import load_causal_lm
from rlhf_core.rollout.generation import generate
from rlhf_core.rollout.sampling import SamplingSettings
from tests.fixtures.small_models import batch


@pytest.mark.parametrize("min_tokens", [1, 4])
def test_greedy_decode_loop_matches_transformers_generate(smoke_world, min_tokens):
    tok, ids, mask = batch(smoke_world)
    model = load_causal_lm(str(smoke_world.base_model)).eval()
    ours = generate(
        model,
        ids,
        mask,
        SamplingSettings(response_length=7, greedy=True, min_tokens=min_tokens),
        pad_token_id=tok.pad_token_id,
        stop_token_ids=[tok.eos_token_id],
    )
    theirs = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=7,
        min_new_tokens=min_tokens,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )[:, ids.shape[1] :]
    width = theirs.shape[1]
    assert torch.equal(ours[:, :width], theirs)
    assert (ours[:, width:] == tok.pad_token_id).all()
    assert not (ours[:, :min_tokens] == tok.eos_token_id).any()


def test_groups_of_one_prompt_share_its_prefill(smoke_world):
    tok, ids, mask = batch(smoke_world, n=3)
    ids, mask = ids.repeat_interleave(4, dim=0), mask.repeat_interleave(4, dim=0)  # 3 prompts x 4 copies
    model = load_causal_lm(str(smoke_world.base_model)).eval()
    settings = SamplingSettings(response_length=6, greedy=True)
    shared = generate(
        model, ids, mask, settings, pad_token_id=tok.pad_token_id, stop_token_ids=[tok.eos_token_id], prompt_repeats=4
    )
    alone = generate(model, ids, mask, settings, pad_token_id=tok.pad_token_id, stop_token_ids=[tok.eos_token_id])
    assert torch.equal(shared, alone)
    # rows that are not runs of one prompt fall back to prefilling every row
    order = torch.arange(12).view(3, 4).T.flatten()  # prompt 0, 1, 2, 0, 1, 2, ...
    mixed = generate(
        model,
        ids[order],
        mask[order],
        settings,
        pad_token_id=tok.pad_token_id,
        stop_token_ids=[tok.eos_token_id],
        prompt_repeats=4,
    )
    assert torch.equal(mixed, alone[order])


def test_templated_prompts_get_one_bos(tmp_path):
    from rlhf_core.data.chat import render_prompt
    from rlhf_core.models.loading import load_tokenizer as load_tok
    from rlhf_core.rollout.generation import tokenize_prompts
    from tests.fixtures.real_shapes import build_family

    tok = load_tok(str(build_family("llama-3-instruct", tmp_path)))
    prompt = render_prompt(tok, [{"role": "user", "content": "Hi"}])
    ids = tokenize_prompts(tok, [prompt, "Tell me about the cat."], max_prompt_length=64)
    assert ids[0] == tok(prompt, add_special_tokens=False)["input_ids"] and ids[0].count(tok.bos_token_id) == 1
    assert ids[1] == tok("Tell me about the cat.")["input_ids"] and ids[1][0] == tok.bos_token_id


def test_ready_sdpa_mask_samples_exactly_what_the_model_built_mask_samples(smoke_world, monkeypatch):
    import rlhf_core.rollout.generation as generation

    tok, ids, mask = batch(smoke_world, n=4)
    ids, mask = ids.repeat_interleave(3, dim=0), mask.repeat_interleave(3, dim=0)
    model = load_causal_lm(str(smoke_world.base_model)).eval()
    assert generation._takes_ready_sdpa_mask(model)  # the demo's tiny Llama attends through SDPA
    settings = SamplingSettings(response_length=10, temperature=1.3, min_tokens=2)

    def sample():
        torch.manual_seed(3)
        return generate(
            model,
            ids,
            mask,
            settings,
            pad_token_id=tok.pad_token_id,
            stop_token_ids=[tok.eos_token_id],
            prompt_repeats=3,
        )

    ready = sample()
    monkeypatch.setattr(generation, "_takes_ready_sdpa_mask", lambda model: False)
    assert torch.equal(ready, sample())


def test_only_full_attention_sdpa_transformers_models_take_a_ready_mask(smoke_world):
    from types import SimpleNamespace

    from rlhf_core.rollout.generation import _full_attention_sdpa, _takes_ready_sdpa_mask

    def config(**fields):
        return SimpleNamespace(**fields)

    assert _full_attention_sdpa(config(_attn_implementation="sdpa"))
    assert _full_attention_sdpa(config(_attn_implementation="sdpa", layer_types=["full_attention"] * 2))
    assert not _full_attention_sdpa(config(_attn_implementation="eager"))  # an additive mask
    assert not _full_attention_sdpa(config(_attn_implementation="flash_attention_2"))
    assert not _full_attention_sdpa(config(_attn_implementation="sdpa", sliding_window=4096))
    assert not _full_attention_sdpa(config(_attn_implementation="sdpa", layer_types=["sliding_attention"] * 2))
    model = load_causal_lm(str(smoke_world.base_model))

    class Wrapper(torch.nn.Module):  # a module around a model may read the 2-D mask itself
        def __init__(self):
            super().__init__()
            self.model, self.config = model, model.config

    assert _takes_ready_sdpa_mask(model) and not _takes_ready_sdpa_mask(Wrapper())


def test_the_decode_loops_logprobs_are_the_forward_pass_of_the_sampled_tokens(smoke_world):
    """What a generator apart keeps as the behaviour policy: the log-prob of each sampled token under
    softmax(logits / T), as the trainer's forward pass gives it, INVALID_LOGPROB after the stop; the tokens are those
    sampled without it."""
    from rlhf_core.models.forward import response_logprobs
    from rlhf_core.rl_math import INVALID_LOGPROB, response_mask

    tok, ids, mask = batch(smoke_world, n=4)
    model = load_causal_lm(str(smoke_world.base_model)).eval()
    settings = SamplingSettings(response_length=8, temperature=0.7, min_tokens=2)
    kwargs = {"pad_token_id": tok.pad_token_id, "stop_token_ids": [tok.eos_token_id]}
    torch.manual_seed(3)
    responses, logprobs = generate(model, ids, mask, settings, with_logprobs=True, **kwargs)
    torch.manual_seed(3)
    assert torch.equal(generate(model, ids, mask, settings, **kwargs), responses)
    resp_mask, _, _ = response_mask(responses, [tok.eos_token_id])
    with torch.no_grad():
        expected, _ = response_logprobs(model, ids, mask, responses, resp_mask, 0.7)
    real = resp_mask.bool()
    torch.testing.assert_close(logprobs[real], expected[real], rtol=0, atol=1e-5)
    assert (logprobs[~real] == INVALID_LOGPROB).all()
