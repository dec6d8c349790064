"""Generation evaluation: the policy's own samples of held-out prompts, scored every way we can.

Completions are sampled as in training (the sampling temperature, top-k, top-p), so that what is
measured is what the policy does: near-greedy decoding would hide collapse and make the KL estimate
meaningless. Each row holds the prompt, the completion, the reward model's score, every metric
function's value, the KL of the policy to the reference along the completion at the sampling
temperature (sums over its tokens; absent when no reference is loaded), its length in tokens (the
answer's: the stop token that ended it is not counted, so that "standard ." against "good ." reads as
the reader sees it) and whether it stopped. The KL is measured three ways: `kl_exact`, the exact KL of
the two next-token distributions over the whole vocabulary at each position (both models' logits are at hand), which
the guard and promotion read (`promotion.eval_kl`); and the sampling estimators k1 (`kl`) and k3
(`kl_k3`), kept as diagnostics beside training's. k3 = exp(r) - 1 - r (r = log ref - log policy)
explodes on the rare sampled token that the policy finds unlikely and the reference likes: one such
sample in 64 can move its mean by tens of nats; the exact KL does not move. `summarize_rows` adds
what only the whole set shows: distinct-1/2, the repeated n-gram rate, the stop rate, and the exact
KL's median and p90. The caller turns rows into MLflow tables, Prefect artifacts and Parquet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from rlhf_core.data.chat import assistant_messages, final_answer
from rlhf_core.models.forward import (
    LOGITS_CHUNK_TOKENS,
    logprobs_from_logits,
    over_micro_batches,
    response_logits,
    sequence_scores,
)
from rlhf_core.rewards.functions import accepts, call_scoring_function, completion_ids
from rlhf_core.rl_math import exact_kl_per_token, kl_per_token
from rlhf_core.rollout.collect import (
    Passes,
    SamplingSpec,
    ToolRollout,
    collect_rollout,
    context_length,
    reference_context,
)
from rlhf_core.rollout.engines import RolloutEngine
from rlhf_core.rollout.generation import decode_responses, left_pad, tokenize_prompts
from rlhf_core.rollout.sampling import SamplingSettings
from rlhf_core.rollout.tools import ToolUse
from rlhf_core.storage.saving import is_peft

SPREAD_COLUMNS = ("kl_exact",)
NEITHER = Passes(
    policy=False, reference=False
)  # the KL is measured with both models' whole logits instead  # columns whose median and p90 the summary adds (a mean alone hides the tail)


@dataclass(frozen=True)
class EvalModels:
    """What an evaluation reads: the policy that samples, the reference its KL is measured to (None: a PEFT
    policy's disabled adapters, or, for a plain policy, no KL), the reward model that scores (None: no score)."""

    policy: Any
    tokenizer: Any
    ref_model: Any = None
    reward_model: Any = None


@dataclass(frozen=True)
class EvalPrompts:
    """The prompts, with their message lists when they are conversational (metric functions then receive them,
    and each completion as [{"role": "assistant", "content": text}], as GRPO's reward functions do: TRL's
    convention) and their dataset's other columns (passed to metric functions as keyword arguments)."""

    prompts: list[str]
    messages: Sequence[list[dict]] | None = None
    columns: dict[str, Sequence] | None = None

    def repeated(self, n: int) -> EvalPrompts:
        """Each prompt (and its messages and columns) n times in a row."""
        return EvalPrompts(
            [p for p in self.prompts for _ in range(n)],
            [m for m in self.messages for _ in range(n)] if self.messages is not None else None,
            {k: [v for v in values for _ in range(n)] for k, values in (self.columns or {}).items()},
        )


@dataclass(frozen=True)
class EvalSampling:
    """How an evaluation samples: `settings` (temperature, top-k, top-p, or greedy; the response length), the
    prompt length, how many prompts per batch, what stops a response, and tool episodes (`tool_use`: each prompt an
    episode, rendered with `template_kwargs`)."""

    settings: SamplingSettings
    max_prompt_length: int
    batch_size: int
    stop_token_ids: Sequence[int] = ()
    tool_use: ToolUse | None = None
    template_kwargs: dict | None = None


@torch.no_grad()
def evaluate_generations(
    models: EvalModels,
    prompts: EvalPrompts,
    sampling: EvalSampling,
    metrics: dict[str, object],
    *,
    device=None,
    engine: RolloutEngine | None = None,
    seed: int | None = None,
) -> list[dict]:
    """Rows of sampled completions of `prompts`, scored by the reward model and `metrics`. The KL is of the
    policy's sampling distribution (logits / temperature) to the reference's at the same temperature, on these
    samples: an estimate only when they are sampled.

    Metric functions receive the prompts' columns as keywords, and `completion_ids` when they take it. `engine`
    samples (our decode loop when None); `seed`: the base seed of an engine's requests (the batch's offset added).
    With sampling.tool_use, each prompt is a tool episode (`rollout/episodes.py`); its row's completion is the
    transcript on one line (`transcript_line`: a table shows a cell's first line only), metric functions receive
    the transcript's messages, and the KL reads the model's tokens only."""
    policy, tokenizer, settings = models.policy, models.tokenizer, sampling.settings
    kl_temperature = 1.0 if settings.greedy else settings.temperature
    was_training = policy.training
    policy.eval()
    for model in (models.ref_model, models.reward_model):
        if model is not None and device is not None:
            model.to(device)
    tools = None
    if sampling.tool_use is not None:
        length = context_length(policy)
        limits = (sampling.max_prompt_length, length, sampling.template_kwargs)
        tools = ToolRollout(sampling.tool_use, tokenizer, [], *limits)
    spec = SamplingSpec(settings, tokenizer.pad_token_id, tuple(sampling.stop_token_ids), tools=tools)
    rows: list[dict] = []
    for start in range(0, len(prompts.prompts), sampling.batch_size):
        chunk = prompts.prompts[start : start + sampling.batch_size]
        ids = tokenize_prompts(tokenizer, chunk, sampling.max_prompt_length)
        query_ids, query_mask = left_pad(ids, tokenizer.pad_token_id)
        if device is not None:
            query_ids, query_mask = query_ids.to(device), query_mask.to(device)
        batch = slice(start, start + sampling.batch_size)
        chunk_rows = _chunk_rows(chunk, prompts, batch) if tools is not None else None
        batch_seed = None if seed is None else seed + start
        request = {"seed": batch_seed, "rows": chunk_rows}
        rollout = collect_rollout(policy, None, query_ids, query_mask, spec, engine=engine, passes=NEITHER, **request)
        rows += _scored_rows(rollout, chunk, batch, (models, metrics, prompts, kl_temperature))
    policy.train(was_training)
    return rows


def _scored_rows(rollout, chunk, batch: slice, scoring: tuple) -> list[dict]:
    """One batch's rows from its rollout: the KLs (over the model's tokens), the reward model's score, the
    metric functions' values (of the transcripts, for tool episodes)."""
    models, metrics, prompts, kl_temperature = scoring
    policy, ref_model, reward_model, tokenizer = models.policy, models.ref_model, models.reward_model, models.tokenizer
    prompt_messages, columns = prompts.messages, prompts.columns
    args = (rollout.query_ids, rollout.query_mask, rollout.responses, rollout.resp_mask)
    kls = {}
    if ref_model is not None or is_peft(policy):  # the caller loads a reference even for GRPO with beta 0
        kls = completion_kl(policy, ref_model, *args, temperature=kl_temperature, mask=rollout.model_mask())
    scores = sequence_scores(reward_model, *args, rollout.last_index) if reward_model is not None else None
    record = rollout.episodes
    if record is None:
        completions = scored = decode_responses(tokenizer, rollout.responses, rollout.resp_mask)
    else:
        completions, scored = record.lines(), record.transcripts
    extra = _metric_values(
        metrics, chunk, scored, prompt_messages, columns, batch, rollout.responses, rollout.resp_mask
    )
    return _rows(chunk, completions, scores, extra, kls, rollout.model_mask(), rollout.has_stop, record)


def _metric_values(
    metrics: dict[str, object],
    chunk: list[str],
    completions: list[str],
    prompt_messages: Sequence[list[dict]] | None,
    columns: dict[str, Sequence] | None,
    batch: slice,
    responses: torch.Tensor,
    resp_mask: torch.Tensor,
) -> dict[str, list]:
    """Each metric function's values on one batch, called as GRPO calls its reward functions: messages for
    conversational prompts, the dataset's other columns as keywords, `completion_ids` to those that take it."""
    if prompt_messages is None:
        scored = (chunk, completions)
    elif completions and not isinstance(completions[0], str):  # tool episodes' transcripts: message lists already
        scored = (list(prompt_messages[batch]), completions)
    else:
        scored = (list(prompt_messages[batch]), assistant_messages(completions))
    kwargs = {k: list(v[batch]) for k, v in (columns or {}).items()}
    ids = completion_ids(responses, resp_mask)
    return {
        name: call_scoring_function(
            name,
            fn,
            prompts=scored[0],
            completions=scored[1],
            **kwargs,
            **({"completion_ids": ids} if accepts(fn, "completion_ids") and "completion_ids" not in kwargs else {}),
        )
        for name, fn in metrics.items()
    }


def _chunk_rows(chunk, prompts: EvalPrompts, batch: slice) -> list[dict]:
    """One batch's prompt rows as the pipeline holds them (prompt, messages, other columns): a tool episode's."""
    rows = [{"prompt": p} for p in chunk]
    for i, row in enumerate(rows):
        if prompts.messages is not None:
            row["prompt_messages"] = prompts.messages[batch][i]
        row.update({k: list(v[batch])[i] for k, v in (prompts.columns or {}).items()})
    return rows


def _rows(chunk, completions, scores, extra, kls, resp_mask, has_stop, record=None) -> list[dict]:
    """One batch's rows: prompt, completion, score, metric values, KLs, length (the model's tokens, the stop token
    not counted), whether it stopped; for tool episodes the completion is the transcript and the calls, failures
    and turns are columns."""
    rows = []
    for i, (prompt, completion) in enumerate(zip(chunk, completions)):
        row = {"prompt": prompt, "completion": completion}
        if scores is not None:
            row["score"] = float(scores[i])
        row.update({name: values[i] for name, values in extra.items()})
        row.update({name: float(values[i]) for name, values in kls.items()})
        row["length"] = int(resp_mask[i].sum()) - int(bool(has_stop[i]))
        row["stopped"] = bool(has_stop[i])
        if record is not None:  # the transcript is long: its last answer in a column of its own, first
            row = {"prompt": prompt, "final_answer": final_answer(record.transcripts[i]), **row}
            row.update(tool_calls=record.calls[i], tool_failures=record.failures[i], turns=record.turns[i])
        rows.append(row)
    return rows


@torch.no_grad()
def completion_kl(
    policy,
    ref_model,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    responses: torch.Tensor,
    resp_mask: torch.Tensor,
    *,
    temperature: float,
    mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """KL(policy || reference) per completion (B,), summed over its tokens, both distributions at
    `temperature` (logits / temperature): {"kl_exact": over the whole vocabulary at each position, "kl": k1,
    "kl_k3": k3}. From the policy's own samples k1 is unbiased and k3 unbiased and never negative; the
    exact one needs no sample at all. `ref_model` None: a PEFT policy with its adapters disabled. Both models'
    whole logits are needed for the exact one: they are computed for a few rows at a time, LOGITS_CHUNK_TOKENS
    response positions of each model."""
    mask = resp_mask if mask is None else mask  # the tokens summed over (a tool episode's model ones)
    rows = max(1, LOGITS_CHUNK_TOKENS // max(1, responses.shape[1]))
    plan = [list(range(start, min(start + rows, len(responses)))) for start in range(0, len(responses), rows)]
    per_row = partial(_completion_kl, policy, ref_model, temperature)
    kls = over_micro_batches(per_row, plan, query_ids, query_mask, responses, resp_mask, mask)
    return dict(zip(("kl_exact", "kl", "kl_k3"), kls, strict=True))


def _completion_kl(policy, ref_model, temperature: float, query_ids, query_mask, responses, resp_mask, mask):
    args = (query_ids, query_mask, responses, resp_mask)
    logits = response_logits(policy, *args, temperature=temperature)
    with reference_context(policy, ref_model):
        ref_logits = response_logits(ref_model or policy, *args, temperature=temperature)
    mask = mask.float()
    logp, _ = logprobs_from_logits(logits, responses, resp_mask)
    ref_logp, _ = logprobs_from_logits(ref_logits, responses, resp_mask)
    return (
        (exact_kl_per_token(logits, ref_logits) * mask).sum(1),
        (kl_per_token(logp, ref_logp, "k1") * mask).sum(1),
        (kl_per_token(logp, ref_logp, "k3") * mask).sum(1),
    )


def ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Distinct n-grams over all n-grams of all texts (whitespace words; Li et al. 2016); 0.0 with none."""
    grams = [g for text in texts for g in ngrams(text.split(), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def repeated_ngram_rate(texts: Sequence[str], n: int = 2) -> float:
    """The share of n-grams that repeat an n-gram earlier in the same text ("was good was good": 1 of 3
    bigrams); degenerate repetition drives it up. 0.0 with no n-grams."""
    total = repeats = 0
    for text in texts:
        grams = ngrams(text.split(), n)
        total += len(grams)
        repeats += len(grams) - len(set(grams))
    return repeats / total if total else 0.0


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of `values` by linear interpolation (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize_rows(rows: list[dict]) -> dict[str, float]:
    """Means of every numeric column (eval/<column>_mean), the median and p90 of SPREAD_COLUMNS
    (eval/kl_exact_median, eval/kl_exact_p90), and over the completions: eval/distinct_1,
    eval/distinct_2, eval/repeated_ngram_rate (bigrams) and eval/stop_rate."""
    keys = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)] if rows else []
    out = {}
    for key in keys:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[f"eval/{key}_mean"] = sum(values) / len(values)
            if key in SPREAD_COLUMNS:
                out[f"eval/{key}_median"] = quantile(values, 0.5)
                out[f"eval/{key}_p90"] = quantile(values, 0.9)
    if rows and "completion" in rows[0]:
        texts = [str(r["completion"]) for r in rows]
        out["eval/distinct_1"] = distinct_n(texts, 1)
        out["eval/distinct_2"] = distinct_n(texts, 2)
        out["eval/repeated_ngram_rate"] = repeated_ngram_rate(texts)
        if "stopped" in rows[0]:
            out["eval/stop_rate"] = sum(bool(r["stopped"]) for r in rows) / len(rows)
    return out
