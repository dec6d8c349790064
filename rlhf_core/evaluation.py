"""Generation evaluation: near-greedy completions of held-out prompts, scored every way we can.

Each row holds the prompt, the completion, the reward model's score, every metric function's value,
the KL of the completion under the policy against the reference (sum over its tokens; absent when
no reference is loaded), and its length. The caller turns rows into MLflow tables, Prefect artifacts and Parquet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf_core.chat import assistant_messages
from rlhf_core.reward_functions import call_scoring_function
from rlhf_core.rl_math import kl_per_token, response_mask
from rlhf_core.rollout import (
    NEAR_GREEDY_TEMPERATURE,
    SamplingSettings,
    decode_responses,
    generate,
    left_pad,
    reference_context,
    response_logprobs,
    sequence_scores,
    tokenize_prompts,
)
from rlhf_core.saving import is_peft


@torch.no_grad()
def evaluate_generations(
    policy,
    ref_model,
    reward_model,
    tokenizer,
    prompts: list[str],
    *,
    response_length: int,
    max_prompt_length: int,
    metrics: dict[str, object],
    batch_size: int,
    greedy: bool = False,
    stop_token_ids: Sequence[int] = (),
    prompt_messages: Sequence[list[dict]] | None = None,
    device=None,
) -> list[dict]:
    """Rows of near-greedy (or greedy) completions of `prompts`, scored by the reward model and `metrics`.

    `prompt_messages`: the prompts' message lists when they are conversational; metric functions then
    receive them and each completion as [{"role": "assistant", "content": text}], as GRPO's reward
    functions do (TRL's convention)."""
    settings = SamplingSettings(
        response_length=response_length, temperature=NEAR_GREEDY_TEMPERATURE, top_k=0, top_p=1.0, greedy=greedy
    )
    was_training = policy.training
    policy.eval()
    for model in (ref_model, reward_model):
        if model is not None and device is not None:
            model.to(device)
    rows: list[dict] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        query_ids, query_mask = left_pad(tokenize_prompts(tokenizer, chunk, max_prompt_length), tokenizer.pad_token_id)
        if device is not None:
            query_ids, query_mask = query_ids.to(device), query_mask.to(device)
        responses = generate(
            policy, query_ids, query_mask, settings, pad_token_id=tokenizer.pad_token_id, stop_token_ids=stop_token_ids
        )
        resp_mask, last_index, _ = response_mask(responses, stop_token_ids)
        kl = None
        if ref_model is not None or is_peft(policy):  # GRPO with beta 0 loads no reference at all
            logp, _ = response_logprobs(policy, query_ids, query_mask, responses, resp_mask)
            with reference_context(policy, ref_model):
                ref_logp, _ = response_logprobs(ref_model or policy, query_ids, query_mask, responses, resp_mask)
            kl = (kl_per_token(logp, ref_logp, "k1") * resp_mask).sum(1)
        scores = (
            sequence_scores(reward_model, query_ids, query_mask, responses, resp_mask, last_index)
            if reward_model is not None
            else None
        )
        completions = decode_responses(tokenizer, responses, resp_mask)
        scored = (
            (chunk, completions)
            if prompt_messages is None
            else (list(prompt_messages[start : start + batch_size]), assistant_messages(completions))
        )
        extra = {
            name: call_scoring_function(name, fn, prompts=scored[0], completions=scored[1])
            for name, fn in metrics.items()
        }
        for i, (prompt, completion) in enumerate(zip(chunk, completions)):
            row = {"prompt": prompt, "completion": completion}
            if scores is not None:
                row["score"] = float(scores[i])
            row.update({name: values[i] for name, values in extra.items()})
            if kl is not None:
                row["kl"] = float(kl[i])
            row["length"] = int(resp_mask[i].sum())
            rows.append(row)
    policy.train(was_training)
    return rows


def summarize_rows(rows: list[dict]) -> dict[str, float]:
    """Means of every numeric column: eval/<column>_mean."""
    keys = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)] if rows else []
    out = {}
    for key in keys:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[f"eval/{key}_mean"] = sum(values) / len(values)
    return out
