"""bench/studies/demo_seeds.py and its user's check (bench/helpers/heldout_check.py): the line's targets and what
the check counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.helpers.heldout_check import NUM_HELDOUT, compare, heldout_prompts
from bench.studies.demo_seeds import line, meets_targets, row_from_summary

GOLD = "vader_compound"


def summary(length_ratio: float, gain: float = 0.5) -> dict:
    at = {"eval/kl_exact_mean": 2.5, "eval/length_ratio": length_ratio, "eval/distinct_2_ratio": 0.9}
    return {
        "gold_metric": GOLD,
        "selected_step": 120,
        "eval_history": {"0": {f"eval/{GOLD}_mean": 0.0}, "120": {f"eval/{GOLD}_mean": gain, **at}},
    }


@pytest.mark.parametrize(("ratio", "meets"), [(0.76, True), (0.74, False), (1.24, True), (1.26, False)])
def test_the_length_target_is_25_percent_either_way(ratio, meets):
    assert meets_targets(row_from_summary(summary(ratio), {"all_triggers": []})) is meets


def test_a_second_trigger_or_a_small_gain_misses():
    assert not meets_targets(row_from_summary(summary(1.0), {"all_triggers": [{}, {}], "rollbacks": 2}))
    assert not meets_targets(row_from_summary(summary(1.0, gain=0.449), {}))


def test_the_line_puts_the_length_beside_the_gain():
    row = {"seed": 1, "algorithm": "ppo", **row_from_summary(summary(0.8), {}), "seconds": 1.0}
    cells = [c.strip() for c in line(row).split("|")]
    assert cells[4:6] == ["+0.500", "x0.80"]


def test_the_check_reads_every_held_out_prompt_and_a_policy_against_itself_reads_even(smoke_world):
    prompts = heldout_prompts()
    assert len(prompts) == NUM_HELDOUT == len({p[0]["content"] for p in prompts})
    model = Path(smoke_world.base_model)
    result = compare(model, model, samples=1, max_new_tokens=4)
    assert result["check_gain"] == 0.0 and result["check_length_ratio"] == 1.0
    start = result["check_words"][0]
    assert 0 < start <= 4  # words of at most 4 tokens, the stop token not among them
    assert all(len(answer.split()) <= 4 and "<|" not in answer for answer in result["check_examples"]["sft"])
