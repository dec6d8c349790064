"""Forward passes that score responses: the policy's log-probabilities (and entropies), a value model's
per-token values and a reward model's sequence scores, all read through the attention mask of
left-padded prompts followed by right-padded responses."""

from __future__ import annotations

import torch

from rlhf_core.rl_math import INVALID_LOGPROB, entropy_from_logits, selective_log_softmax


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: each row counts from its first real token."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


def _full_mask(query_mask: torch.Tensor, resp_mask: torch.Tensor) -> torch.Tensor:
    return torch.cat([query_mask, resp_mask], dim=1)


def response_logits(
    model,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    responses: torch.Tensor,
    resp_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The logits (divided by `temperature`, float32) that predict each response token. (B, R, V)"""
    input_ids = torch.cat([query_ids, responses], dim=1)
    attention_mask = _full_mask(query_mask, resp_mask)
    # logits only where they predict a response token: the vocabulary projection is most of the cost
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        logits_to_keep=responses.shape[1] + 1,
    )
    logits = out.logits[:, :-1].float()
    return logits / temperature if temperature != 1.0 else logits


def response_logprobs(
    model,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    responses: torch.Tensor,
    resp_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(response token | prefix) for each response token, INVALID_LOGPROB on padding. (B, R)"""
    logits = response_logits(model, query_ids, query_mask, responses, resp_mask, temperature)
    return logprobs_from_logits(logits, responses, resp_mask, with_entropy)


def logprobs_from_logits(
    logits: torch.Tensor, responses: torch.Tensor, resp_mask: torch.Tensor, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The response tokens' log-probabilities under `logits` (B, R, V), INVALID_LOGPROB on padding, and the
    entropies when asked. (B, R)"""
    lse = torch.logsumexp(logits, dim=-1)
    logp = selective_log_softmax(logits, responses, lse).masked_fill(resp_mask == 0, INVALID_LOGPROB)
    entropy = None
    if with_entropy:  # a statistic, never a loss term: no graph
        with torch.no_grad():
            entropy = entropy_from_logits(logits, lse)
    return logp, entropy


def head_per_token(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A sequence classifier's score head applied to every position: (B, T).

    Used instead of the classifier's own forward, which pools at the last token that is not the pad
    id: with pad == eos (Qwen2.5 base, GPT-2) that is the token before the eos. Callers pick the
    position from the attention mask or the stop position. A PEFT model is read through its base
    model, adapters active.
    """
    if hasattr(model, "peft_config"):
        model = model.get_base_model()
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state
    return model.score(hidden).squeeze(-1).float()


def token_values(value_model, query_ids, query_mask, responses, resp_mask) -> torch.Tensor:
    """V(state before each response token), zero on padding. (B, R)"""
    input_ids = torch.cat([query_ids, responses], dim=1)
    values = head_per_token(value_model, input_ids, _full_mask(query_mask, resp_mask))
    context = query_ids.shape[1]
    return values[:, context - 1 : -1] * resp_mask


def sequence_scores(
    reward_model, query_ids, query_mask, responses, resp_mask, last_index: torch.Tensor
) -> torch.Tensor:
    """The reward model's score at the last real token of each query+response. (B,)"""
    input_ids = torch.cat([query_ids, responses], dim=1)
    per_token = head_per_token(reward_model, input_ids, _full_mask(query_mask, resp_mask))
    rows = torch.arange(per_token.shape[0], device=per_token.device)
    return per_token[rows, query_ids.shape[1] + last_index]
