from rlhf_core.config.evaluation import Gates
from rlhf_core.evaluation.pairwise import LOSS, TIE, WIN, compare
from rlhf_core.evaluation.promotion import Comparison, decide, eval_kl

GATES = Gates(min_win_rate=0.5, max_kl=10.0, min_value=None)
CLEAR_WIN = compare([WIN] * 40 + [TIE] * 10 + [LOSS] * 14, seed=0)  # 0.70, interval well above 0.5
NEAR_EVEN = compare([WIN] * 30 + [TIE] * 4 + [LOSS] * 30, seed=0)  # 0.50


def against_champion(result, kl=1.0, mean=0.4):
    return Comparison("champion v1", True, result, kl, column="vader", candidate_mean=mean, opponent_mean=0.3)


def test_against_a_champion_the_interval_lower_bound_must_clear_min_win_rate():
    won = decide(against_champion(CLEAR_WIN), GATES)
    assert won.promote and CLEAR_WIN.ci_low > 0.5 and "above promote.min_win_rate 0.5" in won.reason
    even = decide(against_champion(NEAR_EVEN), GATES)
    assert not even.promote and "not better with 95% confidence" in even.reason
    # a higher mean is not enough: the prompts decide
    assert not decide(against_champion(NEAR_EVEN, mean=0.9), GATES).promote
    stricter = Gates(min_win_rate=CLEAR_WIN.ci_low, max_kl=None, min_value=None)
    assert not decide(against_champion(CLEAR_WIN), stricter).promote  # above, not at


def test_with_no_champion_a_mean_passes_the_floor_and_a_judge_must_beat_its_start():
    start = Comparison("its start (sft)", False, NEAR_EVEN, 1.0, column="vader", candidate_mean=0.2)
    assert decide(start, GATES).promote  # as before this issue: min_value only
    floored = decide(start, Gates(0.5, None, min_value=0.3))
    assert not floored.promote and "below promote.min_value 0.3" in floored.reason
    judged = Comparison("its start (sft)", False, NEAR_EVEN, 1.0)  # a judge: no mean
    assert judged.by_win_rate and not decide(judged, GATES).promote
    assert decide(Comparison("its start (sft)", False, CLEAR_WIN, 1.0), GATES).promote


def test_the_kl_gate_refuses_even_a_clear_winner():
    d = decide(against_champion(CLEAR_WIN, kl=12.5), GATES)
    assert not d.promote and "12.500" in d.reason and "max_kl" in d.reason
    assert decide(against_champion(CLEAR_WIN, kl=12.5), Gates(0.5, None, None)).promote  # no KL gate


def test_a_non_finite_mean_is_never_promoted():
    d = decide(against_champion(CLEAR_WIN, mean=float("nan")), GATES)
    assert not d.promote and "not finite" in d.reason


def test_a_candidate_that_broke_a_guard_rule_is_refused_whatever_its_wins():
    decision = decide(against_champion(CLEAR_WIN), GATES, broken=["kl_budget", "min_distinct_ratio"])
    assert not decision.promote
    assert decision.reason.startswith("the candidate broke guard rules kl_budget, min_distinct_ratio")
    assert decide(against_champion(CLEAR_WIN), GATES, broken=[""]).promote  # an empty guard.broken tag: it passed


def test_eval_kl_reads_exact_then_k3_then_k1():
    assert eval_kl({"eval/kl_mean": 1.0, "eval/kl_k3_mean": 4.0}) == 4.0
    assert eval_kl({"eval/kl_mean": 1.0, "eval/kl_k3_mean": 4.0, "eval/kl_exact_mean": 2.0}) == 2.0
    assert eval_kl({}) is None


def test_alignment_markdown_tables_before_and_after_with_the_guards_verdict():
    from rlhf_core.evaluation.promotion import alignment_markdown

    history = {
        0: {"eval/vader_mean": 0.0, "eval/kl_exact_mean": 0.0, "eval/length_mean": 4.0},
        40: {"eval/vader_mean": 0.5, "eval/kl_exact_mean": 2.5, "eval/length_mean": 3.6, "eval/length_ratio": 0.9},
    }
    text = alignment_markdown(history, 40, "vader", ["guard kl_budget at step 20: eval KL 3.4 nats > 3"])
    assert text.splitlines()[:5] == [
        "|  | before (step 0) | after (step 40) | after / before |",
        "|---|---|---|---|",
        "| gold (vader) | 0.000 | 0.500 |  |",
        "| eval KL to the initial policy (exact, nats: mean) | 0.000 | 2.500 |  |",
        "| mean length (tokens, stop token not counted) | 4.00 | 3.60 | 0.90 |",
    ]
    assert text.endswith("Guard: 1 trigger(s)\n- guard kl_budget at step 20: eval KL 3.4 nats > 3")
    assert alignment_markdown(history, 80, "vader", []) == ""  # no evaluation of that step
