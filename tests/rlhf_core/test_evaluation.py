"""rlhf_core/evaluation.py: generation evaluation rows and their summary (the flows run it end to end)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

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


class FixedLM(torch.nn.Module):
    """A causal LM whose next-token logits are the same table at every position (a fixed tiny policy)."""

    def __init__(self, logits):
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(logits, dtype=torch.float32))

    def forward(self, input_ids, logits_to_keep=0, **_):
        batch, length = input_ids.shape
        return SimpleNamespace(logits=self.table.expand(batch, length, -1)[:, -logits_to_keep:])


def test_eval_kl_equals_the_hand_computed_value_at_the_sampling_temperature():
    from rlhf_core.evaluation import completion_kl

    policy, ref = FixedLM([2.0, 0.0, 0.0]), FixedLM([0.0, 0.0, 0.0])
    query, query_mask = torch.tensor([[1], [1]]), torch.ones(2, 1, dtype=torch.long)
    responses, resp_mask = torch.tensor([[0, 1], [2, 0]]), torch.tensor([[1, 1], [1, 0]])
    k1, k3 = completion_kl(policy, ref, query, query_mask, responses, resp_mask, temperature=2.0)
    # at temperature 2: p = softmax([1, 0, 0]) = [e, 1, 1] / (e + 2); the reference is uniform, q = 1/3
    e = math.e
    p = [e / (e + 2), 1 / (e + 2), 1 / (e + 2)]

    def k3_token(i):
        r = (1 / 3) / p[i]
        return r - 1 - math.log(r)

    expected_k1 = [math.log(3 * p[0]) + math.log(3 * p[1]), math.log(3 * p[2])]
    expected_k3 = [k3_token(0) + k3_token(1), k3_token(2)]
    torch.testing.assert_close(k1, torch.tensor(expected_k1))
    torch.testing.assert_close(k3, torch.tensor(expected_k3))
    assert (k3 >= 0).all()
    # the exact KL of one token is k1's expectation under p, never negative
    assert sum(pi * math.log(3 * pi) for pi in p) > 0


def test_distinct_n_and_repetition_on_fixed_strings():
    from rlhf_core.evaluation import distinct_n, repeated_ngram_rate

    texts = ["good food .", "good food .", "bad service ."]
    assert distinct_n(texts, 1) == pytest.approx(5 / 9)  # good food . bad service
    assert distinct_n(texts, 2) == pytest.approx(4 / 6)  # (good food) (food .) (bad service) (service .)
    assert distinct_n(["a"], 2) == 0.0 and distinct_n([], 1) == 0.0
    assert repeated_ngram_rate(["was good was good"]) == pytest.approx(1 / 3)  # (was good) again, of 3
    assert repeated_ngram_rate(["basic was basic was basic was"]) == pytest.approx(3 / 5)
    assert repeated_ngram_rate(texts) == 0.0  # repeats across completions are distinct-n's business


def test_summary_has_diversity_and_stop_rate():
    rows = [
        {"prompt": "p", "completion": "good food .", "length": 4, "stopped": True},
        {"prompt": "p", "completion": "good good good good", "length": 4, "stopped": False},
    ]
    summary = summarize_rows(rows)
    assert summary["eval/stop_rate"] == 0.5 and summary["eval/length_mean"] == 4.0
    assert summary["eval/distinct_1"] == pytest.approx(3 / 7)
    assert summary["eval/repeated_ngram_rate"] == pytest.approx(2 / 5)
    assert "eval/stopped_mean" not in summary
