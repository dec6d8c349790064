"""Forward passes that score responses: the policy's log-probabilities (and entropies), a value model's
per-token values and a reward model's sequence scores, all read through the attention mask of
left-padded prompts followed by right-padded responses."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rlhf_core.rl_math import INVALID_LOGPROB, entropy_from_logits, selective_log_softmax


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: each row counts from its first real token."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


def _full_mask(query_mask: torch.Tensor, resp_mask: torch.Tensor) -> torch.Tensor:
    return torch.cat([query_mask, resp_mask], dim=1)


class Trimmed(NamedTuple):
    """A batch without the columns no row needs (`trimmed`): `args` (query_ids, query_mask, responses, resp_mask)
    and the width `pad` puts the response columns back to."""

    args: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    width: int

    def pad(self, per_token: torch.Tensor, value: float) -> torch.Tensor:
        """(B, R') per-token values back to (B, width) with `value` in the cut columns."""
        return F.pad(per_token, (0, self.width - per_token.shape[1]), value=value)


def trimmed(query_ids, query_mask, responses, resp_mask) -> Trimmed:
    """The prompt columns from the first any row uses and the response columns up to the last any row uses (one at
    least): a micro-batch of short rows pays for its own longest row, not the batch's. Positions come from the
    mask, so the numbers are the same."""
    used = query_mask.any(0).nonzero()
    start = int(used[0]) if len(used) else query_ids.shape[1] - 1
    kept = resp_mask.any(0).nonzero()
    end = int(kept[-1]) + 1 if len(kept) else 1
    args = (query_ids[:, start:], query_mask[:, start:], responses[:, :end], resp_mask[:, :end])
    return Trimmed(args, responses.shape[1])


def over_micro_batches(fn: Callable, plan: Sequence[Sequence[int]] | None, *tensors: torch.Tensor):
    """fn(*each tensor's rows) for each micro-batch of `plan` (lists of rows; None: one), its outputs (a tensor, or a
    tuple of tensors and Nones) put back in row order."""
    if plan is None:
        return fn(*tensors)
    rows_of = [torch.as_tensor(rows, dtype=torch.long, device=tensors[0].device) for rows in plan]
    parts = [fn(*(t[rows] for t in tensors)) for rows in rows_of]
    single = not isinstance(parts[0], tuple)
    columns = zip(*([p] if single else p for p in parts), strict=True)
    merged = []
    for outputs in columns:
        if outputs[0] is None:
            merged.append(None)
            continue
        whole = outputs[0].new_empty((tensors[0].shape[0], *outputs[0].shape[1:]))
        for rows, out in zip(rows_of, outputs, strict=True):
            whole[rows] = out
        merged.append(whole)
    return merged[0] if single else tuple(merged)


def _response_forward(model, query_ids, query_mask, responses, resp_mask):
    """The model's forward over prompt + response, its output only where it predicts a response token (the
    vocabulary projection is most of the cost) and one position more."""
    input_ids = torch.cat([query_ids, responses], dim=1)
    attention_mask = _full_mask(query_mask, resp_mask)
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        logits_to_keep=responses.shape[1] + 1,
    )


