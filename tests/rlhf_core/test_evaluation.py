"""rlhf_core/evaluation.py: generation evaluation rows and their summary (the flows run it end to end)."""

from __future__ import annotations

import pytest

from rlhf_core.evaluation import evaluate_generations, summarize_rows
from rlhf_core.models import load_causal_lm, load_tokenizer


def test_summary_means_every_numeric_column_skipping_missing_values():
    rows = [
        {"prompt": "a", "score": 1.0, "kl": None, "length": 2, "ok": True},
        {"prompt": "b", "score": 3.0, "kl": 0.5, "length": 4, "ok": False},
    ]
    assert summarize_rows(rows) == {"eval/score_mean": 2.0, "eval/length_mean": 3.0}  # kl: None in the first row
    assert summarize_rows([]) == {}


def test_rows_hold_prompt_completion_length_and_the_metric_functions(smoke_world):
    tok = load_tokenizer(str(smoke_world.tokenizer))
    policy = load_causal_lm(str(smoke_world.base_model))
    prompts = ["the movie was", "i think the food"]
    rows = evaluate_generations(
        policy,
        None,
        None,
        tok,
        prompts,
        response_length=4,
        max_prompt_length=16,
        batch_size=1,
        metrics={"chars": lambda prompts, completions, **_: [float(len(c)) for c in completions]},
    )
    assert [r["prompt"] for r in rows] == prompts
    for row in rows:
        assert 0 < row["length"] <= 4 and row["chars"] == float(len(row["completion"])) and "kl" not in row
    assert summarize_rows(rows)["eval/length_mean"] == pytest.approx(sum(r["length"] for r in rows) / 2)


def test_conversational_prompts_reach_metric_functions_as_messages(smoke_world):
    """As GRPO's reward functions (TRL's convention): prompts as message lists, completions as assistant turns."""
    from rlhf_core.chat import prompt_columns
    from rlhf_core.demo_world import world_rows
    from rlhf_core.reward_functions import vader_compound

    tok = load_tokenizer(str(smoke_world.tokenizer))
    policy = load_causal_lm(str(smoke_world.base_model))
    prompts, messages = prompt_columns(world_rows(smoke_world, "prompt", "test")[:3])
    assert messages is not None and prompts[0].endswith("<|im_start|>assistant\n")
    seen = []

    def record(prompts, completions, **_):
        seen.append((prompts, completions))
        return [0.0] * len(completions)

    rows = evaluate_generations(
        policy,
        None,
        None,
        tok,
        prompts,
        response_length=4,
        max_prompt_length=20,
        batch_size=2,
        metrics={"record": record, "vader": vader_compound},
        prompt_messages=messages,
    )
    assert [p for batch, _ in seen for p in batch] == messages
    completions = [c for _, batch in seen for c in batch]
    assert completions == [[{"role": "assistant", "content": r["completion"]}] for r in rows]
    assert [r["vader"] for r in rows] == vader_compound(completions=[r["completion"] for r in rows])
