import pytest

from rlhf_core.evaluation.promotion import Gates, decide

GATES = Gates(metric="vader", min_improvement=0.05, max_kl=10.0, min_value=None)


def summary(vader, kl=1.0):
    return {"eval/vader_mean": vader, "eval/kl_mean": kl, "eval/length_mean": 6.0}


def test_first_promotion_passes_the_absolute_gates():
    d = decide(summary(0.2), None, GATES)
    assert d.promote and d.champion_value is None and d.candidate_value == 0.2 and d.candidate_kl == 1.0
    refused = decide(summary(0.2), None, Gates("vader", 0.05, 10.0, min_value=0.3))
    assert not refused.promote and "min_value" in refused.reason


def test_the_candidate_must_win_by_min_improvement():
    assert decide(summary(0.36), summary(0.30), GATES).promote  # +0.06 >= 0.05
    worse = decide(summary(0.34), summary(0.30), GATES)  # +0.04 < 0.05
    assert not worse.promote and "+0.0400" in worse.reason and worse.champion_value == 0.30


def test_the_kl_gate_refuses_even_a_better_candidate():
    d = decide(summary(0.9, kl=12.5), summary(0.3), GATES)
    assert not d.promote and "12.500" in d.reason and "max_kl" in d.reason
    assert decide(summary(0.9, kl=12.5), None, Gates("vader", 0.0, None, None)).promote  # no KL gate


def test_a_metric_the_evaluation_lacks_is_named():
    with pytest.raises(ValueError, match="promote.metric 'score'"):
        decide(summary(0.1), None, Gates("score", 0.0, None, None))


def test_min_value_is_a_floor_with_or_without_a_champion():
    gates = Gates("vader", 0.05, None, min_value=0.5)
    assert not decide(summary(0.4), None, gates).promote
    below = decide(summary(0.45), summary(0.1), gates)  # +0.35 over the champion, still under the floor
    assert not below.promote and "min_value" in below.reason
    assert decide(summary(0.6), summary(0.5), gates).promote


def test_without_min_improvement_the_candidate_must_be_strictly_better():
    gates = Gates("score", None, None, min_value=0.0)
    assert decide({"eval/score_mean": 0.31}, {"eval/score_mean": 0.30}, gates).promote
    tie = decide({"eval/score_mean": 0.30}, {"eval/score_mean": 0.30}, gates)
    assert not tie.promote and "not above 0" in tie.reason
    assert not decide({"eval/score_mean": 0.2}, {"eval/score_mean": 0.30}, gates).promote


def test_a_non_finite_metric_is_never_promoted():
    d = decide(summary(float("nan")), None, Gates("vader", None, None, None))
    assert not d.promote and "not finite" in d.reason


def test_a_candidate_that_broke_a_guard_rule_is_refused_whatever_its_metric():
    from rlhf_core.evaluation.promotion import Gates, decide

    gates = Gates("vader_compound", None, 20.0, None)
    good = {"eval/vader_compound_mean": 0.9, "eval/kl_mean": 1.0}
    decision = decide(good, None, gates, broken=["kl_budget", "min_distinct_ratio"])
    assert not decision.promote
    assert decision.reason.startswith("the candidate broke guard rules kl_budget, min_distinct_ratio")
    assert decide(good, None, gates, broken=[""]).promote  # an empty guard.broken tag: it passed


def test_the_kl_gate_reads_k3_when_it_was_measured():
    from rlhf_core.evaluation.promotion import Gates, decide

    gates = Gates("vader_compound", None, 3.0, None)
    # k1 can read low (or negative) on few samples; k3 is never negative and is preferred
    decision = decide({"eval/vader_compound_mean": 0.9, "eval/kl_mean": 1.0, "eval/kl_k3_mean": 4.0}, None, gates)
    assert not decision.promote and decision.candidate_kl == 4.0 and "exceeds promote.max_kl 3.0" in decision.reason


def test_alignment_markdown_tables_before_and_after_with_the_guards_verdict():
    from rlhf_core.evaluation.promotion import alignment_markdown

    history = {
        0: {"eval/vader_mean": 0.0, "eval/kl_exact_mean": 0.0, "eval/length_mean": 4.0},
        40: {"eval/vader_mean": 0.5, "eval/kl_exact_mean": 2.5, "eval/length_mean": 3.6, "eval/length_ratio": 0.9},
    }
    text = alignment_markdown(history, 40, "vader", ["guard kl_budget at step 20: eval KL 3.4 nats > 3"])
    assert text.splitlines()[:5] == [
        "| | before (step 0) | after (step 40) | after / before |",
        "|---|---|---|---|",
        "| gold (vader) | 0.000 | 0.500 |  |",
        "| eval KL to the initial policy (exact, nats: mean) | 0.000 | 2.500 |  |",
        "| mean completion length (tokens) | 4.00 | 3.60 | 0.90 |",
    ]
    assert text.endswith("Guard: 1 trigger(s)\n- guard kl_budget at step 20: eval KL 3.4 nats > 3")
    assert alignment_markdown(history, 80, "vader", []) == ""  # no evaluation of that step
