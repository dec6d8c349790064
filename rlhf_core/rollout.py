"""Rollouts, what PPO and GRPO share: batched generation, log-probabilities, values and reward-model
scores of responses, each step's prompts, and the loop settings of the RL stage.

Prompts are left-padded so every response starts at the same column (`context_length`); responses
are right-padded after their stop token. Position ids are derived from the attention mask in every
forward, so left padding never shifts a model's positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from rlhf_core.chat import encode
from rlhf_core.config import RLConfig, RunConfig
from rlhf_core.loop import LoopSettings, ShardedBatches
from rlhf_core.rl_math import INVALID_LOGPROB, entropy_from_logits, response_mask, selective_log_softmax
from rlhf_core.timing import PhaseTimer


@dataclass(frozen=True)
class SamplingSettings:
    response_length: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    min_tokens: int = 1  # the stop token is not sampled before this many tokens


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


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


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then nucleus (top-p) filtering: logits outside are set to -inf. (B, V)"""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) > top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """One token per row: argmax when greedy, else a draw from softmax(logits / T). (B,)

    Inverse-CDF sampling: one uniform number per row searched in the cumulative probabilities.
    It samples the softmax exactly and needs B random numbers instead of the B x V of Gumbel-max,
    which on the CPU costs more than the forward pass of a small model.
    """
    if settings.greedy:
        return logits.argmax(-1)
    logits = logits.float() if settings.temperature == 1.0 else logits.float() / settings.temperature
    probs = filter_logits(logits, settings.top_k, settings.top_p).softmax(-1)
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    # u strictly below the total mass, and right=True (the first token whose cumulative mass exceeds u):
    # a filtered (zero-probability) token never wins, even when rounding would put u on the total
    u = torch.minimum(torch.rand_like(total) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


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
) -> torch.Tensor:
    """Sample responses with the KV cache: (B, response_length), padded with pad_token_id after the stop.

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
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    mask = torch.zeros((batch, context + settings.response_length), dtype=torch.long, device=device)
    mask[:, :context] = query_mask
    # one new token attends to every attended position before it: the (B, 1, 1, K) boolean mask the model
    # would build from `mask` for SDPA, passed ready-made (the model's mask construction costs more than
    # the attention itself at one query per row)
    bool_mask = mask.bool() if _takes_ready_sdpa_mask(policy) else None
    shared = (
        prompt_repeats > 1
        and batch % prompt_repeats == 0
        and all(
            bool((t.view(-1, prompt_repeats, context) == t[::prompt_repeats, None]).all())
            for t in (query_ids, query_mask)
        )
    )
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
        if t < settings.min_tokens and len(stops):
            logits = logits.index_fill(-1, stops, float("-inf"))
        alive = ~done
        token = sample_next(logits, settings).masked_fill(done, pad_token_id)
        responses[:, t] = token
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
    return responses


def decode_responses(tokenizer, responses: torch.Tensor, resp_mask: torch.Tensor) -> list[str]:
    """The text of each response up to and including its stop token, special tokens skipped (as TRL)."""
    lengths = resp_mask.sum(1).tolist()
    return tokenizer.batch_decode([row[:n] for row, n in zip(responses.tolist(), lengths)], skip_special_tokens=True)


def _full_mask(query_mask: torch.Tensor, resp_mask: torch.Tensor) -> torch.Tensor:
    return torch.cat([query_mask, resp_mask], dim=1)


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
    logits = out.logits[:, :-1].float()  # (B, R, V)
    if temperature != 1.0:
        logits = logits / temperature
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


@dataclass
class Rollout:
    """One batch of experience: everything PPO or GRPO needs, detached."""

    query_ids: torch.Tensor  # (B, Q) left-padded
    query_mask: torch.Tensor  # (B, Q)
    responses: torch.Tensor  # (B, R) right-padded after the stop token
    resp_mask: torch.Tensor  # (B, R)
    last_index: torch.Tensor  # (B,) index of the last real response token
    logprobs: torch.Tensor | None  # (B, R) policy at sampling time; None when not asked for
    ref_logprobs: torch.Tensor | None  # (B, R)
    has_stop: torch.Tensor  # (B,) bool: the response ended with a stop token (else it ran to response_length)


def reference_context(policy, ref_model):
    """With no separate reference (LoRA), the policy with its adapters disabled is the reference."""
    if ref_model is None:
        return policy.disable_adapter()
    return nullcontext()


@torch.no_grad()
def collect_rollout(
    policy,
    ref_model,
    query_ids,
    query_mask,
    settings: SamplingSettings,
    *,
    pad_token_id: int,
    stop_token_ids: Sequence[int] = (),
    need_reference: bool = True,
    need_logprobs: bool = True,
    prompt_repeats: int = 1,
    timer: PhaseTimer | None = None,
) -> Rollout:
    """Generate responses and score them under the policy and, when asked, the reference.

    need_logprobs=False skips the policy's forward pass: with one update per batch the "old"
    log-probabilities equal the first update's own, detached (GRPO with num_iterations 1, as TRL).
    prompt_repeats: see `generate`. `timer` times the phases generate, policy_logprobs and reference.
    """
    timer = timer or PhaseTimer(enabled=False)
    policy.eval()
    with timer("generate"):
        responses = generate(
            policy,
            query_ids,
            query_mask,
            settings,
            pad_token_id=pad_token_id,
            stop_token_ids=stop_token_ids,
            prompt_repeats=prompt_repeats,
        )
    resp_mask, last_index, has_stop = response_mask(responses, stop_token_ids)
    logprobs = None
    if need_logprobs:
        with timer("policy_logprobs"):
            logprobs, _ = response_logprobs(policy, query_ids, query_mask, responses, resp_mask, settings.temperature)
    ref_logprobs = None
    if need_reference:
        with timer("reference"), reference_context(policy, ref_model):
            ref_logprobs, _ = response_logprobs(
                ref_model or policy, query_ids, query_mask, responses, resp_mask, settings.temperature
            )
    return Rollout(query_ids, query_mask, responses, resp_mask, last_index, logprobs, ref_logprobs, has_stop)


def completion_metrics(rollout: Rollout) -> dict[str, torch.Tensor]:
    """TRL's completion statistics of a rollout, as 0-d tensors: lengths in tokens (stop token included),
    the fraction that never stopped, and the mean length of those that did (0 when none did)."""
    lengths = rollout.resp_mask.sum(1).float()
    stopped = rollout.has_stop.float()
    return {
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": 1.0 - stopped.mean(),
        "completions/mean_terminated_length": (lengths * stopped).sum() / stopped.sum().clamp(min=1.0),
    }


# -- around the loop: each step's prompts, the sampling and loop settings of the RL stage ------------------


class PromptBatches:
    """Each RL step's prompts: this process's share of an epoch's shuffle (see `ShardedBatches`), each
    prompt repeated `repeat` times (GRPO's groups), left-padded on `device`: (query_ids, query_mask, indices)."""

    def __init__(
        self, tokenizer, prompts: list[str], *, max_prompt_length: int, per_step: int, seed: int, loop, repeat: int = 1
    ):
        if not prompts:
            raise ValueError(f"the prompt set is empty; {loop.settings.name.upper()} needs at least one prompt")
        self.prompt_ids = tokenize_prompts(tokenizer, prompts, max_prompt_length)
        self.pad_id, self.repeat, self.device = tokenizer.pad_token_id, repeat, loop.device
        # data parallel: every process rolls out its own per_step prompts per step
        self.order = ShardedBatches(
            len(self.prompt_ids),
            per_step,
            seed,
            rank=loop.rank,
            world=loop.world,
            epoch=loop.epoch,
            position=loop.position,
        )

    @property
    def epoch(self) -> int:
        return self.order.epoch

    @property
    def position(self) -> int:
        return self.order.position

    def next(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        indices = [i for i in self.order.next() for _ in range(self.repeat)]
        query_ids, query_mask = left_pad([self.prompt_ids[i] for i in indices], self.pad_id)
        return query_ids.to(self.device), query_mask.to(self.device), indices


def rl_sampling(rl: RLConfig) -> SamplingSettings:
    return SamplingSettings(
        response_length=rl.response_length,
        temperature=rl.temperature,
        top_k=rl.top_k,
        top_p=rl.top_p,
        min_tokens=rl.min_response_length,
    )


def rl_loop_settings(
    rl: RLConfig, run: RunConfig, *, name: str, micro_batches: int, micro_batch_size: int, eval_every: int | None
) -> LoopSettings:
    """PPO's and GRPO's loop: rl.total_steps rollout batches, checkpoints of `policy/` (and the models beside it)."""
    return LoopSettings(
        name=name,
        section="rl",
        total_steps=rl.total_steps,
        optim=rl,
        micro_batches=micro_batches,
        micro_batch_size=micro_batch_size,
        log_every=rl.log_steps,
        eval_every=eval_every,
        save_every=rl.save_steps,
        disable_dropout=rl.disable_dropout,
        keep_last=run.keep_last_checkpoints,
        # the newest N checkpoints and the best by the step's training score (PPO objective/scores, GRPO reward)
        best_metric=("objective/scores", "reward"),
        registered="policy",
        timing=True,
        shown=("objective/scores", "reward", "objective/kl", "kl"),
    )
