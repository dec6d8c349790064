"""rlhf_core/evaluation/generations.py: generation evaluation rows and their summary (the flows run it end to end)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlhf_core.evaluation.generations import (
    EvalModels,
    EvalPrompts,
    EvalSampling,
    _rows,
    evaluate_generations,
    summarize_rows,
)
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rollout.sampling import SamplingSettings


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
        EvalModels(policy, tok),
        EvalPrompts(prompts),
        EvalSampling(SamplingSettings(response_length=4), max_prompt_length=16, batch_size=1),
        metrics={"chars": lambda prompts, completions, **_: [float(len(c)) for c in completions]},
    )
    assert [r["prompt"] for r in rows] == prompts
    for row in rows:
        assert (
            0 <= row["length"] <= 4 - row["stopped"]
            and row["chars"] == float(len(row["completion"]))
            and "kl" not in row
        )
    assert summarize_rows(rows)["eval/length_mean"] == pytest.approx(sum(r["length"] for r in rows) / 2)


def test_conversational_prompts_reach_metric_functions_as_messages(smoke_world):
    """As GRPO's reward functions (TRL's convention): prompts as message lists, completions as assistant turns."""
    from rlhf_core.data.chat import prompt_columns
    from rlhf_core.demo.world import world_rows
    from rlhf_core.rewards.functions import vader_compound

    tok = load_tokenizer(str(smoke_world.tokenizer))
    policy = load_causal_lm(str(smoke_world.base_model))
    prompts, messages = prompt_columns(world_rows(smoke_world, "prompt", "test")[:3])
    assert messages is not None and prompts[0].endswith("<|im_start|>assistant\n")
    seen = []

    def record(prompts, completions, **_):
        seen.append((prompts, completions))
        return [0.0] * len(completions)

    rows = evaluate_generations(
        EvalModels(policy, tok),
        EvalPrompts(prompts, messages=messages),
        EvalSampling(SamplingSettings(response_length=4), max_prompt_length=20, batch_size=2),
        metrics={"record": record, "vader": vader_compound},
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
    from rlhf_core.evaluation.generations import completion_kl

    policy, ref = FixedLM([2.0, 0.0, 0.0]), FixedLM([0.0, 0.0, 0.0])
    query, query_mask = torch.tensor([[1], [1]]), torch.ones(2, 1, dtype=torch.long)
    responses, resp_mask = torch.tensor([[0, 1], [2, 0]]), torch.tensor([[1, 1], [1, 0]])
    kls = completion_kl(policy, ref, query, query_mask, responses, resp_mask, temperature=2.0)
    # at temperature 2: p = softmax([1, 0, 0]) = [e, 1, 1] / (e + 2); the reference is uniform, q = 1/3
    e = math.e
    p = [e / (e + 2), 1 / (e + 2), 1 / (e + 2)]

    def k3_token(i):
        r = (1 / 3) / p[i]
        return r - 1 - math.log(r)

    expected_k1 = [math.log(3 * p[0]) + math.log(3 * p[1]), math.log(3 * p[2])]
    expected_k3 = [k3_token(0) + k3_token(1), k3_token(2)]
    torch.testing.assert_close(kls["kl"], torch.tensor(expected_k1))
    torch.testing.assert_close(kls["kl_k3"], torch.tensor(expected_k3))
    assert (kls["kl_k3"] >= 0).all()
    # the exact KL of one position is k1's expectation under p, whatever token was sampled there
    exact = sum(pi * math.log(3 * pi) for pi in p)
    torch.testing.assert_close(kls["kl_exact"], torch.tensor([2 * exact, exact]))


def rare_token_batch(policy_probs, ref_probs, rare_rows: int, n: int = 64, length: int = 4):
    """Rows of completion_kl for `n` completions of token 0 repeated, `rare_rows` of them with token 1 second."""
    from rlhf_core.evaluation.generations import completion_kl

    policy, ref = FixedLM([math.log(x) for x in policy_probs]), FixedLM([math.log(x) for x in ref_probs])
    responses = torch.zeros(n, length, dtype=torch.long)
    responses[:rare_rows, 1] = 1
    query, query_mask = torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long)
    kls = completion_kl(policy, ref, query, query_mask, responses, torch.ones_like(responses), temperature=1.0)
    return [{name: float(values[i]) for name, values in kls.items()} for i in range(n)]


def test_one_rare_sampled_token_makes_k3_explode_but_neither_the_exact_kl_nor_the_guard():
    from rlhf_core.config import GuardConfig, GuardRule
    from rlhf_core.evaluation.guard import check

    guard = GuardConfig(kl_budget=GuardRule(limit=3.0, action="rollback"))
    # the policy gives token 1 a chance of 1e-5, the reference 0.05; one completion in 64 sampled it
    calm = summarize_rows(rare_token_batch([1 - 2e-5, 1e-5, 1e-5], [0.94, 0.05, 0.01], rare_rows=1))
    assert calm["eval/kl_k3_mean"] > 50  # k3 of that token: 5000 - 1 - log 5000; over 64 completions, 78 nats
    exact_position = (1 - 2e-5) * math.log((1 - 2e-5) / 0.94) + 1e-5 * math.log(1e-5 / 0.05) + 1e-5 * math.log(1e-3)
    assert calm["eval/kl_exact_mean"] == pytest.approx(4 * exact_position, rel=1e-4)  # 0.25 nats
    assert calm["eval/kl_exact_median"] == calm["eval/kl_exact_p90"] == pytest.approx(4 * exact_position, rel=1e-4)
    initial = {"eval/kl_exact_mean": 0.0}
    assert check([(0, initial), (20, calm)], guard, None) == []
    k3_only = {k: v for k, v in calm.items() if not k.startswith("eval/kl_exact")}
    assert [t.rule for t in check([(0, initial), (20, k3_only)], guard, None)] == ["kl_budget"]  # the old guard

    # a policy that truly drifted: most of its mass where the reference puts little
    drifted = summarize_rows(rare_token_batch([0.1, 0.1, 0.8], [0.94, 0.05, 0.01], rare_rows=0))
    (trigger,) = check([(0, initial), (20, drifted)], guard, None)
    assert trigger.rule == "kl_budget" and trigger.action == "rollback" and trigger.value > 12


def test_summary_spread_of_the_exact_kl():
    rows = [{"kl_exact": float(v)} for v in [0.0, 1.0, 2.0, 3.0, 100.0]]
    summary = summarize_rows(rows)
    assert summary["eval/kl_exact_mean"] == pytest.approx(21.2)
    assert summary["eval/kl_exact_median"] == 2.0  # the tail moves the mean, not the median
    assert summary["eval/kl_exact_p90"] == pytest.approx(3.0 + 0.6 * 97.0)  # numpy's linear interpolation
    assert "eval/kl_median" not in summarize_rows([{"kl": 1.0}])


def test_distinct_n_and_repetition_on_fixed_strings():
    from rlhf_core.evaluation.generations import distinct_n, repeated_ngram_rate

    texts = ["good food .", "good food .", "bad service ."]
    assert distinct_n(texts, 1) == pytest.approx(5 / 9)  # good food . bad service
    assert distinct_n(texts, 2) == pytest.approx(4 / 6)  # (good food) (food .) (bad service) (service .)
    assert distinct_n(["a"], 2) == 0.0 and distinct_n([], 1) == 0.0
    assert repeated_ngram_rate(["was good was good"]) == pytest.approx(1 / 3)  # (was good) again, of 3
    assert repeated_ngram_rate(["basic was basic was basic was"]) == pytest.approx(3 / 5)
    assert repeated_ngram_rate(texts) == 0.0  # repeats across completions are distinct-n's business


def test_length_is_the_answers_without_its_stop_token():
    """A user reads "standard ." as two words; the stop token that ended it is not part of the answer, so the
    guard's length ratio is the reader's: 3 -> 2 words reads x0.67, not (3 + 1) / (2 + 1)."""
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])  # the stop token is in the mask
    has_stop = torch.tensor([True, True, False])
    completions = ["standard .", "optimistically", "basic was basic was basic"]  # the last ran out of tokens
    rows = _rows(["p"] * 3, completions, None, {}, {}, mask, has_stop)
    assert [r["length"] for r in rows] == [2, 1, 5] and [r["stopped"] for r in rows] == [True, True, False]
    assert [r["length"] for r in rows] == [len(c.split()) for c in completions]  # the demo's tokens are its words


@pytest.mark.parametrize("name", ["qwen2.5", "qwen2.5-instruct", "llama-3-instruct", "gpt2"])
def test_length_without_the_stop_token_on_real_shaped_tokenizers(name, tmp_path):
    """pad == eos (Qwen2.5 base, GPT-2 with eos as pad), two stop ids (the instruct models), no pad: an answer's
    length is its tokens before its first stop, whichever stop ended it, and the padding after it is not counted."""
    from transformers import GenerationConfig

    from rlhf_core.models.loading import stop_token_ids
    from rlhf_core.rl_math import response_mask
    from tests.fixtures.real_shapes import build_family

    path = build_family(name, tmp_path)
    tok = load_tokenizer(str(path))
    stops = stop_token_ids(tok, GenerationConfig.from_pretrained(path))
    answer = tok("the cat sat .", add_special_tokens=False)["input_ids"]
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    width = len(answer) + 3
    rows = [answer + [stop] + [pad] * 2 for stop in stops] + [(answer * 3)[:width]]  # the last ran out of tokens
    mask, _, has_stop = response_mask(torch.tensor(rows), stops)
    table = _rows(["p"] * len(rows), ["c"] * len(rows), None, {}, {}, mask, has_stop)
    assert [r["length"] for r in table] == [len(answer)] * len(stops) + [width]
    assert [r["stopped"] for r in table] == [True] * len(stops) + [False]


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
