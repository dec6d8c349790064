"""pass@k against its definition (every k-subset counted) and hand values; maj@n; the per-prompt columns."""

from itertools import combinations

import pytest

from rlhf_core.evaluation.verifiable import majority_correct, pass_at_k, sampled_columns


@pytest.mark.parametrize("n, c, k", [(8, 0, 1), (8, 3, 1), (8, 3, 4), (8, 7, 2), (5, 5, 5), (6, 2, 5), (10, 1, 10)])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n, c, k):
    samples = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    expected = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_by_hand_and_its_limits():
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    with pytest.raises(ValueError, match="n=4, c=5"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


def test_majority_vote_counts_stripped_answers_and_breaks_ties_by_first_seen():
    assert majority_correct(["12", " 12", "13", "14"], [1.0, 1.0, 0.0, 0.0]) == 1.0
    assert majority_correct(["13", "12", "13", "12"], [0.0, 1.0, 0.0, 1.0]) == 0.0  # tie: "13" came first
    assert majority_correct(["7", "8", "9"], [0.0, 0.0, 1.0]) == 0.0


def test_sampled_columns_are_one_dict_per_prompt():
    rows = [{"completion": c, "exact_match": v} for c, v in [("5", 1.0), ("6", 0.0), ("5", 1.0), ("9", None)]]
    assert sampled_columns(rows, 2, "exact_match", [1, 2]) == [
        {"pass_at_1": 0.5, "pass_at_2": 1.0, "maj_at_2": 1.0},
        {"pass_at_1": 0.5, "pass_at_2": 1.0, "maj_at_2": 1.0},
    ]
    with pytest.raises(ValueError, match="3 sampled rows are not 2 per prompt"):
        sampled_columns(rows[:3], 2, "exact_match", [1])
