"""Batched generation with the KV cache, and the prompt side of it: tokenizing, left padding, decoding.

Prompts are left-padded so every response starts at the same column (`context_length`); responses
are right-padded after their stop token. Position ids are derived from the attention mask in every
forward, so left padding never shifts a model's positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf_core.data.chat import encode
from rlhf_core.models.forward import position_ids_from_mask
from rlhf_core.rl_math import INVALID_LOGPROB
from rlhf_core.rollout.sampling import SamplingSettings, sample_next


def tokenize_prompts(tokenizer, prompts: list[str], max_prompt_length: int) -> list[list[int]]:
    """Prompt token ids, cut from the left when longer than max_prompt_length (the end of a prompt matters)."""
    ids = encode(tokenizer, prompts)  # a templated prompt (it starts with bos) gets no second bos
    return [seq[-max_prompt_length:] for seq in ids]


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each (B, T), padded on the left."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq) :] = torch.tensor(seq)
            mask[i, width - len(seq) :] = 1
    return ids, mask


def _takes_ready_sdpa_mask(model) -> bool:
    """True when `model` is a transformers model (or a PEFT model around one) that attends through SDPA with
    full (causal) attention in every layer: a ready 4-D boolean mask then means to it exactly what its own
    mask construction makes of the 2-D one. Any other module (a wrapper) gets the 2-D mask."""
    from transformers import PreTrainedModel

    base = model.get_base_model() if hasattr(model, "peft_config") else model
    return isinstance(base, PreTrainedModel) and _full_attention_sdpa(base.config)


def _full_attention_sdpa(config) -> bool:
    """SDPA in every layer, none of them sliding-window: eager attention wants an additive mask, flash
    attention a 2-D one, and sliding-window layers a mask of their own."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return getattr(config, "sliding_window", None) is None


def _runs_of_one_prompt(query_ids: torch.Tensor, query_mask: torch.Tensor, repeats: int) -> bool:
    """The rows come in runs of `repeats` copies of one prompt (GRPO's groups): its prefill can be shared."""
    batch, context = query_ids.shape
    if repeats <= 1 or batch % repeats:
        return False
    return all(bool((t.view(-1, repeats, context) == t[::repeats, None]).all()) for t in (query_ids, query_mask))


@torch.no_grad()
def generate(
    policy,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    settings: SamplingSettings,
    *,
    pad_token_id: int,
    stop_token_ids: Sequence[int] = (),
    prompt_repeats: int = 1,
    with_logprobs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sample responses with the KV cache: (B, response_length), padded with pad_token_id after the stop; with
    `with_logprobs` also each sampled token's log-probability under softmax(logits / temperature), as the trainer's
    forward pass computes it (before top-k, top-p and min tokens), INVALID_LOGPROB after the stop.

    A plain decode loop over the model's forward with `past_key_values`: one batched forward per
    new token, position ids from the attention mask (left padding), no stop token before
    settings.min_tokens tokens, and an early exit once every row has stopped. A row stops at the
    first of any id in `stop_token_ids` (instruct models stop on two); the stop token is part of the
    response, and `response_mask` finds it again, never the pad. With prompt_repeats G the rows come
    in runs of G copies of one prompt (GRPO's groups): each prompt is prefilled once and its cache repeated.
    """
    batch, context = query_ids.shape
    device = query_ids.device
    stops = torch.as_tensor(list(stop_token_ids), dtype=torch.long, device=device)
    responses = torch.full((batch, settings.response_length), pad_token_id, dtype=torch.long, device=device)
    logprobs = (
        torch.full(responses.shape, INVALID_LOGPROB, dtype=torch.float32, device=device) if with_logprobs else None
    )
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    mask = torch.zeros((batch, context + settings.response_length), dtype=torch.long, device=device)
    mask[:, :context] = query_mask
    # one new token attends to every attended position before it: the (B, 1, 1, K) boolean mask the model
    # would build from `mask` for SDPA, passed ready-made (the model's mask construction costs more than
    # the attention itself at one query per row)
    bool_mask = mask.bool() if _takes_ready_sdpa_mask(policy) else None
    shared = _runs_of_one_prompt(query_ids, query_mask, prompt_repeats)
    rows = slice(None, None, prompt_repeats) if shared else slice(None)
    out = policy(
        input_ids=query_ids[rows],
        attention_mask=query_mask[rows],
        position_ids=position_ids_from_mask(query_mask[rows]),
        use_cache=True,
        logits_to_keep=1,
    )  # the prefill needs the last position's logits only
    logits = out.logits[:, -1, :]
    cache = out.past_key_values
    if shared:
        logits = logits.repeat_interleave(prompt_repeats, dim=0)
        cache.batch_repeat_interleave(prompt_repeats)
    for t in range(settings.response_length):
        processed = logits
        if t < settings.min_tokens and len(stops):
            processed = logits.index_fill(-1, stops, float("-inf"))
        alive = ~done
        token = sample_next(processed, settings).masked_fill(done, pad_token_id)
        responses[:, t] = token
        if logprobs is not None:
            chosen = torch.log_softmax(logits.float() / settings.temperature, -1).gather(-1, token.unsqueeze(-1))[:, 0]
            logprobs[:, t] = chosen.masked_fill(done, INVALID_LOGPROB)
        if len(stops):
            done = done | torch.isin(token, stops)
        if bool(done.all()) or t == settings.response_length - 1:
            break
        mask[:, context + t] = alive.long()  # the stop token itself is attended to; what follows it is not
        step_mask = mask[:, : context + t + 1]
        positions = (step_mask.sum(1, keepdim=True) - 1).clamp(min=0)
        if bool_mask is not None:
            bool_mask[:, context + t] = alive
        out = policy(
            input_ids=token.unsqueeze(1),
            attention_mask=step_mask if bool_mask is None else bool_mask[:, None, None, : context + t + 1],
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        logits, cache = out.logits[:, -1, :], out.past_key_values
    return (responses, logprobs) if logprobs is not None else responses


def decode_responses(tokenizer, responses: torch.Tensor, resp_mask: torch.Tensor) -> list[str]:
    """The text of each response up to and including its stop token, special tokens skipped (as TRL)."""
    lengths = resp_mask.sum(1).tolist()
    return tokenizer.batch_decode([row[:n] for row, n in zip(responses.tolist(), lengths)], skip_special_tokens=True)
