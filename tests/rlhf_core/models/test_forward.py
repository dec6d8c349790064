"""Log-probabilities of responses read through left-padded prompts."""

import functools

import pytest
import torch

from rlhf_core.models import forward
from rlhf_core.models.forward import response_logprobs
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.rl_math import INVALID_LOGPROB, response_mask
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


def _whole(model, args, temperature, with_entropy):
    """Today's reference: the forward's whole logits, then their log-softmax."""
    from rlhf_core.models.forward import logprobs_from_logits, response_logits

    logits = response_logits(model, *args, temperature=temperature)
    return logprobs_from_logits(logits, args[2], args[3], with_entropy)


@functools.cache
def _tokenizer(name: str):
    from tests.fixtures.real_shapes import build_tokenizer, family

    return build_tokenizer(family(name))


def _family_batch(name: str, seed: int = 0):
    """A tiny model of a real family's shape and a batch of left-padded prompts with right-padded responses."""
    from tests.fixtures.real_shapes import build_model, family

    spec = family(name)
    tok = _tokenizer(name)
    model = build_model(spec, tok, seed=seed).eval()  # GPT-2's dropout off
    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    query_ids = torch.randint(3, len(tok), (4, 6), generator=gen)
    query_mask = torch.ones_like(query_ids)
    query_mask[1, :2] = 0
    query_mask[3, :4] = 0
    responses = torch.randint(3, vocab, (4, 7), generator=gen)
    resp_mask = torch.ones_like(responses)
    resp_mask[0, 5:] = 0
    resp_mask[2, 1:] = 0
    return model, (query_ids, query_mask, responses, resp_mask)


@pytest.mark.parametrize(("name", "chunk"), [("qwen2.5", 256), ("qwen2.5", 3), ("llama-3-instruct", 3), ("gpt2", 3)])
def test_the_head_in_chunks_gives_the_whole_logits_numbers_and_gradients(name, chunk, monkeypatch):
    monkeypatch.setattr(forward, "LOGITS_CHUNK_TOKENS", chunk)
    model, args = _family_batch(name)
    mask = args[3].bool()
    with torch.no_grad():
        expected, expected_entropy = _whole(model, args, 0.7, True)
        logp, entropy = forward.response_logprobs(model, *args, 0.7, with_entropy=True)
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[mask], expected_entropy[mask], atol=1e-5, rtol=1e-5)
    assert (logp[~mask] == INVALID_LOGPROB).all() and (entropy[~mask] == 0).all()

    def gradients(logprobs):
        model.zero_grad()
        logp, _ = logprobs()
        (logp.masked_fill(~mask, 0) * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ours = gradients(lambda: forward.response_logprobs(model, *args, 0.7))
    theirs = gradients(lambda: _whole(model, args, 0.7, False))
    assert ours.keys() == theirs.keys() and ours
    for n in ours:
        torch.testing.assert_close(ours[n], theirs[n], atol=1e-6, rtol=1e-4, msg=n)


def test_the_head_never_sees_more_than_a_chunk(monkeypatch):
    monkeypatch.setattr(forward, "LOGITS_CHUNK_TOKENS", 4)
    model, args = _family_batch("qwen2.5")
    rows = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows.append(o.shape[:-1].numel()))
    logp, _ = forward.response_logprobs(model, *args)
    logp.masked_fill(args[3] == 0, 0).sum().backward()  # the backward's recomputation included
    handle.remove()
    kept = int(args[3].sum())
    assert max(rows) == 4 and sum(r for r in rows if r) == 2 * kept  # forward and recomputation, padding never


def test_a_forward_that_changes_the_heads_output_gets_its_own_logits():
    model, args = _family_batch("qwen2.5")

    class SoftCapped(type(model)):
        def forward(self, *a, **kw):
            out = super().forward(*a, **kw)
            out.logits = torch.tanh(out.logits / 0.5) * 0.5
            return out

    model.__class__ = SoftCapped
    with torch.no_grad():
        expected, _ = _whole(model, args, 1.0, False)
        first, _ = forward.response_logprobs(model, *args)
        again, _ = forward.response_logprobs(model, *args)
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(again, expected)
    assert forward._head_outside(model) is None


def test_a_lora_policy_with_its_adapters_disabled_reads_through_the_head_in_chunks(monkeypatch):
    from peft import LoraConfig, TaskType, get_peft_model

    monkeypatch.setattr(forward, "LOGITS_CHUNK_TOKENS", 5)
    model, args = _family_batch("qwen2.5")
    with torch.no_grad():
        before, _ = _whole(model, args, 1.0, False)
    policy = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, target_modules=["q_proj", "v_proj"]))
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    with torch.no_grad():
        adapted, _ = forward.response_logprobs(policy, *args)
        torch.testing.assert_close(adapted, _whole(policy, args, 1.0, False)[0], atol=1e-5, rtol=1e-5)
        with policy.disable_adapter():
            plain, _ = forward.response_logprobs(policy, *args)
    torch.testing.assert_close(plain, before, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain, adapted)


@pytest.mark.parametrize("name", ["qwen2.5", "gpt2"])
def test_the_sft_loss_with_the_head_in_chunks_is_transformers_labels_loss(name, monkeypatch):
    monkeypatch.setattr(forward, "LOGITS_CHUNK_TOKENS", 5)
    model, (query_ids, _, responses, resp_mask) = _family_batch(name)
    input_ids = torch.cat([query_ids, responses], 1)  # right-padded, as SFT pads
    attention_mask = torch.cat([torch.ones_like(query_ids), resp_mask], 1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :3] = -100  # a prompt without loss, as prompt-completion SFT
    losses, grads = [], []
    for loss_of in (
        lambda: model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss,
        lambda: forward.causal_lm_loss(model, input_ids, attention_mask, labels),
    ):
        model.zero_grad()
        loss = loss_of()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=1e-5)
    for n, grad in grads[0].items():
        torch.testing.assert_close(grads[1][n], grad, atol=1e-6, rtol=1e-4, msg=n)


def test_under_bf16_autocast_the_head_still_runs_apart_at_the_autocast_of_the_forward():
    model, args = _family_batch("qwen2.5")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, _ = _whole(model, args, 1.0, False)
        logp, _ = forward.response_logprobs(model, *args)
    assert forward._head_outside(model) is not None  # not taken for a forward that changes the head's output
    torch.testing.assert_close(logp, expected, atol=2e-2, rtol=2e-2)