def response_logits(
    model,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    responses: torch.Tensor,
    resp_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The logits (divided by `temperature`, float32) that predict each response token, whole. (B, R, V)"""
    logits = _response_forward(model, query_ids, query_mask, responses, resp_mask).logits[:, :-1].float()
    return logits / temperature if temperature != 1.0 else logits


# response tokens whose float32 logits exist at once (x the vocabulary x 4 bytes): TRL's row of 256 tokens
LOGITS_CHUNK_TOKENS = 256
_LOGITS_INSIDE: weakref.WeakSet = weakref.WeakSet()  # models whose forward changes the head's output: whole logits


class _HeadInput:
    """Hooks on a causal LM's output embeddings for one forward: the head runs on no position and returns the
    hidden states it was given, so the forward's "logits" are the final hidden states; the autocast it ran
    under is kept, for the head's chunks to run under the same."""

    def __init__(self, head: torch.nn.Module):
        self.hidden: torch.Tensor | None = None
        self.autocast: tuple[str, bool, torch.dtype] | None = None
        self.handles = (head.register_forward_pre_hook(self._before), head.register_forward_hook(self._after))

    def _before(self, module, args):
        hidden = args[0]
        self.hidden = hidden
        kind = hidden.device.type
        self.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        return (hidden[..., :0, :], *args[1:])

    def _after(self, module, args, output):
        return self.hidden

    def __enter__(self) -> _HeadInput:
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


def _handed_back(logits: torch.Tensor, hidden: torch.Tensor) -> bool:
    """Whether the forward returned the head's output as the head gave it: the hidden states themselves, or a copy
    a wrapper made (DDP's, accelerate's cast of outputs to float32)."""
    return logits is hidden or (logits.shape == hidden.shape and torch.equal(logits.to(hidden.dtype), hidden))


def _inner(model) -> torch.nn.Module:
    """The causal LM inside DDP's or DeepSpeed's wrapper and PEFT's."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "peft_config") else model


def _head_outside(model) -> torch.nn.Module | None:
    """The LM head when it can run outside the model's forward, chunk by chunk: not when its parameters are
    sharded between forwards (FSDP, DeepSpeed ZeRO-3) or when the forward was seen to change its output
    (logit soft-capping or scaling); else None."""
    inner = _inner(model)
    if inner in _LOGITS_INSIDE or type(inner).__name__.startswith("FSDP"):
        return None
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None or any(hasattr(p, "ds_id") for p in head.parameters()):
        return None
    return head


def response_logprobs(
    model,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    responses: torch.Tensor,
    resp_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(response token | prefix) for each response token, INVALID_LOGPROB on padding (B, R), and the
    entropies when asked. The vocabulary's float32 logits are never whole: the forward stops at the final hidden
    states and the head runs on LOGITS_CHUNK_TOKENS response tokens at a time, padding skipped, each chunk's
    logits recomputed in backward instead of kept (`head_logprobs`). A model whose head cannot run apart
    (`_head_outside`) gets the whole logits of its own forward."""
    cut = trimmed(query_ids, query_mask, responses, resp_mask)
    logp, entropy = _logprobs(model, cut.args, temperature, with_entropy)
    return cut.pad(logp, INVALID_LOGPROB), None if entropy is None else cut.pad(entropy, 0.0)


def _logprobs(model, args: tuple, temperature: float, with_entropy: bool):
    responses, resp_mask = args[2], args[3]
    apart = _through_head_apart(model, lambda: _response_forward(model, *args))
    if apart is None:
        logits = response_logits(model, *args, temperature)
        return logprobs_from_logits(logits, responses, resp_mask, with_entropy)
    head, hidden, autocast = apart
    with autocast:
        return head_logprobs(head, hidden[:, :-1], responses, resp_mask, temperature, with_entropy)


def causal_lm_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean negative log-likelihood of each next token whose label is not -100, as transformers' `labels=` loss
    (logits in float32), with the head run apart in chunks as `response_logprobs` runs it (SFT)."""
    apart = _through_head_apart(
        model, lambda: model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    )
    if apart is None:
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    head, hidden, autocast = apart
    targets = labels[:, 1:]
    kept = targets != -100
    with autocast:
        logp, _ = head_logprobs(head, hidden[:, :-1], targets.clamp(min=0), kept)
    return -(logp.masked_fill(~kept, 0.0).sum() / kept.sum().clamp(min=1))


def _through_head_apart(model, forward: Callable):
    """(the head, the final hidden states `forward()` handed back, the autocast it ran under) when the head can run
    apart (`_head_outside`); else None, the model remembered when its forward changed the head's output."""
    head = _head_outside(model)
    if head is None:
        return None
    with _HeadInput(head) as captured:
        out = forward()
    if not _handed_back(out.logits, captured.hidden):
        _LOGITS_INSIDE.add(_inner(model))  # the forward post-processes the head's output: never apart again
        return None
    kind, enabled, dtype = captured.autocast
    return head, out.logits, torch.autocast(kind, dtype=dtype, enabled=enabled)


def head_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    responses: torch.Tensor,
    resp_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logprobs_from_logits` of head(hidden) (B, R, H), computed LOGITS_CHUNK_TOKENS response tokens at a time
    over the tokens `resp_mask` keeps; under autograd each chunk is checkpointed (its logits recomputed in
    backward), so one chunk's logits exist at any time."""
    kept = resp_mask.bool()
    states, targets = hidden[kept], responses[kept]
    grad = torch.is_grad_enabled() and states.requires_grad
    picked, entropies = [], []
    for start in range(0, states.shape[0], LOGITS_CHUNK_TOKENS):
        part = (head, states[start : start + LOGITS_CHUNK_TOKENS], targets[start : start + LOGITS_CHUNK_TOKENS])
        # the entropy once: not again when backward recomputes the chunk (a statistic, it saves nothing for it)
        entropy_due = [with_entropy]
        if grad:
            logp, entropy = checkpoint(_chunk_logprobs, *part, temperature, entropy_due, use_reentrant=False)
        else:
            logp, entropy = _chunk_logprobs(*part, temperature, entropy_due)
        picked.append(logp)
        entropies.append(entropy)
    template = torch.full(responses.shape, INVALID_LOGPROB, dtype=torch.float32, device=responses.device)
    logp = template.masked_scatter(kept, torch.cat(picked)) if picked else template
    if not with_entropy:
        return logp, None
    entropy = torch.zeros_like(template)
    return logp, entropy.masked_scatter(kept, torch.cat(entropies)) if entropies else entropy


def _chunk_logprobs(head, states: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_due: list[bool]):
    """One chunk's log-probabilities of `targets` under head(states) / temperature in float32, and its entropies
    (a statistic: no graph, one vocabulary-sized temporary) while entropy_due[0], which it then clears; else None."""
    logits = head(states).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = selective_log_softmax(logits, targets, lse)
    if not entropy_due[0]:
        return logp, None
    entropy_due[0] = False
    with torch.no_grad():  # entropy_from_logits's H = lse - sum(p * logits), p computed in place
        probs = (logits - lse.unsqueeze(-1)).exp_()
        return logp, lse - torch.einsum("tv,tv->t", probs, logits)


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
    cut = trimmed(query_ids, query_mask, responses, resp_mask)
    return cut.pad(_token_values(value_model, *cut.args), 0.0)


def _token_values(value_model, query_ids, query_mask, responses, resp_mask) -> torch.Tensor:
    input_ids = torch.cat([query_ids, responses], dim=1)
    values = head_per_token(value_model, input_ids, _full_mask(query_mask, resp_mask))
    context = query_ids.shape[1]
    return values[:, context - 1 : -1] * resp_mask


def sequence_scores(
    reward_model, query_ids, query_mask, responses, resp_mask, last_index: torch.Tensor
) -> torch.Tensor:
    """The reward model's score at the last real token of each query+response. (B,)"""
    query_ids, query_mask, responses, resp_mask = trimmed(query_ids, query_mask, responses, resp_mask).args
    input_ids = torch.cat([query_ids, responses], dim=1)
    per_token = head_per_token(reward_model, input_ids, _full_mask(query_mask, resp_mask))
    rows = torch.arange(per_token.shape[0], device=per_token.device)
    return per_token[rows, query_ids.shape[1] + last_index]
